import pytest
import torch
from lightning.pytorch.demos import Transformer

from lightning_efficient import DemoGPT
from lightning_efficient.activations import find_blocks
from tests.conftest import tiny_gpt_kwargs


def test_demo_blocks():
    model = DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 3})
    found = find_blocks(model)
    assert [n for n, _ in found] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [m for _, m in found] == list(model.blocks)


def test_lightning_demo_transformer_finds_both_stacks():
    names = [n for n, _ in find_blocks(Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=2))]
    assert names == ["transformer.encoder.layers.0", "transformer.encoder.layers.1",
                     "transformer.decoder.layers.0", "transformer.decoder.layers.1"]


def test_hugging_face_decoder_layers():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=64))
    assert [type(m).__name__ for _, m in find_blocks(gpt2)] == ["GPT2Block"] * 3
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, vocab_size=100))
    assert [n for n, _ in find_blocks(llama)] == ["model.layers.0", "model.layers.1"]
    assert [n for n, _ in find_blocks(llama, ["LlamaDecoderLayer"])] == ["model.layers.0", "model.layers.1"]


def test_names_and_patterns_and_candidates():
    model = DemoGPT(**tiny_gpt_kwargs())
    assert [n for n, _ in find_blocks(model, ["Block"])] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in find_blocks(model, ["blocks.1"])] == ["blocks.1"]
    with pytest.raises(ValueError, match=r"blocks=\['Nope'\] matches no module; candidates: Block, blocks\.\*"):
        find_blocks(model, ["Nope"])
    with pytest.raises(ValueError, match="found no ModuleList"):
        find_blocks(torch.nn.Linear(2, 2))


def test_a_one_block_model_still_has_its_block():
    model = DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 1})
    assert [n for n, _ in find_blocks(model)] == ["blocks.0"]
    # a lone layer in a list is not a block
    with pytest.raises(ValueError, match="found no ModuleList"):
        find_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])))
