"""Case ``finetune``: a finetuning fit whose backbone a ``BaseFinetuning`` callback unfreezes at epoch 1, with AutoFit
at a budget the frozen fit keeps easily and the unfrozen one does not, beside plain Lightning's same fit.

The model is the ``autofit`` case's demo GPT (vocab 4096, 4 layers, d_model 128, seq 128, full logits) with an untied
head; the token and position embeddings and the blocks are frozen in epoch 0 and trained from epoch 1 (added to AdamW
as a parameter group, as ``BaseFinetuning.unfreeze_and_add_param_group`` does). Global batch 16, two epochs.

Variants, each in a fresh process:

* ``plain``: plain Lightning (every block kept, 32-bit states, the batch whole); its unfrozen peak is the reference
  the budget is a fraction of (:data:`BUDGET_FRACTION`), kept for this run's other variants;
* ``autofit``: ``AutoFit(budget)`` with the finetuning callback: it plans for the frozen backbone, then, before the first
  step of epoch 1, measures again and plans the block policies again (micro-batch and optimizer states kept);
* ``autofit_from_start``: the same AutoFit on the same model with nothing frozen (both epochs train everything): the plan
  AutoFit makes knowing the whole model trains, for the unfrozen epoch's speed to be set against.

Per epoch (``epoch0_``: frozen, ``epoch1_``: unfrozen, except in ``autofit_from_start``): the peak RSS above the fit's
start (``PeakMemory``, reset after the epoch's first step: the steady state; the first step of epoch 1 creates the
unfrozen parameters' states and, under AutoFit, holds its measuring), the median step time of the steps after the
first, and epoch 1's first step's time (``epoch1_first_step_s``: under AutoFit it holds the measuring again). AutoFit's
predicted peaks in each epoch, and its plans, are reported beside them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.cases.autofit import MODELS, QUICK_MODELS, _data, _run_key, _threads
from benchmarks.harness import Case, register

#: the budget, as a fraction of plain Lightning's peak RSS once the backbone trains (``--quick``'s toy model: one every
#: plan fits, its fixed costs being most of its peak)
BUDGET_FRACTION, QUICK_BUDGET_FRACTION = 0.6, 1.5
GLOBAL_BATCH, QUICK_GLOBAL_BATCH = 16, 4
#: optimizer steps per epoch (two epochs)
STEPS, QUICK_STEPS = 8, 3


def _reference_file(quick: bool) -> Path:
    return Path(tempfile.gettempdir()) / f"lightning_efficient-finetune-reference-{_run_key()}-{int(quick)}.json"


def _module(quick: bool):
    import torch
    from torch import nn

    from lightning_efficient import DemoGPT

    class FinetunedGPT(DemoGPT):
        """The demo GPT with a ``batch_size`` (AutoFit sets it) and AdamW over what trains when the fit starts."""

        def __init__(self, batch_size: int, **settings: Any) -> None:
            super().__init__(**settings)
            self.batch_size = batch_size

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

        def backbone(self) -> list[nn.Module]:
            return [self.tok_emb, self.pos_emb, self.blocks]

    torch.manual_seed(0)
    settings = {**(QUICK_MODELS if quick else MODELS)["demo"], "tie_embeddings": False}
    return FinetunedGPT(QUICK_GLOBAL_BATCH if quick else GLOBAL_BATCH, **settings)


def _callbacks(frozen: bool) -> list:
    """The finetuning callback (backbone frozen in epoch 0, trained from epoch 1) and the epoch meter."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import BaseFinetuning

    from benchmarks.common import OptimizerStepClock  # (Lightning is imported in a worker only)
    from lightning_efficient.memory import PeakMemory, fit_start_rss_bytes
    from lightning_efficient.optim._bnb import bitsandbytes

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module) -> None:
            self.freeze(pl_module.backbone())

        def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
            if current_epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone(), optimizer)

    class EpochMeter(Callback):
        """Per epoch: every optimizer step's time and the peak RSS above the fit's start after its first step."""

        def __init__(self) -> None:
            self.step_s: list[list[float]] = []
            self.peak: list[int] = []
            self._meter: PeakMemory | None = None
            self._clock = OptimizerStepClock()
            self.start_rss = 0

        def setup(self, trainer, pl_module, stage) -> None:
            bitsandbytes()  # (AutoFit may pick 8-bit states: a library's import is not training memory, as AutoFit reads it)
            self.start_rss = fit_start_rss_bytes()

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.step_s.append([])
            self._meter = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._clock.batch_started()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seconds = self._clock.batch_ended(trainer)
            if seconds is None:
                return
            self.step_s[-1].append(seconds)
            if self._meter is None:
                self._meter = PeakMemory(pl_module.device, self.start_rss)
                self._meter.reset()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.peak.append(self._meter.read())

    return [*([Unfreeze()] if frozen else []), EpochMeter()]


