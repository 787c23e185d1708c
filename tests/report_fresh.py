"""Run by test_report.py in a fresh process (bitsandbytes not yet imported): a small fit with MemoryReport, with
EightBitOptimizer or without. Usage: python report_fresh.py OUT.json 8bit|32bit. Writes MemoryReport's figures."""

import json
import sys

import lightning
import torch

from lightning_efficient import EightBitOptimizer, MemoryReport


class Small(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64)), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


assert "bitsandbytes" not in sys.modules
report = MemoryReport(every_n_steps=1, log=False, print_table=False)
trainer = lightning.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False,
                            callbacks=[report, *([EightBitOptimizer(min_8bit_size=1)] if sys.argv[2] == "8bit" else [])])
trainer.fit(Small())
json.dump({**report.report(), "bitsandbytes_loaded": "bitsandbytes" in sys.modules}, open(sys.argv[1], "w"))
