"""Run by test_resume.py: under hetero_ddp whose max_micro_batch=2 splits each DataLoader batch of 4 into two
micro-batches a step, a ModelCheckpoint saving every 2 steps; a fit of 3 steps, then a fit resumed from the checkpoint
of step 2 for 5 steps. Writes, for the checkpoint of step 2, its bytes' digest before and after the resumed fit and its
training loop's batch count (rank 0, JSON, OUT).

Usage: python resume_keeps_checkpoint.py DEVICES OUT
"""

import hashlib
import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy


class Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(devices: int, folder: str, steps: int, ckpt_path: str | None = None) -> None:
    data = torch.randn(64, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=HeterogeneousDDPStrategy(max_micro_batch=2),
                        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(Linear(), DataLoader(TensorDataset(data), batch_size=4), ckpt_path=ckpt_path)


def described(path: Path) -> dict:
    state = torch.load(path, weights_only=False)
    progress = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    return {"digest": hashlib.sha256(path.read_bytes()).hexdigest(), "batches": progress, "global_step": state["global_step"]}


if __name__ == "__main__":
    devices, out = int(sys.argv[1]), sys.argv[2]
    folder = str(Path(out).parent / "checkpoints")  # (the same on every rank)
    fit(devices, folder, steps=3)
    saved = Path(folder) / "epoch=0-step=2.ckpt"
    before = described(saved)
    fit(devices, folder, steps=5, ckpt_path=str(saved))
    if L.fabric.utilities.rank_zero.rank_zero_only.rank == 0:
        json.dump({"before": before, "after": described(saved)}, open(out, "w"))
