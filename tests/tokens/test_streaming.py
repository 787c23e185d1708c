"""The streaming threshold: selection and the head's gradients in one pass over the fused head.

References are plain torch (full logits, per-token cross-entropy, masked sum) in float64; the
batch-exact selection (``select_tokens``) is what a given threshold must reproduce."""

import logging
import math
from pathlib import Path

import lightning
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_efficient import CorpusDataModule, DemoGPT, SelectiveTokenLoss
from lightning_efficient.tokens import linear_ce
from lightning_efficient.tokens.linear_ce import linear_cross_entropy, set_compile
from lightning_efficient.tokens.selection import RunningThreshold, select_tokens
from lightning_efficient.tokens.streaming import streaming_cross_entropy
from tests.conftest import tiny_gpt_kwargs
from tests.ddp import run_script
from tests.tokens.accumulation_model import Rows, StepGrads, Tiny

HERE = Path(__file__).resolve().parent


def _head(n=45, d=6, v=29, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::6] = -100
    reference = torch.rand(n, generator=g, dtype=dtype) * 3
    return hidden, weight, b, labels, reference


def _plain(hidden, weight, bias, labels):
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    losses = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    probs = torch.softmax(logits, dim=1)
    entropy = torch.where(labels != -100, torch.logsumexp(logits, 1) - (probs * logits).sum(1), 0.0)
    return losses, entropy


def _params(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("method", "score"), [("topk", "loss"), ("eslm", "entropy"), ("rho1", "excess")])
@pytest.mark.parametrize("keep_ratio", [0.3, 0.7])
def test_the_exact_threshold_keeps_the_exact_set_with_float64_gradients(method, score, keep_ratio, bias):
    hidden, weight, b, labels, reference = _head(bias=bias)
    valid = labels != -100
    losses, entropy = _plain(hidden, weight, b, labels)
    exact = select_tokens("eslm" if score == "entropy" else method, losses.detach(), valid, keep_ratio,
                          entropy=entropy.detach(), reference_losses=reference, score=score if score == "entropy" else "loss")
    out = streaming_cross_entropy(hidden, weight, labels, b, chunk_size=8, threshold=exact.threshold, score=score,
                                  reference_losses=reference if score == "excess" else None)
    assert torch.equal(out.keep, exact.keep) and 0 < int(out.keep.sum()) < int(valid.sum())
    want = (losses * exact.keep).sum()
    assert abs(float(out.kept_sum.detach() - want.detach())) <= 1e-10
    torch.testing.assert_close(out.losses, losses.detach(), atol=1e-12, rtol=0)
    scale = 0.37  # the backward pass scales the precomputed gradients by the incoming gradient
    got = torch.autograd.grad(out.kept_sum * scale, _params(hidden, weight, b))
    for g, w in zip(got, torch.autograd.grad(want * scale, _params(hidden, weight, b))):
        assert (g - w).abs().max() <= 1e-10


def test_a_given_mask_and_every_valid_token():
    hidden, weight, b, labels, _ = _head(n=40)
    valid = labels != -100
    mask = torch.rand(labels.shape, generator=torch.Generator().manual_seed(5)) < 0.5
    for keep in (mask, torch.ones_like(valid)):
        losses, _ = _plain(hidden, weight, b, labels)
        out = streaming_cross_entropy(hidden, weight, labels, b, chunk_size=16, keep=keep)
        assert torch.equal(out.keep, keep & valid)
        want = (losses * (keep & valid)).sum()
        for g, w in zip(torch.autograd.grad(out.kept_sum, _params(hidden, weight, b)),
                        torch.autograd.grad(want, _params(hidden, weight, b))):
            assert (g - w).abs().max() <= 1e-10


def test_bf16_autocast_gradients_match_the_per_token_path():
    hidden, weight, b, labels, _ = _head(n=64, d=16, v=50, dtype=torch.float32)
    keep = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2)) < 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = streaming_cross_entropy(hidden, weight, labels, b, chunk_size=16, keep=keep)
        per_token = linear_cross_entropy(hidden, weight, labels, b, chunk_size=16)
    got = torch.autograd.grad(out.kept_sum, _params(hidden, weight, b))
    want = torch.autograd.grad((per_token * (keep & (labels != -100))).sum(), _params(hidden, weight, b))
    torch.testing.assert_close(out.kept_sum, (per_token.detach() * (keep & (labels != -100))).sum())
    # the same bf16 matmuls, grouped by chunk differently (each chunk's grad_weight is rounded to bf16
    # before the float32 sum): equal up to bf16 rounding
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2 * float(w.abs().max()), rtol=0)


