"""Run by test_distributed.py: a StepLR stepped every 2 batches (``interval="step"``) under plain ``ddp`` on 2 processes,
without and with AutoFit on a device that holds 2 samples a micro-step (batches of 4 become 2 x 2 accumulated), with
Lightning's DistributedSampler and with ``use_distributed_sampler=False`` (every rank draws the whole dataset). Writes
each fit's steps and the learning rate of every optimizer step (rank 0, JSON, OUT).

Usage: python ddp_scheduler.py OUT
"""

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import AutoFit


class Scheduled(L.LightningModule):
    """A linear model over 32 samples in batches of ``batch_size`` (AutoFit sets it), with a StepLR halving the rate every
    2 batches; more than 2 samples a micro-step raise CUDA's out-of-memory error under ``holds``."""

    def __init__(self, holds: bool) -> None:
        super().__init__()
        self.batch_size, self.holds = 4, holds
        self.layer = torch.nn.Linear(3, 1, dtype=torch.float64)
        self.lrs: list[float] = []

    def train_dataloader(self):
        data = torch.randn(32, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=self.batch_size)

    def on_train_start(self):
        self.lrs = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.holds and x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate a sample's activations")
        return self.layer(x).pow(2).mean()

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step", "frequency": 2}}


def fit(autofit: bool, distributed_sampler: bool) -> dict:
    callbacks = [AutoFit(budget="8GiB", activation_policies=["keep"], optimizer_options=["32-bit"])] if autofit else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, use_distributed_sampler=distributed_sampler,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    model = Scheduled(holds=autofit)
    trainer.fit(model)
    return {"steps": trainer.global_step, "lrs": model.lrs, "micro_batches": callbacks[0].plan.micro_batches if autofit else None}


if __name__ == "__main__":
    found = {f"{'autofit' if autofit else 'plain'}_{'distributed' if sampler else 'whole'}": fit(autofit, sampler)
             for sampler in (True, False) for autofit in (False, True)}
    if L.fabric.utilities.rank_zero.rank_zero_only.rank == 0:
        json.dump(found, open(sys.argv[1], "w"))