def _fit(quick: bool, budget: int | None, frozen: bool = True) -> dict[str, Any]:
    import lightning

    from lightning_efficient import AutoFit

    _threads(quick)
    callbacks = _callbacks(frozen)
    meter = callbacks[-1]
    fit = None
    if budget is not None:
        fit = AutoFit(budget=budget)
        callbacks.insert(0, fit)
        seen: list = []

        class PlanPerEpoch(lightning.Callback):
            def on_train_epoch_end(self, trainer, pl_module) -> None:
                seen.append(fit.plan)

        callbacks.append(PlanPerEpoch())
    steps = QUICK_STEPS if quick else STEPS
    batch = QUICK_GLOBAL_BATCH if quick else GLOBAL_BATCH
    with tempfile.TemporaryDirectory() as root:
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=steps, limit_val_batches=0,
                                    num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                                    callbacks=callbacks)
        trainer.fit(_module(quick), datamodule=_data(quick, batch))
    seq = (QUICK_MODELS if quick else MODELS)["demo"]["seq_len"]
    metrics: dict[str, Any] = {}
    for epoch, name in enumerate(("epoch0", "epoch1")):
        times = meter.step_s[epoch]
        step = statistics.median(times[1:] or times)
        metrics.update({f"{name}_peak_bytes": meter.peak[epoch], f"{name}_step_time_s": step,
                        f"{name}_tokens_per_s": batch * seq / step})
    metrics["epoch1_first_step_s"] = meter.step_s[1][0]
    if fit is not None:
        metrics["budget_bytes"] = budget
        metrics["planning_s"] = fit.planning_s
        for epoch, name in enumerate(("epoch0", "epoch1")):
            plan = seen[epoch]
            metrics[f"predicted_{name}_peak_bytes"] = plan.ranks[0].peak_bytes
            metrics[f"{name}_within_budget"] = int(meter.peak[epoch] <= budget)
            metrics[f"{name}_prediction_error"] = plan.ranks[0].peak_bytes / meter.peak[epoch] - 1
            policies = plan.ranks[0].policies
            blocks = ", ".join(f"{policies.count(p)} {p}" for p in dict.fromkeys(policies)) or "every block kept"
            metrics[f"{name}_plan"] = f"micro-batch {plan.ranks[0].micro_batch}, {plan.optimizer}, {blocks}"
    return metrics


def plain(quick: bool) -> dict[str, Any]:
    """Plain Lightning's finetuning fit; its unfrozen peak is this run's reference."""
    metrics = _fit(quick, None)
    _reference_file(quick).write_text(json.dumps({"peak_bytes": metrics["epoch1_peak_bytes"]}))
    return metrics


def _budget(quick: bool) -> int:
    path = _reference_file(quick)
    if not path.exists():
        raise RuntimeError("the budget is a fraction of the plain variant's peak: run the case whole (plain first)")
    return int((QUICK_BUDGET_FRACTION if quick else BUDGET_FRACTION) * json.loads(path.read_text())["peak_bytes"])


def autofit(quick: bool) -> dict[str, Any]:
    """AutoFit at the budget, the backbone unfrozen at epoch 1."""
    return _fit(quick, _budget(quick))


def autofit_from_start(quick: bool) -> dict[str, Any]:
    """AutoFit at the budget, everything trained from the start."""
    return _fit(quick, _budget(quick), frozen=False)


def report(results: dict[str, dict[str, Any]], out_dir: Path, quick: bool) -> str:
    """The plans and the figures the case is about, in one table."""
    base = results.get("plain", {})
    lines = ["| variant | plan in epoch 0 | plan in epoch 1 | epoch 1 peak / budget | predicted / measured (epoch 1) | "
             "epoch 1 tokens/s vs plain | first step of epoch 1 vs plain |", "|---|---|---|---|---|---|---|"]
    for label in ("autofit", "autofit_from_start"):
        m = results.get(label, {})
        if "error" in m or not m:
            lines.append(f"| {label} | {m.get('error', 'not run')} | | | | | |")
            continue
        lines.append(
            f"| {label} | {m['epoch0_plan']} | {m['epoch1_plan']} | "
            f"{m['epoch1_peak_bytes'] / 2**20:,.1f} / {m['budget_bytes'] / 2**20:,.1f} MiB | "
            f"{m['predicted_epoch1_peak_bytes'] / 2**20:,.1f} / {m['epoch1_peak_bytes'] / 2**20:,.1f} MiB "
            f"({m['epoch1_prediction_error']:+.1%}) | "
            f"{m['epoch1_tokens_per_s'] / base.get('epoch1_tokens_per_s', float('nan')):.3f} | "
            f"{m['epoch1_first_step_s'] / base.get('epoch1_first_step_s', float('nan')):.2f}x |")
    return "\n".join(lines) + "\n"


CASE = register(
    Case(
        name="finetune",
        description=(
            "A finetuning fit (the demo GPT's embeddings and blocks frozen in epoch 0 and unfrozen at epoch 1 by a "
            f"BaseFinetuning callback, global batch 16, {STEPS} steps an epoch): plain Lightning, AutoFit at "
            f"{BUDGET_FRACTION:g}x plain's unfrozen peak RSS (planned frozen, measured and planned again at the unfreeze), "
            "and the same AutoFit with everything trained from the start."
        ),
        baseline="plain",
        variants={"plain": plain, "autofit": autofit, "autofit_from_start": autofit_from_start},
        extra_report=report,
    )
)
