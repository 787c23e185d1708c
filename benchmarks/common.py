"""Helpers shared by benchmark cases: a measured demo fit, the honest-RSS warm-up, optimizer-step timing and round-by-round ratios."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_efficient.memory import reset_peak_rss


class ResetPeakRSSAfterWarmup(Callback):
    """Resets the process's peak RSS after the first training step, so the peak is of steady state."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int):
        if i == 0:
            reset_peak_rss()


class OptimizerStepClock:
    """Each optimizer step's seconds, from the end of the previous one (the first from its first micro-batch's start),
    as AutoFit times them: call :meth:`batch_started` and :meth:`batch_ended` from the callback hooks of those names."""

    def __init__(self) -> None:
        self._started: float | None = None

    def batch_started(self) -> None:
        """At a micro-batch's start: the first one starts the clock."""
        if self._started is None:
            self._started = time.perf_counter()

    def batch_ended(self, trainer: Trainer) -> float | None:
        """At a micro-batch's end: the seconds of the optimizer step it ended (None inside an accumulation window)."""
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return None
        now = time.perf_counter()
        seconds, self._started = now - self._started, now
        return seconds


def measured_fit(
    model: LightningModule, datamodule: Any, steps: int, callbacks: list[Callback] = (), **trainer_kwargs: Any
) -> dict[str, float]:
    """Fit ``model`` for ``steps`` steps with a MemoryReport and return its figures."""
    from lightning_efficient import MemoryReport

    report = MemoryReport(every_n_steps=max(1, steps // 2), log=False, print_table=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ResetPeakRSSAfterWarmup(), report, *callbacks],
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule=datamodule)
    return {k: float(v) for k, v in report.report().items() if isinstance(v, (int, float))}


def paired_ratios(results: dict[str, dict[str, Any]], variant: str, against: str = "baseline") -> list[float]:
    """``variant``'s step time over ``against``'s in each round (empty with one round). The machine's speed wanders by
    up to 30% over minutes; processes of the same round ran a minute apart at most, so their ratio is steadier than
    the ratio of medians taken over different rounds."""
    base = results.get(against, {}).get("step_time_s_rounds") or []
    other = results.get(variant, {}).get("step_time_s_rounds") or []
    return [o / b for o, b in zip(other, base)] if len(base) == len(other) > 1 else []
