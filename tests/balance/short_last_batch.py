"""Run by test_strategy.py: an epoch whose last global batch is short, on DEVICES processes, under plain ``ddp`` and
under hetero_ddp (shares 3:1 on 2 processes; then with max_micro_batch=2, two micro-batches a step), over 22 samples
(global batch 4 x ranks: the last holds 22 mod it), and over 17 (on 2 processes fewer remain than a sample per rank and
micro-batch); then over 22 samples after a fit that failed (also one whose module reads
``estimated_stepping_batches``), and after Lightning's learning-rate finder (``Tuner.lr_find`` before the fit, and the
``LearningRateFinder`` callback within it). Writes for
each fit the samples every step trained (over all ranks), the float64 weights and the weights a mean over each step's
samples gives (rank 0, JSON, OUT).

Usage: python short_last_batch.py DEVICES OUT
"""

import json
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy

LR = 0.1


class Linear(L.LightningModule):
    """A loss linear in the weights, a mean over samples: every step moves the weights by its samples' mean input.
    ``fail_at``: the micro-batch whose step raises; ``reads_stepping_batches``: ``configure_optimizers`` reads
    ``trainer.estimated_stepping_batches`` (for a scheduler's total steps), which iterates the training DataLoader."""

    def __init__(self, fail_at: int | None = None, reads_stepping_batches: bool = False) -> None:
        super().__init__()
        self.reads_stepping_batches = reads_stepping_batches
        self.weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.trained: list[tuple[int, list[float], int]] = []  # (step, input sum, samples) of each micro-batch
        self.fail_at, self.lr = fail_at, LR

    def on_train_start(self) -> None:
        self.trained, self.start_weight = [], self.weight.detach().clone()  # this fit's (not lr_find's) steps

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.fail_at is not None and len(self.trained) + 1 == self.fail_at:
            self.fail_at = None
            raise RuntimeError("failed on purpose")
        self.trained.append((self.global_step, x.detach().sum(0).tolist(), int(x.shape[0])))
        return (x * self.weight).sum(1).mean()

    def configure_optimizers(self):
        if self.reads_stepping_batches:
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(devices: int, strategy, samples: int, before: str | None = None) -> dict:
    """``before``: "failed_fit" (a fit of the same epoch on the same Trainer that raises at its 4th micro-batch; with
    "failed_fit_estimating", one whose ``configure_optimizers`` reads ``estimated_stepping_batches``) or "lr_find"
    (Lightning's learning-rate finder's 4 steps), then the fit; or "lr_find_callback": the finder's 4 steps within the
    fit, as its callback runs them, before the fit's own."""
    data = torch.randn(samples, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    finder = [LearningRateFinder(num_training_steps=4, early_stop_threshold=None, update_attr=False)] if before == "lr_find_callback" else []
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, callbacks=finder,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Linear(fail_at=4 if before and before.startswith("failed_fit") else None,
                   reads_stepping_batches=before == "failed_fit_estimating")
    loader = DataLoader(TensorDataset(data), batch_size=4)
    if before and before.startswith("failed_fit"):
        try:
            trainer.fit(model, loader)
        except RuntimeError as error:
            assert "failed on purpose" in str(error)
    elif before == "lr_find":
        Tuner(trainer).lr_find(model, loader, num_training=4, early_stop_threshold=None, update_attr=False)
    trainer.fit(model, loader)
    trained = [model.trained]
    if dist.is_initialized():
        trained = [None] * dist.get_world_size()
        dist.all_gather_object(trained, model.trained)
    sums, counts = {}, {}
    for step, input_sum, count in (item for rank in trained for item in rank):
        sums[step] = sums.get(step, torch.zeros(2, dtype=torch.float64)) + torch.tensor(input_sum, dtype=torch.float64)
        counts[step] = counts.get(step, 0) + count
    expected = model.start_weight.clone()
    for step in sorted(sums):
        expected -= LR * sums[step] / counts[step]
    return {"step_samples": [counts[step] for step in sorted(counts)], "weight": model.weight.detach().tolist(),
            "expected_weight": expected.tolist()}


if __name__ == "__main__":
    devices = int(sys.argv[1])
    shares = [3, 1] if devices == 2 else "auto"
    found = {}
    for samples in (22, 17):
        found[samples] = {
            "plain": fit(devices, "ddp", samples),
            "hetero": fit(devices, HeterogeneousDDPStrategy(shares=shares, shuffle=False), samples),
            "capped": fit(devices, HeterogeneousDDPStrategy(shares=shares, max_micro_batch=2, shuffle=False), samples),
        }
    # the position in the epoch after an earlier fit of it on the same Trainer (review: a failed fit's or lr_find's
    # scaled the losses as a batch past the epoch's end)
    after = {before: fit(devices, HeterogeneousDDPStrategy(shares=shares, shuffle=False), 22, before)
             for before in ("failed_fit", "failed_fit_estimating", "lr_find", "lr_find_callback")}
    if L.fabric.utilities.rank_zero.rank_zero_only.rank == 0:
        json.dump({"short": found, "after": after}, open(sys.argv[2], "w"))
