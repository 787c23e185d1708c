"""Run by test_strategy.py: Lightning's integer batch counts under hetero_ddp whose max_micro_batch=2 splits each
DataLoader batch of 4 into two micro-batches a step, beside the same fit under plain ``ddp``, on DEVICES processes:
``limit_train_batches=3`` and ``val_check_interval=2`` over two epochs, then ``overfit_batches=2``, fractions of an
epoch (one of no whole batch, refused), an epoch whose batches ``accumulate_grad_batches=2`` does not divide (also with the DataLoader's
``drop_last``), then a fit that fails at its first step,
then ``val_check_interval=1`` with every checkpoint kept, then a scheduler of ``interval="step"`` stepped every few
batches; then the first under AutoFit, whose caps split the batches on a device that holds 2 samples; then each rank's
own part of the data (``use_distributed_sampler=False``) and the whole dataset so, under hetero_ddp alone.
Writes each fit's steps, samples trained, the learning rates it stepped with, the steps validated at, the float64 weights with the weights one global-batch
mean a step gives from the samples trained (plain ``ddp`` shuffles them, the strategy here does not), and the
trainer's settings after it (rank 0, JSON, OUT).

Usage: python hetero_batch_counts.py DEVICES OUT
"""

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_efficient import AutoFit, HeterogeneousDDPStrategy
from lightning_efficient.balance.datasets import READS

LR = 0.1


class Linear(L.LightningModule):
    """A loss linear in the weights, a mean over the step's samples: every step moves the weights by its global batch's
    mean input, so the weights after a fit are known from the samples trained, however a rank's share is split."""

    def __init__(self, fail: bool = False, holds: int | None = None, frequency: int | None = None) -> None:
        super().__init__()
        self.holds, self.frequency = holds, frequency
        self.lrs: list[float] = []
        self.weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.samples = 0
        self.input_sum = torch.zeros(2, dtype=torch.float64)
        self.validated_at: list[int] = []
        self.validation_sizes: list[int] = []  # the samples of each validation batch
        self.fail = fail
        self.generator_untouched: bool | None = None

    def on_train_start(self) -> None:
        self.samples, self.input_sum = 0, torch.zeros(2, dtype=torch.float64)  # the fit's, not AutoFit's measuring steps
        self.lrs = []
        dataset = self.trainer.train_dataloader.dataset
        if isinstance(dataset, OwnGenerator):  # nothing drawn from it before the first step, as in plain Lightning
            self.generator_untouched = torch.equal(dataset.generator.get_state(), dataset.initial_state)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def training_step(self, batch, batch_idx):
        if self.fail:
            raise RuntimeError("failed on purpose")
        (x,) = batch
        if self.holds is not None and x.shape[0] > self.holds:  # a device that holds this many samples a micro-step
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} samples' activations")
        self.samples += int(x.shape[0])
        self.input_sum += x.detach().sum(0)
        return (x * self.weight).sum(1).mean()

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated_at.append(self.trainer.global_step)
        self.validation_sizes.append(int(batch[0].shape[0]))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        if self.frequency is None:
            return optimizer
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step", "frequency": self.frequency}}


class Noisy(Dataset):
    """The samples with random noise drawn on each read (an augmentation): two reads of one index differ."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (self.data[index] + 1e-3 * torch.randn(2, dtype=torch.float64),)


class OwnGenerator(Dataset):
    """An augmentation drawn from a seeded generator of the dataset's own (a new user's trial: the datasets' comparison
    read the samples before the fit and moved it, and the fit trained other samples than plain Lightning's)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.generator = data, torch.Generator().manual_seed(123)
        self.initial_state = self.generator.get_state()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (self.data[index] + 1e-3 * torch.randn(2, dtype=torch.float64, generator=self.generator),)


