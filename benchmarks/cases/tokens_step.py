"""Case ``tokens_step``: the demo's training step time with token selection at keep 0.7, beside the
baseline's (no selection: ``FusedTokenLoss``'s fused mean).

The issue's goal: a demo step with ``eslm`` at keep 0.7 on the streaming path takes <= 0.97x the
baseline's. The model and batch are ``tokens_quality``'s (the demo GPT with ``fused_loss=True``, batch 16,
the standard-library corpus); ``SelectiveTokenLoss`` has ``warmup_steps=0`` and ``ramp_steps=0`` (its
defaults, given explicitly), so keep 0.7 applies from the first step. The first ``WARMUP_STEPS`` steps
are not measured (a streaming fit's first step has no estimate yet and takes the exact path; allocator
and caches settle); the figure is the median wall time of the next ``STEPS`` steps, each from
``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step), as
``tokens_quality``'s ``step_time_s``. Variants: the streaming and the batch-exact threshold on the fused
head, the per-token path (full logits, ``fused_loss=False``) and ``random`` on the streaming path.

``head_time_s`` is the median time per step spent in the fused head's calls (``FusedTokenLoss``'s
``linear_cross_entropy`` or ``streaming_cross_entropy``; their backward passes only scale gradients
computed there, except the exact threshold's, whose recomputation in backward is not counted), and
``head_fraction`` its share of the step: what selection can save is at most that share.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import lightning

from benchmarks.cases.tokens_quality import MODEL, _data, _sizes
from benchmarks.common import paired_ratios
from benchmarks.harness import Case, register

KEEP_RATIO = 0.7
GOAL = 0.97  # eslm_streaming's step time / the baseline's
#: variant -> (the model's fused_loss, SelectiveTokenLoss's arguments or None for no selection)
VARIANTS: dict[str, tuple[bool, dict[str, Any] | None]] = {
    "baseline": (True, None),
    "eslm_streaming": (True, {"method": "eslm", "score": "loss", "threshold": "streaming"}),
    "eslm_exact": (True, {"method": "eslm", "score": "loss", "threshold": "exact"}),
    # TokenLosses from full logits: the exact threshold whatever ``threshold`` says (streaming needs the fused head)
    "eslm_per_token": (False, {"method": "eslm", "score": "loss", "threshold": "exact"}),
    "random_streaming": (True, {"method": "random", "threshold": "streaming"}),
}


def _steps(quick: bool) -> tuple[int, int]:
    """(warm-up steps, measured steps)."""
    return (2, 3) if quick else (5, 40)


class StepClock(lightning.Callback):
    """Each training step's wall time, its realised kept fraction (from the step's keep and valid masks)
    and whether SelectiveTokenLoss streamed it. The ``selection/`` metrics are not read: they are logged
    only on the Trainer's ``log_every_n_steps`` steps, as a user's fit logs them."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.head_seconds: list[float] = []  # filled by _head_clock
        self.kept: list[float] = []
        self.streamed: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.head_seconds.append(0.0)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self._start)
        if isinstance(outputs, dict) and "keep" in outputs:
            self.kept.append(float(outputs["keep"].sum() / outputs["mask"].sum().clamp_min(1)))
            self.streamed.append(float(_streamed_calls[-1] if _streamed_calls else 0.0))
            _streamed_calls.clear()


#: 1.0 for each SelectiveTokenLoss._streamed call that took the streaming path (filled by _head_clock)
_streamed_calls: list[float] = []


