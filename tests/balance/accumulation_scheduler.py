"""Run by test_strategy.py: hetero_ddp on 2 CPU processes with a GradientAccumulationScheduler ({0: 1, 1: 2}: an
optimizer step a global batch in epoch 0, one every two in epoch 1), the accumulation tests' float64 token model
(uneven valid tokens: TokenLosses) learning with SGD, ``shuffle=False`` (global batch k holds samples 4k to 4k + 3).
Rank 0 writes the initial and final weights; then the same with ``max_micro_batch=1`` (the caps take two
micro-batches a step): the error raised.

Usage: python accumulation_scheduler.py OUT.pt
"""

import sys

import lightning
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lightning_efficient import HeterogeneousDDPStrategy
from tests.tokens.accumulation_model import Rows, Tiny

LR = 0.5


class Learning(Tiny):
    """The token model with a learning rate, its DataLoader left to the strategy."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=2)


def fit(max_micro_batch=None):
    lightning.seed_everything(0)
    model = Learning()
    initial = {k: v.detach().clone().double() for k, v in model.state_dict().items()}
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=HeterogeneousDDPStrategy(shuffle=False, max_micro_batch=max_micro_batch),
        precision="64-true", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})],
    )
    trainer.fit(model)
    return trainer, initial, model


if __name__ == "__main__":
    trainer, initial, model = fit()
    result = {"initial": initial, "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
              "steps": trainer.global_step}
    try:
        fit(max_micro_batch=1)
    except ValueError as error:
        result["capped_error"] = str(error)
    if trainer.global_rank == 0:
        torch.save(result, sys.argv[1])