def test_bad_arguments_are_refused():
    hidden, weight, _, labels, _ = _head()
    with pytest.raises(ValueError, match="threshold=None is not allowed"):
        streaming_cross_entropy(hidden, weight, labels)
    with pytest.raises(ValueError, match="score='margin'"):
        streaming_cross_entropy(hidden, weight, labels, threshold=1.0, score="margin")
    with pytest.raises(ValueError, match="reference_losses=None"):
        streaming_cross_entropy(hidden, weight, labels, threshold=1.0, score="excess")
    with pytest.raises(ValueError, match="threshold='batch'"):
        SelectiveTokenLoss(threshold="batch")
    with pytest.raises(ValueError, match="gain=0"):
        RunningThreshold(gain=0)


# -- the compiled step ------------------------------------------------------------------------------
def _compiled_case(compile, threshold=None, keep=None, score="loss"):
    """A float32 head whose first 16-row chunk is all valid (45 = 16 + 16 + 13 rows): the streamed
    loss and the gradients of hidden, weight and bias."""
    hidden, weight, b, labels, reference = _head(n=45, d=8, v=67, dtype=torch.float32, seed=3)
    labels[:16] = labels[:16].clamp_min(0)
    out = streaming_cross_entropy(hidden, weight, labels, b, chunk_size=16, threshold=threshold, keep=keep, score=score,
                                  reference_losses=reference if score == "excess" else None, compile=compile)
    return out, torch.autograd.grad(out.kept_sum, _params(hidden, weight, b))


def _assert_same_stream(got, want):
    (out, grads), (ref, ref_grads) = got, want
    assert torch.equal(out.keep, ref.keep)
    for name, a, w in (("losses", out.losses, ref.losses), ("scores", out.scores, ref.scores),
                       ("kept sum", out.kept_sum.detach(), ref.kept_sum.detach()), *zip(("grad hidden", "grad weight",
                       "grad bias"), grads, ref_grads)):
        assert (a is None) == (w is None), name
        if a is not None:
            assert a.dtype == w.dtype, name
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_the_compiled_step_equals_the_eager_step():
    """compile=True against the eager step (its reference) on one tiny float32 head: a threshold
    halfway between two adjacent scores keeps the same tokens; a given mask that keeps every row of
    the first chunk takes the path whose gradient overwrites the chunk's matmul; the others' kept
    rows gather in the gradient buffer across chunks. Four small graphs."""
    scores = _compiled_case(False, threshold=-math.inf)[0].scores
    ordered = scores[scores != 0].sort().values
    middle = len(ordered) // 2
    threshold = float((ordered[middle] + ordered[middle + 1]) / 2)
    eager = _compiled_case(False, threshold=threshold)
    assert 16 < int(eager[0].keep.sum()) < 40  # more kept rows than one chunk: the gradient buffer is flushed mid-pass
    _assert_same_stream(_compiled_case(True, threshold=threshold), eager)
    keep = torch.rand(45, generator=torch.Generator().manual_seed(4)) < 0.5
    keep[:16] = True
    eager = _compiled_case(False, keep=keep)
    assert bool(eager[0].keep[:16].all())
    _assert_same_stream(_compiled_case(True, keep=keep), eager)


def test_a_failing_compiler_streams_on_the_eager_step_and_says_so_once(monkeypatch, caplog):
    def unavailable(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())  # a fresh process's choice
    monkeypatch.setattr(torch, "compile", unavailable)
    eager = _compiled_case(False, threshold=0.5)
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="compiling the chunk step failed") as record:
        first = _compiled_case(True, threshold=0.5)
        second = _compiled_case(True, threshold=0.5)
    assert len([w for w in record if "compiling the chunk step failed" in str(w.message)]) == 1
    for got in (first, second):  # the eager step's arithmetic: equal to float32 rounding, the same kept set
        _assert_same_stream(got, eager)
    said = [r.getMessage() for r in caplog.records if "the chunk step runs" in r.getMessage()]
    assert said == ["streaming_cross_entropy: the chunk step runs eager (compiling failed)"]


