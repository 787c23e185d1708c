"""Run by test_strategy.py: one process under hetero_ddp, DataLoader batch 3, accumulate_grad_batches=2, first as it
is, then with max_micro_batch=2 (a cap below the micro-batch the accumulation gives: the strategy takes more
micro-batches a step, as AutoFit's caps ask), then that cap with AutoFit and a ``configure_optimizers`` that reads
``trainer.estimated_stepping_batches`` (the DataLoader built under the cap, then again under AutoFit's); writes for
each the global batch, every micro-batch's size, the steps, the accumulation after the fit, AutoFit's global batch and
the weights with the weights one global-batch mean a step gives (JSON, OUT).

Usage: python hetero_accumulate.py OUT
"""

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_efficient  # noqa: F401  (registers "hetero_ddp")
from lightning_efficient import AutoFit, HeterogeneousDDPStrategy

LR = 0.1


class Sizes(L.LightningModule):
    """A loss linear in the weights, a mean over samples: every step moves the weights by the global batch's mean
    input, so after an epoch they are known in any sample order."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.sizes: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.sizes.append(int(batch[0].shape[0]))  # the fit's micro-batches (not AutoFit's measuring steps)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (x * self.weight).sum(1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Estimating(Sizes):
    """:class:`Sizes` whose ``configure_optimizers`` reads the optimizer steps (as for a OneCycleLR's total steps),
    which builds the training DataLoader before AutoFit plans."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=3)

    def configure_optimizers(self):
        self.total_steps = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


def fit(strategy, autofit: bool = False) -> dict:
    data = torch.randn(24, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model = Estimating(data) if autofit else Sizes()
    planner = AutoFit(budget="4GiB", activation_policies=["keep"], optimizer_options=["32-bit"]) if autofit else None
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, accumulate_grad_batches=2, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[planner] if planner else None)
    trainer.fit(model, None if autofit else DataLoader(TensorDataset(data), batch_size=3))
    global_batch = trainer.strategy.sampler.global_batch
    return {"global_batch": global_batch, "sizes": model.sizes, "steps": trainer.global_step,
            "accumulation_after": trainer.accumulate_grad_batches, "weight": model.weight.tolist(),
            "expected_weight": (1 - LR * data.sum(0) / global_batch).tolist(),
            "planned_global_batch": planner.plan.samples_per_step if planner else None,
            "total_steps": getattr(model, "total_steps", None)}


if __name__ == "__main__":
    json.dump({"as_set": fit("hetero_ddp"), "capped": fit(HeterogeneousDDPStrategy(max_micro_batch=2)),
               "autofit": fit(HeterogeneousDDPStrategy(max_micro_batch=2), autofit=True)}, open(sys.argv[1], "w"))
