"""Run by test_strategy.py: one process under hetero_ddp, a DataLoader with drop_last=True over 70 samples in batches
of 8. Usage: python drop_last.py OUT (JSON: the samples each step trained, and the distinct ones)."""

import json
import sys

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, index = batch
        self.seen.append(index.tolist())
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(70, 4), torch.arange(70)), batch_size=8, drop_last=True)


if __name__ == "__main__":
    module = Module()
    lightning.Trainer(accelerator="cpu", devices=1, strategy=HeterogeneousDDPStrategy(process_group_backend="gloo"), max_epochs=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)
    seen = [i for batch in module.seen for i in batch]
    with open(sys.argv[1], "w") as out:
        json.dump({"steps": [len(b) for b in module.seen], "samples": len(seen), "distinct": len(set(seen))}, out)