def test_streaming_follows_the_process_compile_default(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("torch.compile called with compile=False")

    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())
    monkeypatch.setattr(torch, "compile", must_not_run)
    try:
        set_compile(False)
        _compiled_case(None, threshold=0.5)
    finally:
        set_compile(None)
    assert linear_ce._CHUNK_STEP.failed is None
    with pytest.raises(ValueError, match=r"compile='yes' is not allowed: expected True, False or None"):
        _compiled_case("yes", threshold=0.5)


# -- the running estimate --------------------------------------------------------------------------
@pytest.mark.parametrize("drift", [0.0, -0.1])
def test_the_estimate_keeps_the_target_ratio_within_tolerance(drift):
    """Stationary scores (and scores drifting down each step, as training lowers the losses): after
    a step to learn, every step's realised ratio is the target within 0.05 (4 sigma of the sampling
    noise at 2,048 tokens), and their mean within 0.015."""
    g = torch.Generator().manual_seed(0)
    estimate, realised = RunningThreshold(), []
    valid = torch.ones(2048, dtype=torch.bool)
    for step in range(14):
        scores = torch.randn(2048, generator=g) + drift * step
        threshold = estimate.threshold(0.4)
        if threshold is None:
            estimate.observe(scores, valid)
        else:
            keep = scores >= threshold
            realised.append(float(keep.float().mean()))
            estimate.observe(scores, valid, keep, 0.4)
        estimate.end_step()
    assert len(realised) == 13
    assert all(abs(r - 0.4) <= 0.05 for r in realised[1:]), realised
    assert abs(sum(realised[3:]) / len(realised[3:]) - 0.4) <= 0.015, realised
    assert estimate.threshold(1.0) == -float("inf")  # keep ratio 1 (no correction pushes it below)


def test_the_estimate_round_trips_through_its_state_dict():
    g = torch.Generator().manual_seed(1)
    estimate = RunningThreshold()
    valid = torch.ones(500, dtype=torch.bool)
    for _ in range(3):
        scores = torch.randn(500, generator=g)
        threshold = estimate.threshold(0.3)
        estimate.observe(scores, valid, None if threshold is None else scores >= threshold, None if threshold is None else 0.3)
        estimate.end_step()
    restored = RunningThreshold()
    restored.load_state_dict(estimate.state_dict())
    assert estimate.correction != 0 and restored.correction == estimate.correction
    assert restored.threshold(0.3) == estimate.threshold(0.3) and restored.threshold(0.55) == estimate.threshold(0.55)


# -- through SelectiveTokenLoss ---------------------------------------------------------------------
def _trainer(callbacks, steps=3, **kwargs):
    return lightning.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, **{"enable_checkpointing": False, **kwargs},
    )


def _batch(seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (3, 32), generator=g)
    labels[1, 20:] = -100
    return {"input_ids": torch.randint(0, vocab, (3, 32), generator=g), "labels": labels}


