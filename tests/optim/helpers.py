"""A small regression module for optimizer tests: deterministic data, resumable loader."""

import lightning
import torch
from torch.utils.data import TensorDataset

from lightning_efficient.resumable import EpochShuffleSampler, ResumableDataLoader


def dataset(n=64, features=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g))


class Regression(lightning.LightningModule):
    """Two linear layers (one large enough for 8-bit states, one bias-sized) and an embedding."""

    def __init__(self, optimizer: str = "adamw", lr: float = 1e-2, scheduler: bool = False, batch_size: int = 8):
        super().__init__()
        self.optimizer_name, self.lr, self.scheduler, self.batch_size = optimizer, lr, scheduler, batch_size
        self.embed = torch.nn.Embedding(64, 80)
        self.hidden = torch.nn.Linear(80, 96)
        self.out = torch.nn.Linear(96, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x + self.embed.weight[:1])))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "step"}}

    def train_dataloader(self):
        data = dataset()
        return ResumableDataLoader(data, batch_size=self.batch_size, sampler=EpochShuffleSampler(len(data), seed=1))


def trainer(steps, callbacks=(), **kwargs):
    return lightning.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks), **{"enable_checkpointing": False, **kwargs},
    )
