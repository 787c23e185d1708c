"""Run by test_streaming.py: 2-process CPU DDP with the streaming threshold under scope="global";
each rank saves the selection metrics of every step to OUT_DIR/rank{r}.pt.

Usage: python ddp_streaming.py OUT_DIR
"""

import sys
from pathlib import Path

import lightning
import torch
from accumulation_model import Tiny

from lightning_efficient import SelectiveTokenLoss


class Record(lightning.Callback):
    def __init__(self, out):
        self.out, self.metrics = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("selection/")})
        torch.save(self.metrics, self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    lightning.seed_everything(0)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", precision="64-true", max_steps=3, logger=False, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SelectiveTokenLoss(method="eslm", keep_ratio=0.5, scope="global"), Record(sys.argv[1])],
    )
    trainer.fit(Tiny(fused=True))
