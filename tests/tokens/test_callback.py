import lightning
import pytest
import torch
import torch.nn.functional as F

from lightning_efficient import CorpusDataModule, DemoGPT, FusedTokenLoss, SelectiveTokenLoss, TokenLosses
from lightning_efficient.tokens.output import deferred_reduction
from lightning_efficient.tokens.selection import select_tokens
from tests.conftest import tiny_gpt_kwargs


def _trainer(callbacks, steps=3, **kwargs):
    return lightning.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, **{"enable_checkpointing": False, "logger": False, "log_every_n_steps": 1, **kwargs},
    )


def _wrap(model, callback):
    """Wrap ``model.training_step`` as a fit would, without a loop (logging then only warns)."""
    trainer = _trainer([callback])
    callback.setup(trainer, model, "fit")
    return trainer


def _batch(seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (3, 32), generator=g)
    labels[1, 20:] = -100
    return {"input_ids": torch.randint(0, vocab, (3, 32), generator=g), "labels": labels}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("method", ["topk", "eslm", "random"])
def test_step_loss_gradients_equal_a_plain_masked_mean(method, fused):
    torch.manual_seed(0)
    model = DemoGPT(**tiny_gpt_kwargs(), fused_loss=fused).double()
    callback = SelectiveTokenLoss(method=method, keep_ratio=0.4, seed=3)
    generator = torch.Generator().manual_seed(callback.draw_seed(0, 0))
    trainer = _wrap(model, callback)
    batch = _batch()
    out = model.training_step(batch, 0)
    grads = torch.autograd.grad(out["loss"], list(model.parameters()))
    # plain reference: full logits, the same rule on the same scores, masked mean
    logits = model(batch["input_ids"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(3, 32)
    valid = batch["labels"] != -100
    keep = select_tokens(method, losses, valid, 0.4, generator=generator).keep
    assert torch.equal(keep, out["keep"])
    reference = losses[keep].sum() / keep.sum()
    torch.testing.assert_close(out["loss"], reference, atol=1e-12, rtol=0)
    for got, want in zip(grads, torch.autograd.grad(reference, list(model.parameters()))):
        assert (got - want).abs().max() <= 1e-12
    callback.teardown(trainer, model, "fit")
    assert "training_step" not in vars(model) and "optimizer_step" not in vars(model)


def test_scalar_loss_is_refused_with_what_to_return():
    class ScalarGPT(DemoGPT):
        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    model = ScalarGPT(**tiny_gpt_kwargs())
    callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5)
    _wrap(model, callback)
    with pytest.raises(TypeError, match=r"returned a scalar tensor \(\).*TokenLosses"):
        model.training_step(_batch(), 0)


def test_plain_per_token_tensor_is_accepted():
    class TensorGPT(DemoGPT):
        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"])
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].clamp_min(0).flatten(), reduction="none").view(3, 32)

    model = TensorGPT(**tiny_gpt_kwargs())
    callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5)
    _wrap(model, callback)
    out = model.training_step(_batch(), 0)
    assert int(out["keep"].sum()) == 48  # half of all 96 positions, every one valid


def test_non_finite_losses_fail_the_step_with_their_count():
    class NanGPT(DemoGPT):
        def training_step(self, batch, batch_idx):
            out = self.token_losses(batch)
            bad = out.token_losses.clone()
            bad[0, :3] = float("nan")
            return TokenLosses(bad, out.mask)

    model = NanGPT(**tiny_gpt_kwargs())
    callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5)
    _wrap(model, callback)
    with pytest.raises(FloatingPointError, match="3 of 84 per-token losses are not finite"):
        model.training_step(_batch(), 0)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"keep_ratio": 0.0}, "keep_ratio=0.0"),
        ({"keep_ratio": 1.01}, "keep_ratio=1.01"),
        ({"method": "magic"}, "method='magic'"),
        ({"score": "margin"}, "score='margin'"),
        ({"method": "topk", "score": "entropy"}, "score='entropy'"),
        ({"method": "rho1"}, "reference=None"),
        ({"method": "rho1", "reference": "/no/such.ckpt"}, "reference='/no/such.ckpt'"),
        ({"scope": "world"}, "scope='world'"),
        ({"warmup_steps": -1}, "warmup_steps=-1"),
        ({"start_keep_ratio": "0.5"}, "start_keep_ratio='0.5'"),
        ({"start_keep_ratio": True}, "start_keep_ratio=True"),
        ({"method": "topk", "reference_key": "ref"}, "reference_key='ref' is not allowed: expected None unless method='rho1'"),
        ({"method": "eslm", "reference": torch.nn.Linear(2, 2)}, "reference='<Linear>' is not allowed: expected None unless"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SelectiveTokenLoss(**kwargs)


def test_reference_with_another_vocabulary_is_refused():
    callback = SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=DemoGPT(**{**tiny_gpt_kwargs(), "vocab_size": 600}))
    model = DemoGPT(**tiny_gpt_kwargs())
    trainer = _trainer([callback])
    with pytest.raises(ValueError, match=r"reference=.*vocab_size=600 differs from the model's vocab_size=512"):
        callback.setup(trainer, model, "fit")


