"""Run by test_strategy.py: one process under hetero_ddp, 22 samples in batches of 4 read by 2 DataLoader workers,
the DataLoader reloaded every epoch, 3 epochs; writes each epoch's trained sample indices, the steps and the installed
loader's prefetch_factor, timeout and worker start method (the user's: 1, 30, spawn) (JSON, OUT).

Usage: python reload_workers.py OUT
"""

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_efficient  # noqa: F401  (registers "hetero_ddp")


class Indices(Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.trained: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.trained.setdefault(self.current_epoch, []).extend(int(i) for i in batch.flatten())
        return (batch * self.weight).mean()

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=4, num_workers=2, prefetch_factor=1, timeout=30, multiprocessing_context="spawn")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    model = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hetero_ddp", max_epochs=3, reload_dataloaders_every_n_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    loader = trainer.train_dataloader
    kept = [loader.prefetch_factor, loader.timeout, loader.multiprocessing_context.get_start_method()]
    json.dump({"steps": trainer.global_step, "trained": model.trained, "kept": kept}, open(sys.argv[1], "w"))
