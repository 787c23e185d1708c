import warnings

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


def test_a_hybrid_stack_of_attention_and_state_space_layers_is_found_and_checkpointed_exactly():
    """A new user's trial: Jamba's layers (Mamba and attention decoder layers in one ModuleList) were not found by
    blocks='auto' ("candidates: none"). A stack of several composite classes, one repeated, is a stack of blocks."""
    transformers = pytest.importorskip("transformers")
    from lightning_efficient.activations.policies import unwrap_block, wrap_block

    torch.manual_seed(0)
    jamba = transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=4,
        mamba_dt_rank=4))
    found = find_blocks(jamba)
    assert [n for n, _ in found] == [f"model.layers.{i}" for i in range(4)]
    assert len({type(m) for _, m in found}) == 2
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def gradients():
        jamba.zero_grad()
        jamba(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # (as ActivationMemory sets it)
        return [p.grad.clone() for p in jamba.parameters() if p.grad is not None]

    plain = gradients()
    for _, block in found:
        wrap_block(block, "checkpoint")
    checkpointed = gradients()
    for _, block in found:
        unwrap_block(block)
    assert len(plain) == len(checkpointed) and all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
    # a stack of one class inside the hybrid stack's layers is theirs (transformers 4's Jamba: each MoE layer's experts
    # in a ModuleList, which won over the layers)
    mixer = jamba.model.layers[1].feed_forward
    mixer.extra_experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(8))
    assert [n for n, _ in find_blocks(jamba)] == [f"model.layers.{i}" for i in range(4)]
    del mixer.extra_experts
    # beside a stack of one class a hybrid one is not taken (a review: wav2vec2's 7 feature-extractor convolutions,
    # one with a GroupNorm and six without, beat its 2 transformer layers)
    wav2vec2 = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, conv_dim=(8,) * 7, feat_extract_norm="group"))
    assert [n for n, _ in find_blocks(wav2vec2)] == ["encoder.layers.0", "encoder.layers.1"]
    # a list of distinct parts (an encoder and a decoder) is no stack: none of its classes repeats
    parts = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.TransformerEncoderLayer(4, 1)]))
    with pytest.raises(ValueError, match="found no ModuleList"):
        find_blocks(parts)


class _Distillation(torch.nn.Module):
    """A trained 2-layer student beside a larger frozen teacher (run under no_grad in a distillation)."""

    def __init__(self, frozen_student: bool = False) -> None:
        super().__init__()
        self.student = DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 2})
        self.teacher = DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 4}).requires_grad_(False)
        if frozen_student:
            self.student.requires_grad_(False)


def test_auto_warns_where_the_largest_stack_is_frozen_beside_one_that_trains():
    # a new user's trial: a frozen teacher's 4 layers (run under no_grad) were taken over the student's 2, silently; a
    # backbone frozen until a fine-tuning callback unfreezes it looks the same and is the stack to take (a review): the
    # largest is taken, with a warning naming the stack that trains
    with pytest.warns(UserWarning, match=r"blocks='auto' took teacher\.blocks\.\* .* over student\.blocks\.\*, which train.*"
                                         r"blocks=\['student\.blocks\.\*'\]"):
        found = find_blocks(_Distillation())
    assert [n for n, _ in found] == [f"teacher.blocks.{i}" for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_blocks(_Distillation(frozen_student=True))  # nothing trains: nothing to say
        model = _Distillation()
        model.teacher.blocks[3].requires_grad_(True)  # the largest stack trains (in part): nothing to say
        assert [n for n, _ in find_blocks(model)] == [f"teacher.blocks.{i}" for i in range(4)]
        assert [n for n, _ in find_blocks(_Distillation(), ["student.blocks.*"])] == ["student.blocks.0", "student.blocks.1"]
