"""Run by test_identical_ranks.py: hetero_fsdp with shares "auto" on 2 IDENTICAL gloo CPU processes,
launched the way a user launches them — Lightning's own launcher re-runs this script for rank 1
(``Trainer(devices=2)``, no environment prepared, no thread count set).

Usage: python identical_ranks.py OUT_DIR [hetero_fsdp|hetero_ddp]

Each rank writes OUT_DIR/rankR.pt: its torch intra-op thread count during fit and the shares in
force at each of 12 optimizer steps (re-planned every 2 steps after 2 warm-up steps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from lightning_efficient import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy

SEQ, VOCAB, D = 8, 32, 16


class Rows(Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i]


class Model(lightning.LightningModule):
    """Two TransformerEncoderLayer blocks, each sharded, then the root (the new user's model, smaller)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)
        self.threads: list[int] = []
        self.shares: list[list[int]] = []

    def configure_model(self):
        if not isinstance(self.trainer.strategy, HeterogeneousFSDPStrategy):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        self.threads.append(torch.get_num_threads())
        return F.cross_entropy(self(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def on_before_optimizer_step(self, optimizer):
        self.shares.append(self.trainer.strategy.current_shares)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path, name: str) -> None:
    kind = HeterogeneousFSDPStrategy if name == "hetero_fsdp" else HeterogeneousDDPStrategy
    strategy = kind(rebalance_every=2, warmup_steps=2)
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=12, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Model()
    trainer.fit(module, DataLoader(Rows(64), batch_size=4))
    torch.save({"threads": module.threads, "shares": module.shares}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "hetero_fsdp")