def _streamed(loss):
    """Whether ``loss``'s graph goes through the streaming head."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "StreamingCrossEntropy" in type(fn).__name__:
            return True
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return False


@pytest.mark.parametrize(("method", "kwargs"), [("random", {"keep_ratio": 0.4}), ("eslm", {"keep_ratio": 1.0}),
                                                ("topk", {"keep_ratio": 0.4, "warmup_steps": 1})])
def test_streamed_masks_without_an_estimate_equal_the_exact_paths(method, kwargs):
    """``random`` streams its draw (the exact path's mask), keep ratio 1.0 (a warm-up step included)
    streams every valid token; the gradients are the float64 masked mean's."""
    model = DemoGPT(**tiny_gpt_kwargs(), fused_loss=True).double()
    callback = SelectiveTokenLoss(method=method, seed=3, **kwargs)
    generator = torch.Generator().manual_seed(callback.draw_seed(0, 0))
    trainer = _trainer([callback])
    callback.setup(trainer, model, "fit")
    batch = _batch()
    out = model.training_step(batch, 0)
    assert _streamed(out["loss"])
    logits = model(batch["input_ids"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(3, 32)
    valid = batch["labels"] != -100
    keep = select_tokens(method, losses, valid, 0.4, generator=generator).keep if method == "random" else valid
    assert torch.equal(out["keep"], keep)
    reference = losses[keep].sum() / keep.sum()
    torch.testing.assert_close(out["loss"], reference, atol=1e-12, rtol=0)
    for got, want in zip(torch.autograd.grad(out["loss"], list(model.parameters())),
                         torch.autograd.grad(reference, list(model.parameters()))):
        assert (got - want).abs().max() <= 1e-12
    callback.teardown(trainer, model, "fit")


def test_the_first_step_is_exact_then_the_estimate_streams():
    model = DemoGPT(**tiny_gpt_kwargs(), fused_loss=True).double()
    callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5)
    trainer = _trainer([callback])
    callback.setup(trainer, model, "fit")
    first = model.training_step(_batch(0), 0)
    assert not _streamed(first["loss"]) and int(first["keep"].sum()) == 42  # half of 84 valid tokens, exactly
    callback._end_step()  # what the optimizer closure does after the step's last backward
    threshold = callback.running.threshold(0.5)
    second = model.training_step(_batch(0), 0)  # the same batch: the same scores, the same threshold's set
    assert _streamed(second["loss"])
    assert torch.equal(second["keep"], first["keep"])
    batch = _batch(0)
    losses = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), reduction="none").view(3, 32)
    assert torch.equal(second["keep"], (batch["labels"] != -100) & (losses.float() >= threshold))
    callback.teardown(trainer, model, "fit")


class _Record(lightning.Callback):
    def __init__(self):
        self.metrics = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("selection/")})


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_demo_fit_streams_and_trains_like_the_exact_one(precision, small_datamodule_kwargs):
    CorpusDataModule(**small_datamodule_kwargs).prepare_data()  # the cache first: the fits start alike
    runs = {}
    for mode in ("streaming", "exact"):
        lightning.seed_everything(0)
        record = _Record()
        trainer = _trainer([SelectiveTokenLoss(method="eslm", keep_ratio=0.6, threshold=mode), record], steps=8,
                           precision=precision)
        trainer.fit(DemoGPT(**tiny_gpt_kwargs(), fused_loss=True), datamodule=CorpusDataModule(**small_datamodule_kwargs))
        runs[mode] = record.metrics
    streaming, exact = runs["streaming"], runs["exact"]
    assert [m["selection/streamed"] for m in streaming] == [0.0] + [1.0] * 7
    assert all("selection/streamed" not in m for m in exact)
    # 128 tokens a step whose loss distribution shifts from batch to batch: the tolerance RunningThreshold states
    assert all(abs(m["selection/kept_fraction"] - 0.6) <= 0.2 for m in streaming)
    assert abs(sum(m["selection/kept_fraction"] for m in streaming) / 8 - 0.6) <= 0.05
    assert all(streaming[0][k] == v for k, v in exact[0].items())  # the first step has no estimate: the exact path
    for s, e in zip(streaming, exact):  # the same batches, losses within 1% of the exact fit's
        assert abs(s["selection/mean_loss"] - e["selection/mean_loss"]) <= 0.01 * e["selection/mean_loss"]


class _Batches(Tiny):
    """Tiny (lr 0, fused) reading ``batch_size`` samples per batch, the first ``samples`` only."""

    def __init__(self, batch_size, samples=8):
        super().__init__(fused=True)
        self.batch_size, self.samples = batch_size, samples

    def train_dataloader(self):
        return DataLoader(torch.utils.data.Subset(Rows(), range(self.samples)), batch_size=self.batch_size)


