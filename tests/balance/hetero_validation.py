"""Run by test_strategy.py: validation and test under the micro-batch caps of hetero_ddp (STRATEGY ``ddp``) or
hetero_fsdp (``fsdp``, the module sharded by ``fully_shard``) beside the same fits without caps (plain ``ddp``; hetero_fsdp
without caps, as plain FSDP2 under Lightning validates every sample on every rank), on DEVICES processes.

The evaluation DataLoaders batch 8 samples; the caps are 3 (and 5 on a second rank), so every rank runs each batch as
chunks of at most 3 (3+3+2). After the first epoch the caps become 1 (the training DataLoader built again, as AutoFit
does when it plans again): the next validation runs at 1. Then ``trainer.validate`` and ``trainer.test`` under the caps.
Cases (:data:`CASES`): ``whole``, Lightning's default counts with one sanity step; ``limited``, ``limit_val_batches=2``,
two sanity steps, ``limit_test_batches=0.5``, then a fit that raises in its second validation; ``two_loaders``, a second
validation DataLoader of batch 2 under ``limit_val_batches=2`` (one count cannot follow both: both whole, a warning);
``two_loaders_every``, the same under the default counts (each chunked as it needs); ``caps_rise``, the caps raised to 8
after epoch 0 under ``limit_val_batches=2`` (whole again, your count again); ``subclass``, a DataLoader subclass (left
whole). Writes, per case, fit and rank, the evaluation batch sizes and the samples evaluated in order (sanity check,
each validation, test; per DataLoader), the logged losses, the trainer's counts after each call and the warnings (rank
0 gathers every rank's; JSON, OUT).

Usage: python hetero_validation.py DEVICES OUT ddp|fsdp
"""

import json
import os
import sys
import warnings

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
    """Records what each evaluation batch holds, per DataLoader; raises in validation at epoch ``fail_at``."""

    def __init__(self, sharded: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        self.sharded, self.fail_at = sharded, fail_at
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

    def _evaluate(self, batch, name: str, dataloader_idx: int) -> None:
        if self.current_epoch == self.fail_at and not self.trainer.sanity_checking:
            raise RuntimeError("failed on purpose")
        x, index = batch
        key = ("sanity" if self.trainer.sanity_checking else f"{name}{self.current_epoch}") + f"/{dataloader_idx}"
        self.batches.setdefault(key, []).append(int(x.shape[0]))
        self.validated.setdefault(key, []).extend(int(i) for i in index)
        self.log(f"{name}_loss", self(x).mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self._evaluate(batch, "val", dataloader_idx)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self._evaluate(batch, "test", dataloader_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the same weights validated by both fits


class CapsChangeAfterTheFirstEpoch(Callback):
    """Every rank's cap becomes ``cap`` after epoch 0, the training DataLoader built again (as AutoFit's plan made
    again)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.strategy.max_micro_batch = [self.cap] * trainer.world_size
            trainer.fit_loop._combined_loader = None


class OwnLoader(DataLoader):
    """A DataLoader subclass of the user's (its class would be lost in a rebuild: left whole)."""


COUNTS = ("limit_val_batches", "num_sanity_val_steps", "limit_test_batches")
#: case -> (the trainer's counts, the validation DataLoaders' batch sizes, the cap after epoch 0, a subclass loader)
CASES = {"whole": ({"num_sanity_val_steps": 1}, [8], 1, False),
         "limited": ({"limit_val_batches": 2, "num_sanity_val_steps": 2, "limit_test_batches": 0.5}, [8], 1, False),
         "two_loaders": ({"limit_val_batches": 2}, [8, 2], 1, False),
         "two_loaders_every": ({"num_sanity_val_steps": 1}, [8, 2], 1, False),
         "caps_rise": ({"limit_val_batches": 2}, [8], 8, False),
         "subclass": ({"limit_val_batches": 2}, [8], 1, True)}


def run(devices: int, capped: bool, sharded: bool, case: str) -> dict:
    counts, batch_sizes, cap_after, subclass = CASES[case]
    caps = [3, 5][:devices] if capped else None
    if sharded:
        strategy = HeterogeneousFSDPStrategy(max_micro_batch=caps, shuffle=False, process_group_backend="gloo")
    else:
        strategy = HeterogeneousDDPStrategy(max_micro_batch=caps, shuffle=False) if capped else "ddp"
    callbacks = [CapsChangeAfterTheFirstEpoch(cap_after)] if capped else []
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, **counts)
    model = Linear(sharded)
    train = DataLoader(Indexed(16, 0), batch_size=4)
    kind = OwnLoader if subclass else DataLoader
    validation = [kind(Indexed(20, 1), batch_size=size) for size in batch_sizes]
    warned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, validation)
    warned += [str(w.message) for w in caught if "cannot follow each" in str(w.message)]

    def losses(prefix: str) -> dict:
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}

    found = {"val_loss": losses("val_loss"), "after": {"fit": [getattr(trainer, n) for n in COUNTS]}}
    if capped:
        trainer.strategy.max_micro_batch = caps
    trainer.validate(model, validation, verbose=False)
    found["validate_loss"] = losses("val_loss")
    found["after"]["validate"] = [getattr(trainer, n) for n in COUNTS]
    trainer.test(model, [kind(Indexed(20, 1), batch_size=size) for size in batch_sizes], verbose=False)
    found["test_loss"] = losses("test_loss")
    found["after"]["test"] = [getattr(trainer, n) for n in COUNTS]
    if capped and case == "limited":  # a fit that raises in its second validation: the counts are yours again
        try:
            trainer.fit(Linear(sharded, fail_at=1), train, validation)
        except RuntimeError as error:
            assert "failed on purpose" in str(error)
        found["after"]["failed"] = [getattr(trainer, n) for n in COUNTS]
    mine = {"batches": model.batches, "validated": model.validated}
    every = [None] * devices
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    return {**found, "ranks": every, "warned": warned}


def main() -> None:
    devices, out, strategy = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sharded = strategy == "fsdp"
    found = {case: {"plain": run(devices, False, sharded, case), "capped": run(devices, True, sharded, case)} for case in CASES}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out, "w") as handle:
            json.dump(found, handle)


if __name__ == "__main__":
    main()
