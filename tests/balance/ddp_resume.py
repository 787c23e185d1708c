"""Run by test_resume.py: small hetero_ddp fits that record which samples each rank trains at each step.

Usage: python ddp_resume.py OUT_DIR JOBS_JSON MAX_EPOCHS

JOBS_JSON is a list of fits run one after the other in this process (several only with devices=1:
under DDP, Lightning re-executes this script for the other rank), each
{"tag", "devices", "global_batch", "resume": a checkpoint path or null, "saves": ["step=N" (saved after
global step N), "epoch=E" (saved at the end of epoch E)], "no_batching": bool, "estimates": bool (configure_optimizers reads
trainer.estimated_stepping_batches)}. Each rank writes
TAG_rankR.json: the steps it trained ({"step", "epoch", "indices"}, one entry per micro-batch) and
the final global step. A ValueError from fit is written to TAG_error.txt instead.
"""

import json
import sys
from pathlib import Path

import lightning
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_efficient import HeterogeneousDDPStrategy

N, SEED = 8, 3


class Items(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "index": i}


class Module(lightning.LightningModule):
    def __init__(self, estimates: bool = False):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.trained = []
        self.estimates = estimates

    def training_step(self, batch, batch_idx):
        step = {"step": self.trainer.global_step, "epoch": self.current_epoch, "indices": batch["index"].tolist()}
        self.trained.append(step)
        return self.net(batch["x"]).square().mean()

    def configure_optimizers(self):
        if self.estimates:  # as for a OneCycleLR's total_steps: builds the training DataLoader before a checkpoint loads
            self.estimated = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Save(lightning.Callback):
    def __init__(self, out, tag, saves):
        self.out, self.tag = out, tag
        self.steps = {int(s.split("=")[1]) for s in saves if s.startswith("step=")}
        self.epochs = {int(s.split("=")[1]) for s in saves if s.startswith("epoch=")}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:  # accumulation is 1: every batch ends a step
            self.steps.discard(trainer.global_step)
            trainer.save_checkpoint(self.out / f"{self.tag}_step{trainer.global_step}.ckpt")

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch in self.epochs:
            trainer.save_checkpoint(self.out / f"{self.tag}_epoch{trainer.current_epoch}.ckpt")


def fit(out, job, max_epochs):
    lightning.seed_everything(0)
    module = Module(estimates=job.get("estimates", False))
    trainer = lightning.Trainer(
        accelerator="cpu", devices=job["devices"], max_epochs=max_epochs,
        strategy=HeterogeneousDDPStrategy(global_batch_size=job["global_batch"], seed=SEED),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Save(out, job["tag"], job.get("saves", []))],
    )
    loader = DataLoader(Items(), batch_size=None if job.get("no_batching") else 2)
    try:
        trainer.fit(module, loader, ckpt_path=job.get("resume"))
    except ValueError as error:
        (out / f"{job['tag']}_error.txt").write_text(str(error))
        return
    record = {"trained": module.trained, "global_step": trainer.global_step}
    (out / f"{job['tag']}_rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    out, jobs, max_epochs = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    for job in jobs:
        fit(out, job, max_epochs)
