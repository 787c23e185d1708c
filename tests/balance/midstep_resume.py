"""Run by test_strategy.py: a checkpoint taken between a step's micro-batches under hetero_ddp, resumed, on DEVICES
processes. 32 samples a process in DataLoader batches of 4 with accumulate_grad_batches=2, a validation after every 3
batches (mid-step) saving a checkpoint, one epoch; then the fit resumed from the first checkpoint; then the same with
a validation after every batch, resumed from the checkpoint after the first (in the epoch's first step).
Writes, for both fits, the (global step, float64 input sum, samples) of every micro-batch on every rank, the float64
weights, and the weights saved in the checkpoint (rank 0, JSON, OUT).

Usage: python midstep_resume.py DEVICES OUT
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy

LR = 0.1


class Linear(L.LightningModule):
    """A loss linear in the weights, a mean over a micro-batch's samples."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.trained: list[tuple[int, list[float], int]] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.trained.append((self.global_step, x.detach().sum(0).tolist(), int(x.shape[0])))
        return (x * self.weight).sum(1).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class SavesAtTheFirstValidation(L.Callback):
    """``trainer.save_checkpoint`` at the fit's first validation (ModelCheckpoint saves nothing at global step 0)."""

    def __init__(self, path: str) -> None:
        self.path, self.saved = path, False

    def on_validation_end(self, trainer, pl_module):
        if not self.saved and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path)
            self.saved = True


def fit(devices: int, saves_in: str, ckpt_path: str | None = None, interval: int = 3) -> dict:
    data = torch.randn(32 * devices, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=HeterogeneousDDPStrategy(shuffle=False),
                        max_epochs=1, accumulate_grad_batches=2, val_check_interval=interval, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=saves_in, save_top_k=-1, filename="{step}-{epoch}"),
                                   SavesAtTheFirstValidation(str(Path(saves_in) / "first_validation.ckpt"))])
    model = Linear()
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=4), DataLoader(TensorDataset(data[:4]), batch_size=4),
                ckpt_path=ckpt_path)
    trained = [model.trained]
    if dist.is_initialized():
        trained = [None] * dist.get_world_size()
        dist.all_gather_object(trained, model.trained)
    return {"trained": trained, "weight": model.weight.detach().tolist(), "steps": trainer.global_step}


if __name__ == "__main__":
    devices, out = int(sys.argv[1]), Path(sys.argv[2])
    found = {}
    # saved after the 3rd micro-batch (in step 1), and after the 1st (in the epoch's first step: a validation each batch)
    for case, interval, saved in (("second_step", 3, "step=1-epoch=0.ckpt"), ("first_step", 1, "first_validation.ckpt")):
        straight = fit(devices, str(out.parent / case / "straight"), interval=interval)
        checkpoint = out.parent / case / "straight" / saved
        saved_weight = torch.load(checkpoint, weights_only=False)["state_dict"]["weight"].tolist()
        resumed = fit(devices, str(out.parent / case / "resumed"), ckpt_path=str(checkpoint), interval=interval)
        found[case] = {"straight": straight, "resumed": resumed, "saved_weight": saved_weight}
    if L.fabric.utilities.rank_zero.rank_zero_only.rank == 0:
        json.dump(found, open(out, "w"))
