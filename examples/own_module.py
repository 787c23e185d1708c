"""Your own LightningModule with a plain Trainer and the four plugins.

The only change a module needs is to return per-token losses from training_step
(TokenLosses(losses, mask)); everything else is switched on from Trainer(...).

    python examples/own_module.py --steps 50
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_efficient import (
    ActivationMemory,
    CorpusDataModule,
    EightBitOptimizer,
    MemoryReport,
    SelectiveTokenLoss,
    TokenLosses,
)


class TinyLM(L.LightningModule):
    """A GRU-free, attention-free toy LM: embeddings, a stack of MLP blocks, a tied head."""

    def __init__(self, vocab_size: int = 8192, width: int = 128, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def training_step(self, batch, batch_idx):
        x = self.embed(batch["input_ids"])
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=-100)
        return TokenLosses(losses.view_as(batch["labels"]), batch["labels"] != -100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=[
            SelectiveTokenLoss(method="topk", keep_ratio=0.6, warmup_steps=10),
            ActivationMemory(policy="checkpoint", blocks=["layers.*"]),
            EightBitOptimizer(),
            MemoryReport(every_n_steps=10),
        ],
    )
    trainer.fit(TinyLM(), datamodule=CorpusDataModule(batch_size=8, max_files=200))


if __name__ == "__main__":
    main()
