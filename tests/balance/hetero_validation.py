"""Run by test_strategy.py: validation and test under the micro-batch caps of hetero_ddp (STRATEGY ``ddp``) or
hetero_fsdp (``fsdp``, the module sharded by ``fully_shard``) beside the same fits without caps (plain ``ddp``; hetero_fsdp
without caps, as plain FSDP2 under Lightning validates every sample on every rank), on DEVICES processes.

The evaluation DataLoaders batch 8 samples; the caps are 3 (and 5 on a second rank), so every rank runs each batch as
chunks of at most 3 (3+3+2). After the first epoch the caps become 1 (the training DataLoader built again, as AutoFit
does when it plans again): the next validation runs at 1. Then ``trainer.validate`` and ``trainer.test`` under the caps.
``whole``: Lightning's default counts with one sanity step; ``limited``: ``limit_val_batches=2``, two sanity steps,
``limit_test_batches=0.5``. Writes, per case, fit and rank, the evaluation batch sizes and the samples evaluated in
order (sanity check, each validation, test), the logged losses, and the trainer's counts after each call (rank 0
gathers every rank's; JSON, OUT).

Usage: python hetero_validation.py DEVICES OUT ddp|fsdp
"""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_efficient import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy


class Indexed(Dataset):
    """Samples with their index, in float64."""

    def __init__(self, samples: int, seed: int) -> None:
        self.data = torch.randn(samples, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.data[index], index


class Linear(L.LightningModule):
    """Records what each validation batch holds."""

    def __init__(self, sharded: bool = False) -> None:
        super().__init__()
        self.sharded = sharded
        self.weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.batches: dict[str, list[int]] = {}
        self.validated: dict[str, list[int]] = {}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.sharded and not isinstance(self, FSDPModule):  # (once: validate and test call it again)
            fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (FSDP2 gathers the weight around forward)
        return (x * self.weight).sum(1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).square().mean()

    def _evaluate(self, batch, name: str) -> None:
        x, index = batch
        key = "sanity" if self.trainer.sanity_checking else f"{name}{self.current_epoch}"
        self.batches.setdefault(key, []).append(int(x.shape[0]))
        self.validated.setdefault(key, []).extend(int(i) for i in index)
        self.log(f"{name}_loss", self(x).mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the same weights validated by both fits


class CapsChangeAfterTheFirstEpoch(Callback):
    """Every rank's cap becomes 1 after epoch 0, the training DataLoader built again (as AutoFit's plan made again)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.strategy.max_micro_batch = [1] * trainer.world_size
            trainer.fit_loop._combined_loader = None


COUNTS = ("limit_val_batches", "num_sanity_val_steps", "limit_test_batches")
CASES = {"whole": {"num_sanity_val_steps": 1},
         "limited": {"limit_val_batches": 2, "num_sanity_val_steps": 2, "limit_test_batches": 0.5}}


def run(devices: int, capped: bool, sharded: bool, counts: dict) -> dict:
    caps = [3, 5][:devices] if capped else None
    if sharded:
        strategy = HeterogeneousFSDPStrategy(max_micro_batch=caps, shuffle=False, process_group_backend="gloo")
    else:
        strategy = HeterogeneousDDPStrategy(max_micro_batch=caps, shuffle=False) if capped else "ddp"
    callbacks = [CapsChangeAfterTheFirstEpoch()] if capped else []
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, **counts)
    model = Linear(sharded)
    train = DataLoader(Indexed(16, 0), batch_size=4)
    validation = DataLoader(Indexed(20, 1), batch_size=8)
    trainer.fit(model, train, validation)
    found = {"val_loss": float(trainer.callback_metrics["val_loss"]), "after": {"fit": [getattr(trainer, n) for n in COUNTS]}}
    if capped:
        trainer.strategy.max_micro_batch = caps
    trainer.validate(model, validation, verbose=False)
    found["validate_loss"] = float(trainer.callback_metrics["val_loss"])
    found["after"]["validate"] = [getattr(trainer, n) for n in COUNTS]
    trainer.test(model, DataLoader(Indexed(20, 1), batch_size=8), verbose=False)
    found["test_loss"] = float(trainer.callback_metrics["test_loss"])
    found["after"]["test"] = [getattr(trainer, n) for n in COUNTS]
    mine = {"batches": model.batches, "validated": model.validated}
    every = [None] * devices
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    return {**found, "ranks": every}


def main() -> None:
    devices, out, strategy = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sharded = strategy == "fsdp"
    found = {case: {"plain": run(devices, False, sharded, counts), "capped": run(devices, True, sharded, counts)}
             for case, counts in CASES.items()}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as handle:
            json.dump(found, handle)


if __name__ == "__main__":
    main()