@contextlib.contextmanager
def _head_clock(seconds: list[float]):
    """Adds the wall time of every fused-head call (``FusedTokenLoss``'s losses) to ``seconds[-1]``, and
    records in ``_streamed_calls`` whether each SelectiveTokenLoss step took the streaming path."""
    from lightning_efficient.tokens.output import FusedTokenLoss

    originals = {name: getattr(FusedTokenLoss, name) for name in ("_cross_entropy", "streamed_losses")}

    def timed(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if seconds:
                    seconds[-1] += time.perf_counter() - start
        return call

    from lightning_efficient.tokens.callback import SelectiveTokenLoss

    streamed = SelectiveTokenLoss._streamed

    @functools.wraps(streamed)
    def counted(*args, **kwargs):
        out = streamed(*args, **kwargs)
        _streamed_calls.append(float(out is not None))
        return out

    for name, method in originals.items():
        setattr(FusedTokenLoss, name, timed(method))
    SelectiveTokenLoss._streamed = counted
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(FusedTokenLoss, name, method)
        SelectiveTokenLoss._streamed = streamed


def step_time(variant: str, quick: bool) -> dict[str, float]:
    """Train the demo for the warm-up and measured steps with ``variant``'s loss; its median step time."""
    from lightning_efficient import DemoGPT, SelectiveTokenLoss

    fused, settings = VARIANTS[variant]
    warmup, measured = _steps(quick)
    clock = StepClock()
    callbacks: list[lightning.Callback] = [clock]
    if settings is not None:
        callbacks.append(SelectiveTokenLoss(keep_ratio=KEEP_RATIO, warmup_steps=0, ramp_steps=0, **settings))
    lightning.seed_everything(0)
    model = DemoGPT(**{**MODEL, "fused_loss": fused})
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=warmup + measured, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    with _head_clock(clock.head_seconds):
        trainer.fit(model, datamodule=_data(_sizes(quick), 0.0))
    steps = clock.seconds[warmup:]
    out = {"step_time_s": statistics.median(steps), "mean_step_time_s": statistics.fmean(steps),
           "measured_steps": len(steps)}
    if fused:
        heads = clock.head_seconds[warmup:]
        out["head_time_s"] = statistics.median(heads)
        out["head_fraction"] = statistics.median(h / s for h, s in zip(heads, steps))
    if clock.kept:  # the measured steps' realised keep ratio and share of steps on the streaming path
        out["kept_fraction"] = statistics.fmean(clock.kept[warmup:])
        out["streamed_fraction"] = statistics.fmean(clock.streamed[warmup:])
    return out


def report(results: dict[str, dict[str, Any]], out_dir: Path, quick: bool) -> str:
    """The goal's ratio, and every variant's median step time against the baseline's."""
    base = results.get("baseline", {}).get("step_time_s")
    lines = [f"## Step time at keep {KEEP_RATIO} (median of {_steps(quick)[1]} steps after {_steps(quick)[0]})", "",
             "| variant | step time | / baseline | head time (share of the step) | kept fraction | streamed steps |",
             "|---|---|---|---|---|---|"]
    for label, run in results.items():
        if "step_time_s" not in run:
            lines.append(f"| {label} | {run.get('error', '-')} | | | | |")
            continue
        ratio = f"{run['step_time_s'] / base:.3f}x" if base else "-"
        kept = f"{run['kept_fraction']:.3f}" if "kept_fraction" in run else "-"
        streamed = f"{run['streamed_fraction']:.2f}" if "streamed_fraction" in run else "-"
        head = f"{run['head_time_s'] * 1e3:.1f} ms ({run['head_fraction']:.2f})" if "head_time_s" in run else "-"
        lines.append(f"| {label} | {run['step_time_s'] * 1e3:.1f} ms | {ratio} | {head} | {kept} | {streamed} |")
    eslm = results.get("eslm_streaming", {}).get("step_time_s")
    paired = paired_ratios(results, "eslm_streaming")
    if paired:
        lines += ["", "eslm streaming / baseline, round by round (each round's processes ran back to back): "
                  + ", ".join(f"{r:.3f}x" for r in paired) + f"; median {statistics.median(paired):.3f}x."]
    if base and eslm:
        ratio = statistics.median(paired) if paired else eslm / base
        verdict = "met" if ratio <= GOAL else "not met"
        judged = "the median of the per-round ratios" if paired else "the medians' ratio"
        lines += ["", f"Goal: eslm at keep {KEEP_RATIO} on the streaming path <= {GOAL}x the baseline's step time "
                  f"({judged}): {ratio:.3f}x, {verdict}" + (" (--quick: too few steps to judge)" if quick else "") + "."]
    return "\n".join(lines)


register(
    Case(
        name="tokens_step",
        description=(
            f"The demo GPT of tokens_quality (2 layers, d_model 128, seq 128, batch 16, vocab 8192, fused loss) with "
            f"SelectiveTokenLoss at keep {KEEP_RATIO} from the first step: the median training step time over 40 steps "
            "after 5 (5 rounds, variants interleaved; the goal judged on the median per-round ratio), against no selection (the fused mean); eslm on the "
            "streaming and the batch-exact threshold, "
            "eslm on the per-token path (full logits), random on the streaming path."
        ),
        baseline="baseline",
        variants={label: functools.partial(step_time, label) for label in VARIANTS},
        timeout_s=600.0,
        rounds=5,  # one fresh process per variant reads up to ~10% apart between processes: 5 interleaved rounds
        extra_report=report,
    )
)
