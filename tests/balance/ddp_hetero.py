"""Run by test_strategy.py: 2-process CPU runs of hetero_ddp. Usage: python ddp_hetero.py MODE OUT.

Modes: samples / tokens (one step with shares 2:1, rank 0 saves its gradients and the global
batch), rebalance (rank 1 slowed 3x; rank 0 saves the shares over time), bad_global, bad_shares.
"""

import json
import sys
import time

import lightning
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_efficient import HeterogeneousDDPStrategy, SelectiveTokenLoss, TokenLosses

N, SEQ, VOCAB, FEATURES = 48, 5, 13, 6


class Rows(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(N, FEATURES, generator=g, dtype=torch.float64)
        self.y = torch.randn(N, 1, generator=g, dtype=torch.float64)
        self.ids = torch.randint(0, VOCAB, (N, SEQ), generator=g)
        self.labels = torch.randint(0, VOCAB, (N, SEQ), generator=g)
        self.labels[torch.rand(N, SEQ, generator=g) < 0.4] = -100  # uneven valid tokens per sample

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "ids": self.ids[i], "labels": self.labels[i], "index": i}


class Module(lightning.LightningModule):
    def __init__(self, mode, slow_rank=None):
        super().__init__()
        self.mode, self.slow_rank = mode, slow_rank
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def per_sample_loss(self, batch):
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def per_token(self, batch):
        logits = self.head(torch.tanh(self.emb(batch["ids"])))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(batch["labels"].shape)

    def training_step(self, batch, batch_idx):
        if self.mode in ("tokens", "selective"):
            # every parameter takes part (DDP all-reduces only buckets whose gradients are all ready)
            losses = self.per_token(batch) + 0 * self.net(batch["x"]).sum()
            out = TokenLosses(losses, batch["labels"] != -100)
        else:
            out = self.per_sample_loss(batch) + 0 * self.per_token(batch).sum()
        if self.slow_rank is not None:  # compute that grows with the batch: 1 ms a sample, 3 ms on the slow rank
            time.sleep(0.001 * len(batch["x"]) * (3 if self.global_rank == self.slow_rank else 1))
        return out

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0 if self.mode != "rebalance" else 1e-3)


class Record(lightning.Callback):
    def __init__(self, out, mode):
        self.out, self.mode, self.shares = out, mode, []

    def on_fit_start(self, trainer, pl_module):
        self.init = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        strategy = trainer.strategy
        if self.mode == "rebalance":
            self.shares.append(strategy.current_shares)
            if trainer.global_rank == 0:
                json.dump({"shares": self.shares}, open(self.out, "w"))
            return
        if trainer.global_rank == 0 and trainer.global_step == 0:
            sampler = strategy._sampler
            indices = sampler.global_batch_indices(0, sampler._permutation())
            grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            torch.save({"grads": grads, "init": self.init, "indices": indices, "shares": strategy.current_shares}, self.out)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    lightning.seed_everything(0)
    kwargs = {"global_batch_size": 6, "shares": [2.0, 1.0]}
    if mode == "rebalance":
        kwargs = {"global_batch_size": 24, "shares": "auto", "warmup_steps": 2, "rebalance_every": 2, "hysteresis": 0.02}
    if mode == "bad_global":
        kwargs = {"global_batch_size": 1}
    if mode == "bad_shares":
        kwargs = {"global_batch_size": 6, "shares": [1.0, 2.0, 3.0]}
    strategy = HeterogeneousDDPStrategy(**kwargs)
    extra = [SelectiveTokenLoss(method="topk", keep_ratio=0.5, scope="global")] if mode == "selective" else []
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="64-true", max_steps=1 if mode in ("samples", "tokens", "selective") else 14,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record(out, mode), *extra],
    )
    trainer.fit(Module(mode, slow_rank=1 if mode == "rebalance" else None), DataLoader(Rows(), batch_size=3))