def test_accumulation_equals_one_big_batch_at_the_same_streamed_threshold():
    """Step 0 keeps everything (warm-up); step 1 streams at the threshold estimated from step 0's
    tokens, the same whether they came as two micro-batches or one: so the kept sets and the step's
    gradients are one big batch's."""
    runs = []
    for batch_size, accumulate in ((2, 2), (4, 1)):
        lightning.seed_everything(0)
        grads, record = StepGrads(), _Record()
        callback = SelectiveTokenLoss(method="topk", keep_ratio=0.5, warmup_steps=1)
        lightning.Trainer(
            accelerator="cpu", precision="64-true", max_steps=2, accumulate_grad_batches=accumulate, logger=False,
            log_every_n_steps=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[grads, callback, record],
        ).fit(_Batches(batch_size))
        runs.append((grads, record.metrics))
    (small, small_metrics), (big, big_metrics) = runs
    assert [m["selection/streamed"] for m in small_metrics] == [1.0] * 4  # keep-all, then the estimate
    assert small_metrics[-1]["selection/threshold"] == big_metrics[-1]["selection/threshold"]
    assert big_metrics[-1]["selection/kept_fraction"] < 0.9
    for step in range(2):
        for name, grad in big.steps[step].items():
            assert (small.steps[step][name] - grad).abs().max() <= 1e-12, (step, name)


def test_a_resumed_fit_streams_at_the_uninterrupted_runs_thresholds(tmp_path):
    """The running estimate is in the checkpoint: a fit resumed at an epoch end streams every later
    step at the threshold of the uninterrupted fit and ends at the same weights. (float32: a
    "64-true" resume loads the checkpoint into the float32 module before Lightning converts it.)"""

    class Learning(_Batches):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    def fit(epochs, ckpt=None, save=None):
        lightning.seed_everything(0)
        record = _Record()
        model = Learning(2, samples=4)
        trainer = lightning.Trainer(
            accelerator="cpu", max_epochs=epochs, logger=False, log_every_n_steps=1, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[SelectiveTokenLoss(method="eslm", keep_ratio=0.5), record],
        )
        trainer.fit(model, ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return model, record.metrics

    straight, straight_metrics = fit(3)
    fit(2, save=tmp_path / "two.ckpt")
    resumed, resumed_metrics = fit(3, ckpt=tmp_path / "two.ckpt")
    assert len(straight_metrics) == 6 and len(resumed_metrics) == 2
    assert [m["selection/streamed"] for m in resumed_metrics] == [1.0, 1.0]
    for got, want in zip(resumed_metrics, straight_metrics[4:]):
        assert got["selection/threshold"] == want["selection/threshold"]
        assert got["selection/threshold_correction"] == want["selection/threshold_correction"]
    for name, param in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], param), name


def test_two_processes_under_global_scope_stream_at_one_threshold(tmp_path):
    run_script(HERE / "ddp_streaming.py", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [m["selection/streamed"] for m in ranks[0]] == [0.0, 1.0, 1.0]
    for a, b in zip(*ranks):
        assert a["selection/threshold"] == b["selection/threshold"]  # one threshold on both ranks
        assert a["selection/threshold_correction"] == b["selection/threshold_correction"]
    # the ranks saw different tokens: their own kept fractions differ, the threshold does not
    assert any(a["selection/kept_fraction"] != b["selection/kept_fraction"] for a, b in zip(*ranks))


class _ProfileFirstMicroBatch(lightning.Callback):
    """Runs the (wrapped) training_step and its backward outside the loop before each step, as a
    memory profile does, then clears the gradients."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            pl_module.training_step(batch, batch_idx)["loss"].backward()
            pl_module.zero_grad(set_to_none=True)


def test_scores_of_a_training_step_run_outside_the_loop_are_not_estimated_from():
    runs = []
    for extra in ([], [_ProfileFirstMicroBatch()]):
        lightning.seed_everything(0)
        record = _Record()
        lightning.Trainer(
            accelerator="cpu", precision="64-true", max_steps=3, accumulate_grad_batches=2, logger=False,
            log_every_n_steps=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[SelectiveTokenLoss(method="topk", keep_ratio=0.5), record, *extra],
        ).fit(_Batches(2, samples=12))
        runs.append(record.metrics)
    assert [m["selection/streamed"] for m in runs[0]] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    for plain, profiled in zip(*runs):
        assert plain["selection/threshold"] == profiled["selection/threshold"]
