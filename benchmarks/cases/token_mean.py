"""Case ``token_mean``: what ``StepTokenMean`` costs and what it mends, where a step's batch is split into
micro-batches (``accumulate_grad_batches``) and its rows hold different numbers of valid tokens.

The model is the demo GPT (vocab 4096, 4 layers, d_model 128, seq 128, per-token losses), whose rows here are
cut to a length of their own, 8 to 128 tokens (the rest labelled ``-100``, as padded documents of an
instruction-tuning set are), a length fixed by the row's first token so that every split sees the same rows.
The global batch is 16: unsplit (the baseline), 4 x 4 and 1 x 16, each in plain Lightning (each micro-batch's
own token mean divided by the accumulation) and with ``StepTokenMean``.

``grad_rel_error``: the first step's gradient (read in ``on_before_optimizer_step``) against the float64
gradient of the same 16 rows' token mean from the same weights, computed in the same process:
``||g - g64|| / ||g64||``. ``step_time_s``: the median wall time of an optimizer step (all its micro-batches)
after ``WARMUP`` steps; ``tokens_per_s`` counts every position, valid or not.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import lightning
import torch

from benchmarks.common import OptimizerStepClock, paired_ratios
from benchmarks.harness import Case, register

MODEL = {"vocab_size": 4096, "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128}
GLOBAL_BATCH = 16
SHORTEST = 8
#: variant -> (micro-batches a step, whether StepTokenMean is on)
VARIANTS: dict[str, tuple[int, bool]] = {
    "unsplit": (1, False),
    "lightning_4x4": (4, False),
    "step_token_mean_4x4": (4, True),
    "lightning_1x16": (16, False),
    "step_token_mean_1x16": (16, True),
}


def _steps(quick: bool) -> tuple[int, int]:
    """(warm-up steps, measured steps)."""
    return (1, 3) if quick else (3, 20)


def row_lengths(input_ids: torch.Tensor) -> torch.Tensor:
    """Each row's valid length, ``SHORTEST`` to the sequence length, fixed by its first token (a row keeps its
    length in every split)."""
    seq = input_ids.shape[1]
    return SHORTEST + (input_ids[:, 0].long() * 2654435761) % (seq - SHORTEST + 1)


def _variable_length_gpt():
    from lightning_efficient import DemoGPT

    class VariableLengthGPT(DemoGPT):
        """The demo GPT whose rows end at :func:`row_lengths` (later labels ``-100``)."""

        def token_losses(self, batch: dict[str, torch.Tensor]):
            labels = batch["labels"].clone()
            positions = torch.arange(labels.shape[1], device=labels.device)
            labels[positions[None, :] >= row_lengths(batch["input_ids"])[:, None]] = -100
            return super().token_losses({**batch, "labels": labels})

    return VariableLengthGPT(**MODEL)


class FirstStepGradient(lightning.Callback):
    """The first step's gradient beside the float64 token-mean gradient of the same rows from the same weights,
    and each optimizer step's time."""

    def __init__(self) -> None:
        self.clock = OptimizerStepClock()
        self.step_seconds: list[float] = []
        self.rel_error: float | None = None
        self._initial: torch.nn.Module | None = None
        self._rows: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        self._initial = _variable_length_gpt()  # (not a deep copy: that copies the trainer the module holds)
        self._initial.load_state_dict(pl_module.state_dict())
        self._initial.double()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            self._rows.append({k: v.clone() for k, v in batch.items()})
        self.clock.batch_started()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        seconds = self.clock.batch_ended(trainer)
        if seconds is not None:
            self.step_seconds.append(seconds)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != 0 or self._initial is None:
            return
        batch = {k: torch.cat([rows[k] for rows in self._rows]) for k in self._rows[0]}
        reference, self._initial = self._initial, None
        out = reference.token_losses(batch)
        loss = (out.token_losses * out.mask).sum() / out.mask.sum()
        loss.backward()
        got = torch.cat([p.grad.double().flatten() for p in pl_module.parameters() if p.grad is not None])
        want = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None])
        self.rel_error = float((got - want).norm() / want.norm())


def fit(variant: str, quick: bool) -> dict[str, Any]:
    """Train ``variant`` for the warm-up and measured steps; return its gradient error and step time."""
    from lightning_efficient import CorpusDataModule, StepTokenMean

    micro_batches, token_mean = VARIANTS[variant]
    warmup, measured = _steps(quick)
    lightning.seed_everything(0)
    model = _variable_length_gpt()
    probe = FirstStepGradient()
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=warmup + measured, accumulate_grad_batches=micro_batches, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[probe] + ([StepTokenMean()] if token_mean else []),
    )
    data = CorpusDataModule(vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"],
                            batch_size=GLOBAL_BATCH // micro_batches, max_files=60 if quick else 200)
    trainer.fit(model, datamodule=data)
    step = statistics.median(probe.step_seconds[warmup:])
    return {"grad_rel_error": probe.rel_error, "step_time_s": step,
            "tokens_per_s": GLOBAL_BATCH * MODEL["seq_len"] / step, "micro_batches": micro_batches}


def report(results: dict[str, Any], out_dir: Any, quick: bool) -> str:
    """Each split in plain Lightning beside StepTokenMean: the gradient's error and the step time's ratio, taken round
    by round (the machine's speed drifts between rounds more than the two differ)."""
    lines = ["## Plain Lightning's accumulation against StepTokenMean", "",
             "Step time ratio: StepTokenMean's over plain Lightning's at the same split, in each round (interleaved "
             "fresh processes), then their median.", "",
             "| split | plain grad_rel_error | StepTokenMean grad_rel_error | unsplit grad_rel_error | step time ratio per round | median |",
             "|---|---|---|---|---|---|"]
    unsplit = results.get("unsplit", {})
    for split in ("4x4", "1x16"):
        plain, ours = results.get(f"lightning_{split}", {}), results.get(f"step_token_mean_{split}", {})
        if "error" in plain or "error" in ours or not plain or not ours:
            continue
        ratios = paired_ratios(results, f"step_token_mean_{split}", f"lightning_{split}") or [ours["step_time_s"] / plain["step_time_s"]]
        lines.append(f"| {split} | {plain['grad_rel_error']:.3g} | {ours['grad_rel_error']:.3g} | "
                     f"{unsplit.get('grad_rel_error', float('nan')):.3g} | {', '.join(f'{r:.3f}' for r in ratios)} | "
                     f"{statistics.median(ratios):.3f} |")
    return "\n".join(lines)


register(
    Case(
        name="token_mean",
        description=(
            "The demo GPT (vocab 4096, 4 layers, d_model 128, seq 128) on rows of 8 to 128 valid tokens (the rest "
            "labelled -100), a global batch of 16 unsplit, 4 x 4 and 1 x 16, in plain Lightning and with "
            "`StepTokenMean`: the first step's gradient against the float64 token mean of the same 16 rows "
            "(`grad_rel_error`), and the optimizer step's time. Plain Lightning averages each micro-batch's own "
            "token mean; HF Trainer mends the same by dividing each loss by the step's item count "
            "(`num_items_in_batch`), which it counts by fetching the step's batches ahead."
        ),
        baseline="unsplit",
        variants={name: functools.partial(fit, name) for name in VARIANTS},
        rounds=3,
        extra_report=report,
    )
)
