"""Run by test_callback_fixes.py: 2 CPU processes (gloo) under SelectiveTokenLoss; at step 1 only rank 1's
per-token losses hold a NaN. Each rank writes the error it raised to OUT_DIR/rank{r}.txt.

Usage: python ddp_non_finite.py OUT_DIR
"""

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import SelectiveTokenLoss, TokenLosses


class NanOnRankOne(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        losses = (x * self.weight).pow(2)
        if self.trainer.global_step == 1 and self.trainer.global_rank == 1:
            losses = losses * torch.tensor([1.0, float("nan"), 1.0, 1.0])
        return TokenLosses(losses)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SelectiveTokenLoss(method="topk", keep_ratio=0.5)])
    try:
        trainer.fit(NanOnRankOne(), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2))
        message = "no error"
    except FloatingPointError as error:
        message = f"FloatingPointError at step {trainer.global_step}: {error}"
    (out / f"rank{trainer.global_rank}.txt").write_text(message)