class AgreesByChance(Dataset):
    """A generator of the dataset's own with few outcomes, whose first reads of each sample happened to agree within each
    rank and differ between the ranks (1 fit in 128 for a 50% flip of one sample on 2 ranks): later reads differ."""

    def __init__(self, data: torch.Tensor, rank: int) -> None:
        self.data, self.rank, self.reads = data, rank, [0] * len(data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        self.reads[index] += 1
        return (self.data[index] + (self.rank if self.reads[index] <= READS else self.reads[index] % 2),)


def fit(devices: int, hetero: bool, fail: bool = False, autofit: bool = False, saves_in: str | None = None,
        samples: int = 40, shuffle: bool = False, drop_last: bool = False, strategy_drops_last: bool = False,
        frequency: int | None = None, dataset: Callable | None = None, workers_of_rank: Callable | None = None,
        **settings) -> dict:
    data = torch.randn(samples, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    strategy = HeterogeneousDDPStrategy(max_micro_batch=None if autofit else 2, shuffle=shuffle,
                                        drop_last=strategy_drops_last) if hetero else "ddp"
    planner = AutoFit(budget="4GiB", activation_policies=["keep"], optimizer_options=["32-bit"]) if autofit else None
    callbacks = [planner] if planner else []
    if saves_in is not None:  # every checkpoint kept, named by its epoch and step
        callbacks.append(ModelCheckpoint(dirpath=saves_in, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, num_sanity_val_steps=0,
                        limit_val_batches=1, logger=False, enable_checkpointing=saves_in is not None, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, **settings)
    model = Linear(fail, holds=2 if autofit else None, frequency=frequency)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # (set in the processes Lightning starts)
    loader = DataLoader(TensorDataset(data) if dataset is None else dataset(data, rank, devices), batch_size=4, drop_last=drop_last,
                        num_workers=0 if workers_of_rank is None else workers_of_rank(rank))
    refused = None
    try:
        trainer.fit(model, loader, DataLoader(TensorDataset(data[:4]), batch_size=4))
    except RuntimeError as error:
        assert "failed on purpose" in str(error)
    except (MisconfigurationException, ValueError) as error:
        refused = str(error)
    samples = trainer.strategy.reduce(torch.tensor(float(model.samples)), reduce_op="sum")
    input_sum = trainer.strategy.reduce(model.input_sum, reduce_op="sum")
    saved = sorted(path.name for path in Path(saves_in).iterdir()) if saves_in is not None else None
    frequencies = [config.frequency for config in trainer.lr_scheduler_configs]
    return {"refused": refused, "saved": saved, "steps": trainer.global_step, "lrs": model.lrs, "frequencies": frequencies,
            "samples": int(samples), "validated_at": model.validated_at, "validation_sizes": model.validation_sizes,
            "generator_untouched": model.generator_untouched,
            "weight": model.weight.tolist(), "expected_weight": (1 - LR * input_sum / (4 * devices)).tolist(),
            "after": [trainer.limit_train_batches, trainer.val_check_interval, trainer.accumulate_grad_batches,
                      [callback._save_on_train_epoch_end for callback in trainer.checkpoint_callbacks]]}


if __name__ == "__main__":
    devices = int(sys.argv[1])
    found = {}
    for hetero in (False, True):
        name = "hetero" if hetero else "plain"
        found[name] = {"limited": fit(devices, hetero, limit_train_batches=3, val_check_interval=2),
                       # (the strategy's own shuffling on: Lightning trains the same first batches every epoch)
                       "overfit": fit(devices, hetero, overfit_batches=2, shuffle=True),
                       "fractions": fit(devices, hetero, limit_train_batches=0.5, val_check_interval=0.5),
                       # a fraction of no whole batch (0.05 of 10 or 5), which Lightning refuses
                       "no_whole_batch": fit(devices, hetero, limit_train_batches=0.05),
                       # 36 samples: 9 batches a rank on 1 process, 5 on 2, so the last step holds 1 of the 2 batches
                       "uneven_steps": fit(devices, hetero, samples=36, accumulate_grad_batches=2, val_check_interval=2),
                       "whole_epochs": fit(devices, hetero, samples=36, accumulate_grad_batches=2, limit_train_batches=100),
                       # 38 samples: a short last batch (of 2 on 1 process), which the cap splits into fewer
                       # micro-batches; validation at the epoch's end as plain ddp's (a new user's trial under AutoFit)
                       "short_last_batch": fit(devices, hetero, samples=38, val_check_interval=0.5),
                       "loader_drops_last": fit(devices, hetero, samples=38, accumulate_grad_batches=2, drop_last=True),
                       "failed": fit(devices, hetero, fail=True, limit_train_batches=3, val_check_interval=2),
                       # every batch validated: Lightning's ModelCheckpoint then saves at the epoch's end only
                       "every_batch": fit(devices, hetero, saves_in=tempfile.mkdtemp(), limit_train_batches=3,
                                          val_check_interval=1),
                       # a scheduler stepped every 4 batches (every second step of 2): 9 batches a rank on 1 process
                       "scheduled": fit(devices, hetero, samples=36, accumulate_grad_batches=2, frequency=4),
                       "scheduled_limited": fit(devices, hetero, frequency=3, limit_train_batches=5)}
    # the strategy's own drop_last (whole global batches only) under accumulation 2: 44 samples make the DataLoader 11
    # batches a rank on 1 process (5 on 2), of which whole global batches hold 10 (4): an interval of 11 (5) is beyond
    found["strategy_drops_last"] = fit(devices, True, samples=44, strategy_drops_last=True, accumulate_grad_batches=2,
                                       val_check_interval=11 if devices == 1 else 5)
    # each rank's own part of the data (use_distributed_sampler=False): refused by the strategy, which draws every
    # rank's share from one dataset; the whole dataset on every rank (also drawn with random noise) is taken
    found["own_parts"] = {
        "subsets": fit(devices, True, dataset=lambda data, rank, world: Subset(TensorDataset(data), range(rank, len(data), world)),
                       use_distributed_sampler=False),
        "tensors": fit(devices, True, dataset=lambda data, rank, world: TensorDataset(data[rank::world]), use_distributed_sampler=False),
        "whole": fit(devices, True, use_distributed_sampler=False),
        "noisy": fit(devices, True, dataset=lambda data, rank, world: Noisy(data), use_distributed_sampler=False),
        "noisy_parts": fit(devices, True, dataset=lambda data, rank, world: Noisy(data[rank::world]), use_distributed_sampler=False),
        "agrees_by_chance": fit(devices, True, dataset=lambda data, rank, world: AgreesByChance(data, rank),
                                use_distributed_sampler=False),
        # a DataLoader worker on rank 1 only: rank 0 reads its samples, rank 1 cannot
        "workers_differ": fit(devices, True, workers_of_rank=lambda rank: rank, use_distributed_sampler=False)}
    # a generator of the dataset's own: neither the datasets' comparison nor AutoFit's measuring steps draw from it
    found["own_generator"] = {
        "hetero": fit(devices, True, dataset=lambda data, rank, world: OwnGenerator(data), use_distributed_sampler=False),
        "autofit": fit(devices, True, autofit=True, dataset=lambda data, rank, world: OwnGenerator(data))}
    # AutoFit's caps (the device holds 2 samples a micro-step) in place of max_micro_batch
    found["autofit"] = {"limited": fit(devices, True, autofit=True, limit_train_batches=3, val_check_interval=2)}
    if L.fabric.utilities.rank_zero.rank_zero_only.rank == 0:
        json.dump(found, open(sys.argv[2], "w"))
