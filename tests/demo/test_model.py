import math

import pytest
import torch
import torch.nn.functional as F

from lightning_efficient import DemoGPT, TokenLosses
from tests.conftest import tiny_gpt_kwargs


def _batch(vocab=512, batch=3, seq=32):
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, -5:] = -100
    labels[2, :7] = -100
    return {"input_ids": torch.randint(0, vocab, (batch, seq)), "labels": labels}


def test_token_losses_shape_mask_and_mean_match_cross_entropy():
    model = DemoGPT(**tiny_gpt_kwargs())
    batch = _batch()
    out = model.token_losses(batch)
    assert isinstance(out, TokenLosses)
    assert out.token_losses.shape == batch["labels"].shape
    assert torch.equal(out.mask, batch["labels"] != -100)
    logits = model(batch["input_ids"])
    reference = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(out["loss"], reference, rtol=1e-6, atol=1e-6)
    assert torch.all(out.token_losses[~out.mask] == 0)


def test_training_step_returns_the_plain_mean_as_loss():
    model = DemoGPT(**tiny_gpt_kwargs())
    batch = _batch()
    out = model.training_step(batch, 0)
    expected = out.token_losses[out.mask].mean()
    torch.testing.assert_close(out["loss"], expected)
    out["loss"].backward()
    assert model.tok_emb.weight.grad is not None


def test_tied_head_shares_the_embedding():
    model = DemoGPT(**tiny_gpt_kwargs())
    assert model.head.weight is model.tok_emb.weight
    untied = DemoGPT(**tiny_gpt_kwargs(), tie_embeddings=False)
    assert untied.head.weight is not untied.tok_emb.weight


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("d_model", 31, "multiple of n_heads"),
        ("seq_len", 0, "integer >= 1"),
        ("vocab_size", 255, "integer >= 256"),
        ("dropout", 1.0, "[0, 1)"),
        ("n_layers", 0, "integer >= 1"),
    ],
)
def test_invalid_settings_name_the_argument(name, value, fragment):
    kwargs = tiny_gpt_kwargs()
    kwargs[name] = value
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*") as info:
        DemoGPT(**kwargs)
    assert fragment in str(info.value)


def test_too_long_input_is_refused():
    model = DemoGPT(**tiny_gpt_kwargs())
    with pytest.raises(ValueError, match="longer than seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_test_step_and_predict_step(small_datamodule_kwargs):
    import lightning

    from lightning_efficient import CorpusDataModule

    model = DemoGPT(**tiny_gpt_kwargs())
    data = CorpusDataModule(**small_datamodule_kwargs)
    trainer = lightning.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=3, limit_test_batches=3, limit_predict_batches=2,
    )
    val_loss = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    predictions = trainer.predict(model, datamodule=data)
    # reference: the token-weighted mean cross-entropy over the first three held-out batches, in float64
    batches = [b for _, b in zip(range(3), data.test_dataloader())]
    with torch.no_grad():
        total = sum(
            F.cross_entropy(model(b["input_ids"]).double().flatten(0, 1), b["labels"].flatten(), ignore_index=-100,
                            reduction="sum")
            for b in batches
        )
    count = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert tested["test_loss"] == pytest.approx(total.item() / count, rel=1e-5)
    assert tested["test_loss"] == pytest.approx(val_loss, rel=1e-6)
    assert tested["test_ppl"] == pytest.approx(math.exp(tested["test_loss"]), rel=1e-5)
    assert len(predictions) == 2
    with torch.no_grad():
        expected = model(batches[0]["input_ids"]).argmax(-1)
    assert torch.equal(predictions[0], expected)
