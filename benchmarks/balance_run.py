"""One 2-process CPU run for the ``balance`` case (launched by it; Lightning re-executes this file
for rank 1). Usage: python benchmarks/balance_run.py STRATEGY SLOW MODEL STEPS OUT.json

STRATEGY: ``ddp``, ``hetero_ddp``, ``fsdp`` (plain FSDP2: Lightning's ``ModelParallelStrategy`` with
``fully_shard`` per layer or block and on the model) or ``hetero_fsdp`` (the same sharding).

Rank 1 is made ``SLOW`` times slower by sleeping ``(SLOW - 1)`` times its own compute time per
sample (calibrated before training, after a warm-up, at the per-rank batch of plain data
parallelism) times its batch size, each micro-step: the forward's share before the forward, the
backward's share when backward starts (a gradient hook on the output), so that both halves of the
step are slowed as a slower device would slow them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)


def mlp() -> torch.nn.Module:
    """About 2.4 M parameters."""
    return torch.nn.Sequential(torch.nn.Linear(512, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def seconds_per_sample(forward, samples: int) -> tuple[float, float]:
    """Forward and backward compute seconds per sample of ``forward()`` (which returns the loss) over
    ``samples``: one warm-up call (first-call costs are not per-sample compute), then the mean of 3."""
    loss = forward()
    loss.backward()
    spent = [0.0, 0.0]
    for _ in range(3):
        start = time.perf_counter()
        loss = forward()
        middle = time.perf_counter()
        loss.backward()
        spent[0] += middle - start
        spent[1] += time.perf_counter() - middle
    return spent[0] / (3 * samples), spent[1] / (3 * samples)


def slowed(module: lightning.LightningModule, output: torch.Tensor, samples: int) -> torch.Tensor:
    """On rank 1, ``output`` with the backward's share of the slowdown attached (the forward's share
    is slept before the forward)."""
    if module.slow > 1 and module.global_rank == 1 and output.requires_grad:
        delay = (module.slow - 1) * module.per_sample[1] * samples
        output.register_hook(lambda grad: time.sleep(delay))
    return output


def slow_forward(module: lightning.LightningModule, samples: int) -> None:
    if module.slow > 1 and module.global_rank == 1:
        time.sleep((module.slow - 1) * module.per_sample[0] * samples)


def shard(module: torch.nn.Module, parts, mesh) -> None:
    """FSDP2: ``fully_shard`` each of ``parts``, then ``module`` (the rest)."""
    from torch.distributed.fsdp import fully_shard

    for part in parts:
        fully_shard(part, mesh=mesh)
    fully_shard(module, mesh=mesh)


class MLPModule(lightning.LightningModule):
    def __init__(self, slow: float):
        super().__init__()
        self.net, self.slow, self.per_sample = mlp(), slow, (0.0, 0.0)

    def calibrate(self, x):
        self.per_sample = seconds_per_sample(lambda: self.net(x).sum(), len(x))
        self.net.zero_grad()

    def configure_model(self):
        if self.device_mesh is None:  # not under ModelParallelStrategy
            return
        shard(self.net, [m for m in self.net if isinstance(m, torch.nn.Linear)], self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        slow_forward(self, len(x))
        return torch.nn.functional.cross_entropy(slowed(self, self.net(x), len(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class DemoModule(lightning.LightningModule):
    def __init__(self, slow: float):
        super().__init__()
        from lightning_efficient import DemoGPT

        self.gpt = DemoGPT(vocab_size=2048, n_layers=2, d_model=128, n_heads=4, seq_len=64)
        self.slow, self.per_sample = slow, (0.0, 0.0)

    def calibrate(self, x):
        batch = {"input_ids": x, "labels": x}
        self.per_sample = seconds_per_sample(lambda: self.gpt.token_losses(batch)["loss"], len(x))
        self.gpt.zero_grad()

    def configure_model(self):
        if self.device_mesh is None:  # not under ModelParallelStrategy
            return
        shard(self.gpt, list(self.gpt.blocks), self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        ids, _ = batch
        slow_forward(self, len(ids))
        out = self.gpt.token_losses({"input_ids": ids, "labels": ids})
        return type(out)(slowed(self, out.token_losses, len(ids)), out.mask)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Throughput(lightning.Callback):
    """Samples per second over the steps after ``skip`` (the re-balancing warm-up), on rank 0."""

    def __init__(self, out: str, skip: int, global_batch: int):
        self.out, self.skip, self.global_batch, self.start = out, skip, global_batch, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.skip and self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            steps = trainer.global_step - self.skip
            elapsed = time.perf_counter() - self.start
            shares = getattr(trainer.strategy, "current_shares", None)
            Path(self.out).write_text(json.dumps({"samples_per_s": steps * self.global_batch / elapsed, "shares": shares}))


def main() -> None:
    strategy_name, slow, model_name, steps, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_efficient import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy

    lightning.seed_everything(0)
    if model_name == "mlp":
        global_batch, n = 2048, 2048 * (steps + 2)
        data = TensorDataset(torch.randn(n, 512), torch.randint(0, 10, (n,)))
        module = MLPModule(slow)
        module.calibrate(torch.randn(global_batch // 2, 512))  # at the per-rank batch of plain DDP
    else:
        global_batch, n = 64, 64 * (steps + 2)
        data = TensorDataset(torch.randint(0, 2048, (n, 64)), torch.zeros(n))
        module = DemoModule(slow)
        module.calibrate(torch.randint(0, 2048, (global_batch // 2, 64)))
    warmup = min(10, steps // 3)
    skip = warmup
    if strategy_name == "hetero_ddp":
        strategy = HeterogeneousDDPStrategy(global_batch_size=global_batch, warmup_steps=3, rebalance_every=3)
    elif strategy_name == "hetero_fsdp":
        strategy = HeterogeneousFSDPStrategy(global_batch_size=global_batch, warmup_steps=3, rebalance_every=3)
    elif strategy_name == "fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Throughput(out, skip, global_batch)],
    )
    trainer.fit(module, DataLoader(data, batch_size=global_batch // 2, shuffle=True))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