def test_warmup_keeps_everything_then_the_ratio_applies(small_datamodule_kwargs):
    callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5, warmup_steps=2)
    seen = []

    class Spy(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(outputs["keep"].sum() / outputs["mask"].sum()))

    _trainer([callback, Spy()], steps=4).fit(DemoGPT(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert seen[:2] == [1.0, 1.0]
    assert all(0.5 <= f < 0.52 for f in seen[2:])


@pytest.mark.parametrize(
    ("method", "extra"),
    [("eslm", {}), ("eslm", {"score": "entropy"}), ("topk", {}), ("random", {}), ("none", {})],
)
def test_demo_fits_with_each_method(method, extra, small_datamodule_kwargs):
    lightning.seed_everything(0)
    model = DemoGPT(**tiny_gpt_kwargs(), fused_loss=True)
    # the exact threshold keeps exact counts (the streaming default: tests/tokens/test_streaming.py)
    trainer = _trainer([SelectiveTokenLoss(method=method, keep_ratio=0.6, threshold="exact", **extra)], steps=4)
    trainer.fit(model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
    metrics = trainer.callback_metrics
    expected = 1.0 if method == "none" else 0.6
    assert expected <= float(metrics["selection/kept_fraction"]) < expected + 0.05
    assert torch.isfinite(metrics["selection/mean_loss"])


def test_rho1_with_a_reference_checkpoint_from_a_short_demo_fit(small_datamodule_kwargs, tmp_path):
    lightning.seed_everything(0)
    data = CorpusDataModule(**small_datamodule_kwargs)
    reference_trainer = _trainer([], steps=3, default_root_dir=tmp_path)
    reference_trainer.fit(DemoGPT(**tiny_gpt_kwargs()), datamodule=data)
    path = tmp_path / "reference.ckpt"
    reference_trainer.save_checkpoint(path)
    callback = SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=str(path))

    class Reference(lightning.Callback):  # the loaded reference, as training ends (the fit's end drops it)
        def on_train_end(self, trainer, pl_module):
            self.module = callback._reference_module

    seen = Reference()
    model = DemoGPT(**tiny_gpt_kwargs())
    trainer = _trainer([callback, seen], steps=3)
    trainer.fit(model, datamodule=data)
    assert 0.5 <= float(trainer.callback_metrics["selection/kept_fraction"]) < 0.55
    assert callback._reference_module is None  # not held after the fit
    # the reference's losses are what the excess is taken against
    batch = _batch()
    with torch.no_grad(), deferred_reduction():
        ref = seen.module.training_step(batch, 0)
    reloaded = DemoGPT.load_from_checkpoint(path)
    torch.testing.assert_close(ref.token_losses, reloaded.token_losses(batch).token_losses)


def test_random_draws_are_reproducible_per_rank_step_and_batch():
    a = SelectiveTokenLoss(method="random", keep_ratio=0.5, seed=1)
    b = SelectiveTokenLoss(method="random", keep_ratio=0.5, seed=1)
    assert a.draw_seed(7, 0) == b.draw_seed(7, 0)
    assert len({a.draw_seed(7, 0), a.draw_seed(8, 0), a.draw_seed(7, 1)}) == 3
    b._rank = 1
    assert a.draw_seed(7, 0) != b.draw_seed(7, 0)
    state = a.state_dict()
    assert state["seed"] == 1 and state["schedule"]["end_ratio"] == 0.5


def test_fused_output_without_callback_trains_on_the_plain_mean():
    model = DemoGPT(**tiny_gpt_kwargs(), fused_loss=True).double()
    batch = _batch()
    out = model.training_step(batch, 0)
    assert isinstance(out, FusedTokenLoss)
    logits = model(batch["input_ids"])
    reference = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(out["loss"], reference, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_selection_figures_are_logged_on_the_steps_lightning_logs(fused, small_datamodule_kwargs, tmp_path):
    """The ``selection/`` figures reach the logger at the Trainer's ``log_every_n_steps`` steps, the same
    steps as a metric the module logs on every step, and are not computed on the others."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    class EveryStep(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("probe", float(batch_idx))

    callback = SelectiveTokenLoss(method="eslm", keep_ratio=0.6, threshold="exact")
    computed = []
    figures = callback._stats
    callback._stats = lambda *args, **kwargs: computed.append(1) or figures(*args, **kwargs)
    trainer = _trainer([callback, EveryStep()], steps=7, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=3)
    trainer.fit(DemoGPT(**tiny_gpt_kwargs(), fused_loss=fused), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    probe_steps = [int(row["step"]) for row in rows if row.get("probe")]
    selection_steps = [int(row["step"]) for row in rows if row.get("selection/kept_fraction")]
    assert probe_steps == [2, 5]
    assert selection_steps == probe_steps
    assert len(computed) == 2
    assert 0.6 <= float(trainer.callback_metrics["selection/kept_fraction"]) < 0.65


def test_a_callback_monitoring_a_selection_figure_sees_it_every_step(small_datamodule_kwargs, tmp_path):
    """EarlyStopping on ``selection/mean_loss`` checks after every training epoch of 3 steps, far below the
    default ``log_every_n_steps=50``: the figures are logged every step for it (strict monitoring would raise)."""
    from lightning.pytorch.callbacks import EarlyStopping

    class Seen(lightning.Callback):
        def __init__(self) -> None:
            self.steps = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append("selection/mean_loss" in trainer.callback_metrics)

    seen = Seen()
    stop = EarlyStopping(monitor="selection/mean_loss", check_on_train_epoch_end=True, patience=100)
    trainer = _trainer([SelectiveTokenLoss(method="eslm", keep_ratio=0.6), stop, seen], steps=6, log_every_n_steps=50,
                       limit_train_batches=3)
    trainer.fit(DemoGPT(**tiny_gpt_kwargs(), fused_loss=True), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert trainer.global_step == 6 and seen.steps == [True] * 6


@pytest.mark.parametrize("fused", [False, True])
def test_the_plain_mean_can_be_read_inside_the_step_while_the_callback_computes_the_loss(fused, small_datamodule_kwargs):
    """A new user's ``self.log("train_loss", out["loss"])`` raised a bare KeyError under the callback: reading it
    gives the plain mean over valid tokens, detached, and leaves the output as the callback needs it."""
    read = []

    class LoggingGPT(DemoGPT):
        def training_step(self, batch, batch_idx):
            out = self.token_losses(batch)
            read.append((out["loss"], "loss" in out, out))
            self.log("train_loss", out["loss"])
            return out

    torch.manual_seed(0)
    model = LoggingGPT(**tiny_gpt_kwargs(), fused_loss=fused).double()
    callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5)
    trainer = _wrap(model, callback)
    batch = _batch()
    step = model.training_step(batch, 0)
    (mean, stored, out), = read
    assert not stored and "loss" not in out and not mean.requires_grad
    with torch.no_grad():
        logits = model(batch["input_ids"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=-100)
    valid = batch["labels"].flatten() != -100
    torch.testing.assert_close(mean, losses[valid].mean(), atol=1e-12, rtol=0)
    assert step["keep"].sum() < valid.sum()  # the step loss is the selection's, not that mean
    with pytest.raises(KeyError):
        out["no such key"]
    callback.teardown(trainer, model, "fit")
    read.clear()
    lightning.seed_everything(0)
    fitted = _trainer([SelectiveTokenLoss(method="topk", keep_ratio=0.5)], steps=2)
    fitted.fit(LoggingGPT(**tiny_gpt_kwargs(), fused_loss=fused), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert len(read) == 2 and float(fitted.callback_metrics["train_loss"]) == pytest.approx(float(read[-1][0]))
