"""Run by test_strategy.py: one process under hetero_ddp whose max_micro_batch=2 makes a DataLoader batch of 4
two micro-batches a step (the plan sets accumulate_grad_batches=2): two epochs reloading the DataLoader each epoch,
then a second fit with the same Trainer, then a third that fails at its first step; writes each fit's global batch,
micro-batch sizes, steps and the trainer's accumulate_grad_batches after it to OUT (JSON).

Usage: python hetero_refit.py OUT
"""

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy


class Sizes(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.sizes: list[int] = []
        self.global_batches: list[int] = []
        self.fail = False

    def on_train_epoch_start(self) -> None:
        self.global_batches.append(self.trainer.strategy.sampler.global_batch)

    def training_step(self, batch, batch_idx):
        if self.fail:
            raise RuntimeError("failed on purpose")
        (x,) = batch
        self.sizes.append(int(x.shape[0]))
        return (x * self.weight).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    model = Sizes()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HeterogeneousDDPStrategy(max_micro_batch=2), max_epochs=2,
                        reload_dataloaders_every_n_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    fits = []
    for max_epochs, fail in ((2, False), (3, False), (4, True)):
        model.sizes, model.global_batches, model.fail = [], [], fail
        trainer.fit_loop.max_epochs = max_epochs
        try:
            trainer.fit(model)
        except RuntimeError as error:
            assert "failed on purpose" in str(error)
        fits.append({"global_batches": model.global_batches, "sizes": model.sizes, "steps": trainer.global_step,
                     "accumulation_after": trainer.accumulate_grad_batches})
    json.dump(fits, open(sys.argv[1], "w"))
