"""Run by test_strategy.py: one process under hetero_ddp, DataLoader batch 3, accumulate_grad_batches=2;
writes the global batch and every micro-batch's size to OUT (JSON).

Usage: python hetero_accumulate.py OUT
"""

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_efficient  # noqa: F401  (registers "hetero_ddp")


class Sizes(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.sizes.append(int(x.shape[0]))
        return (x * self.weight).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    model = Sizes()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hetero_ddp", accumulate_grad_batches=2, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(24, 2)), batch_size=3))
    json.dump({"global_batch": trainer.strategy.sampler.global_batch, "sizes": model.sizes, "steps": trainer.global_step},
              open(sys.argv[1], "w"))
