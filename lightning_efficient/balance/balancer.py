"""The balancing that ``hetero_ddp`` and ``hetero_fsdp`` share: one :class:`Balancer` a strategy holds.

A :class:`Balancer` owns everything that gives each data-parallel rank a share of every global
batch proportional to its measured speed: the share plan (:mod:`~lightning_efficient.balance.planner`),
the exactly-once batch sampler (:mod:`~lightning_efficient.balance.sampler`), the loss weighting
(by samples or by tokens), the speed measurement and re-balancing, and the micro-batch probe
(:mod:`~lightning_efficient.balance.probe`).
:class:`~lightning_efficient.balance.balanced_strategy.BalancedStrategy` is the mixin that routes a Lightning
strategy's hooks to it; a strategy adds only what differs between DDP and FSDP2 (how gradient sync is switched off,
how compute time is told apart from waiting for other ranks).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_efficient._batch_counts import (
    ResumedStepSaved,
    SchedulerFrequencies,
    batch_settings,
    checkpoint_timing_kept,
    counted_batches,
    counts_in_micro_batches,
)
from lightning_efficient._distributed import (
    WaitMarks,
    collectives_marked_as_waits,
    gather_or_raise_together,
)
from lightning_efficient._samples import batch_samples
from lightning_efficient._torch import DeviceClock
from lightning_efficient._validation import SettingRefused, require, require_bool, require_int
from lightning_efficient.balance.datasets import check_same_dataset
from lightning_efficient.balance.evaluation import EvaluationCounts, capped_evaluation_loader
from lightning_efficient.balance.planner import SharePlan, held_from_weights, plan_shares
from lightning_efficient.balance.probe import probe_micro_batch
from lightning_efficient.balance.sampler import HeterogeneousBatchSampler
from lightning_efficient.balance.speed import MicroStepTimes, equal_time_weights, predicted_step_time
from lightning_efficient.resumable import EpochShuffleSampler, load_pending_position
from lightning_efficient.tokens.normalize import StepTokenNormaliser, loss_weighted
from lightning_efficient.tokens.output import NormalisedTokenLoss, loss_sum_and_count

_MAX_UNREAD = 8  # micro-steps whose marks may wait to be read before the oldest is read anyway

#: the stages whose DataLoaders run at the least micro-batch cap (predict's outputs come a batch at a time, as the user
#: batched them: not capped)
_CAPPED_EVALUATION = (RunningStage.SANITY_CHECKING, RunningStage.VALIDATING, RunningStage.TESTING)
_NOT_BUILT = object()

SETTINGS = ("global_batch_size", "shares", "max_micro_batch", "rebalance_every", "warmup_steps", "hysteresis",
            "ema_decay", "seed", "shuffle", "drop_last")


def speed_reading(local_speed: float | None) -> float:
    """What a rank contributes to the speed all-gather: its measured speed, or NaN before its first
    reading (never a made-up speed: 1 sample/s would hand nearly the whole batch to the other ranks)."""
    return math.nan if local_speed is None else float(local_speed)


def all_measured(speeds: list[float]) -> bool:
    """Whether every rank's gathered speed is a reading (finite and positive), so that a plan may follow them."""
    return all(math.isfinite(v) and v > 0 for v in speeds)


@dataclass
class _TimedMicroStep:
    """Device-timeline marks of one micro-step, read once the device has passed them."""

    start: object
    forward_end: object
    backward_start: object | None
    samples: int
    waits: list[tuple[object, object]] = field(default_factory=list)
    last_gradient: object | None = None
    backward_waits: list[tuple[object, object]] = field(default_factory=list)  # collectives within the backward

    def ready(self) -> bool:
        """Whether the device has reached the last marks (always, off CUDA): reading them will not wait (a wait in
        the backward may end after the last gradient)."""
        last = self.last_gradient if self.last_gradient is not None else self.forward_end
        marks = [last, *(end for _, end in self.backward_waits)]
        return all(getattr(mark, "query", None) is None or bool(mark.query()) for mark in marks)


class _BalancedLoader(DataLoader):
    """The training DataLoader a balanced strategy installs: its state is the balancer's data state
    (sampler position trained, not prefetched, and measured speeds), and each iteration starts the
    trainer's epoch — Lightning calls ``set_epoch`` on ``loader.sampler`` and
    ``loader.batch_sampler.sampler`` only, never on a batch sampler."""

    def __init__(self, *args: Any, balancer: Balancer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.balancer = balancer

    def __iter__(self) -> Any:
        self.batch_sampler.set_epoch(self.balancer.training_epoch)
        # an iterator made again within an epoch (Lightning makes one when it sets the data up and another as the epoch
        # starts) starts at what was trained: the one before handed prefetching workers batches ahead (with workers and
        # reload_dataloaders_every_n_epochs, every epoch after the first skipped its first batches)
        self.batch_sampler.next_batch, self.batch_sampler.skip_micro = self.balancer.trained_position()
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        """The balancer's data state (:meth:`Balancer.data_state_dict`)."""
        return self.balancer.data_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the balancer's data state (:meth:`Balancer.load_data_state_dict`)."""
        self.balancer.load_data_state_dict(state)


def _users_sampler(dataloader: DataLoader) -> tuple[Sampler | None, bool]:
    """The sampler the user gave the training DataLoader (None: an order of the whole dataset Lightning or torch made,
    sequential or shuffled), seen through the ``DistributedSampler`` Lightning puts around it, and whether Lightning
    did (then it is the user's order of the whole dataset, which Lightning splits over the ranks)."""
    sampler = dataloader.sampler
    wrapped = isinstance(sampler, DistributedSamplerWrapper)
    if wrapped:  # Lightning's around a sampler of the user's
        sampler = sampler.dataset._sampler
    elif isinstance(sampler, DistributedSampler):
        # Lightning's for a sequential or shuffled order (or the user's, alike); a subclass or one over other data is
        # the user's own (a new user's trial: one over a Subset was replaced silently)
        if type(sampler) is DistributedSampler and len(sampler.dataset) == len(dataloader.dataset):
            return None, False
        return sampler, False
    if isinstance(sampler, SequentialSampler | EpochShuffleSampler):
        return None, wrapped
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(dataloader.dataset):
        return None, wrapped
    return sampler, wrapped


def _check_users_sampler(name: str, dataloader: DataLoader, world: int) -> None:
    """Refuse a training DataLoader's sampler that the strategy's own order would silently replace by other samples
    (a subset, weights, another length: a new user's trial trained indices their sampler excluded), and say where
    one of the whole dataset, or of a rank's part of it (``use_distributed_sampler=False`` with a sampler of one's
    own), or a batch sampler of one's own, is replaced (its order, a bucketing by length, is not kept). Neither is
    iterated (an endless one would never end, and a draw would move its random state)."""
    sampler, wrapped = _users_sampler(dataloader)
    batch_sampler = dataloader.batch_sampler
    if sampler is None and type(batch_sampler) is BatchSampler:
        return
    samples = len(dataloader.dataset)
    if sampler is not None:
        try:
            drawn = len(sampler)
        except TypeError:
            drawn = None
        whole = (samples,) if wrapped else (samples, samples // world, -(-samples // world))  # (the dataset, or a rank's part)
        if isinstance(sampler, SubsetRandomSampler | WeightedRandomSampler) or drawn not in whole:
            raise ValueError(
                f"{name} draws each step's samples from its own permutation of the whole training dataset ({samples} "
                f"samples), so the DataLoader's {type(sampler).__name__} (drawing "
                f"{drawn if drawn is not None else 'an unknown number of'} samples) would be ignored and other samples "
                "trained. Give the DataLoader the samples to train as its dataset (a torch.utils.data.Subset for a subset) "
                "with a plain or shuffled order, or keep your sampler under strategy='ddp' (ModelParallelStrategy for a sharded model)")
    given = type(sampler).__name__ if sampler is not None else type(batch_sampler).__name__
    rank_zero_warn(f"{name}: the training DataLoader's {given} is replaced by the strategy's own permutation of the "
                   f"{samples} samples over the ranks each epoch (seed + epoch; shuffle=False keeps the dataset's order): "
                   "its order is not kept")


class Balancer:
    """Speed-proportional shares of every global batch over the data-parallel ranks of a strategy.

    The arguments are those of :class:`~lightning_efficient.HeterogeneousDDPStrategy` (validated
    here, with the same messages for both strategies).

    Args:
        name: the strategy's registered name, used in messages (``"hetero_ddp"``, ``"hetero_fsdp"``).
        global_batch_size: samples per optimizer step over all data-parallel ranks (None: the
            DataLoader's batch size x ranks x ``accumulate_grad_batches``).
        shares: ``"auto"`` (measured) or fixed positive weights, one per rank.
        max_micro_batch: the largest micro-batch per rank (int, list of ints or None per rank, ``"auto"`` or None).
        rebalance_every: optimizer steps between re-plans (>= 1).
        warmup_steps: steps measured before the first plan (>= 1).
        hysteresis: the least predicted gain (fraction of step time) that changes the shares.
        ema_decay: weight of the previous speed estimate in the moving average, in [0, 1).
        seed: seed of the per-epoch sample order.
        shuffle: shuffle the training samples each epoch.
        drop_last: drop the last incomplete global batch.

    Raises:
        ValueError: naming the argument for an invalid setting.
    """

    def __init__(
        self,
        name: str,
        global_batch_size: int | None = None,
        shares: Literal["auto"] | list[float] = "auto",
        max_micro_batch: int | list[int | None] | Literal["auto"] | None = None,
        rebalance_every: int = 50,
        warmup_steps: int = 10,
        hysteresis: float = 0.05,
        ema_decay: float = 0.7,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if global_batch_size is not None:
            require_int("global_batch_size", global_batch_size, 1)
        if shares != "auto":
            numbers = isinstance(shares, (list, tuple)) and all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in shares)
            require(numbers and len(shares) > 0 and all(s > 0 and math.isfinite(s) for s in shares), "shares", shares,
                    "'auto' or positive finite weights, one per rank (a rank with share 0 would leave the others waiting for it)")
        if isinstance(max_micro_batch, str):
            require(max_micro_batch == "auto", "max_micro_batch", max_micro_batch,
                    "an int, a list of ints or None (one per rank), 'auto' or None")
        elif isinstance(max_micro_batch, (list, tuple)):
            require(all(c is None or (isinstance(c, int) and not isinstance(c, bool) and c >= 1) for c in max_micro_batch),
                    "max_micro_batch", max_micro_batch, "an int, a list of ints >= 1 or None (one per rank, None: no cap), 'auto' or None")
            max_micro_batch = list(max_micro_batch)
        elif max_micro_batch is not None:
            require(isinstance(max_micro_batch, int) and not isinstance(max_micro_batch, bool) and max_micro_batch >= 1,
                    "max_micro_batch", max_micro_batch, "an int >= 1, a list of ints or None (one per rank), 'auto' or None")
        require_int("seed", seed, 0)
        require_bool("shuffle", shuffle)
        require_bool("drop_last", drop_last)
        require_int("rebalance_every", rebalance_every, 1)
        require_int("warmup_steps", warmup_steps, 1)
        require(0.0 <= hysteresis < 1.0, "hysteresis", hysteresis, "a fraction in [0, 1)")
        require(0.0 <= ema_decay < 1.0, "ema_decay", ema_decay, "a number in [0, 1)")
        self.name = name
        self.global_batch_size = global_batch_size
        self.shares = shares
        self.max_micro_batch = max_micro_batch
        self.rebalance_every = rebalance_every
        self.warmup_steps = warmup_steps
        self.hysteresis = hysteresis
        self.ema_decay = ema_decay
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.strategy: Any = None
        self.sampler: HeterogeneousBatchSampler | None = None
        self.plan: SharePlan | None = None
        self.micro_done = 0
        self.speeds: list[float] = []
        self.local_speed: float | None = None
        self.micro_step_times = MicroStepTimes()  # fixed + per-sample cost, fitted per micro-batch size
        self.last_planned_step = -1
        self.lookahead = 2
        self.counter_epoch = 0
        self.probed_caps: list[int | None] | None = None
        self.token_normaliser = StepTokenNormaliser()  # token-weighted steps (TokenLosses without the callback)
        self._warned_manual = False
        self._warned_sample_count = False
        # timing: device-timeline marks of the micro-step being timed, read at the next one (no sync a micro-step)
        self.clock: DeviceClock | None = None
        self.time_backward = True  # forward + backward to the last gradient hook (DDP); False: forward only (FSDP2)
        self._timed: _TimedMicroStep | None = None  # the micro-step whose backward is running
        self._unread: deque[_TimedMicroStep] = deque()  # finished micro-steps, read once the device passed them
        self._open_waits: list[tuple[object, object]] | None = None  # where a wait goes while a forward/backward is timed
        # this rank's samples in the micro-batch while its training_step runs (a mean logged with sync_dist weighs them)
        self.logging_samples: int | None = None
        self._wait_start: object | None = None
        self._wait_depth = 0  # waits open (nested: a collective within FSDP2's all-gather hooks)
        self._hooks: list = []
        self._user_accumulation: tuple[Any, int] | None = None  # (trainer, its accumulate_grad_batches before the plan)
        self._user_batch_settings: dict[str, Any] = {}  # its limit_train_batches / val_check_interval, the same
        self._checkpoint_timing: list[tuple[Any, str, Any]] = []  # ModelCheckpoint settings to put back after the fit
        self.scheduler_frequencies = SchedulerFrequencies()  # interval="step" schedulers step after the user's steps
        self.resumed_step_saved = ResumedStepSaved()  # no ModelCheckpoint saves the resumed step again mid-step
        self.probe_refusal: str | None = None  # what max_micro_batch="auto" is refused with (None: allowed)
        self._evaluation_cap_built: Any = _NOT_BUILT  # the cap the last validation or test DataLoader was built at
        self.evaluation_counts = EvaluationCounts()  # Lightning's evaluation counts in chunks while a capped loader runs

    def set_setting(self, name: str, value: Any) -> None:
        """Change one constructor setting (one of :data:`SETTINGS`), validated as the constructor does;
        it takes effect at the next plan (``shares``, ``global_batch_size``, ``max_micro_batch``, the
        sampler settings: the next fit) or step (the re-balancing settings)."""
        if name not in SETTINGS:
            raise ValueError(f"{self.name}: {name!r} is not a setting; expected one of {', '.join(SETTINGS)}")
        settings = {key: getattr(self, key) for key in SETTINGS}
        settings[name] = value
        if name == "max_micro_batch" and value == "auto" and self.probe_refusal is not None:
            require(False, "max_micro_batch", value, self.probe_refusal)
        checked = Balancer(self.name, **settings)  # raises ValueError naming the argument
        setattr(self, name, getattr(checked, name))

    # -- what the strategy provides -------------------------------------------------------------
    def bind(self, strategy: Any) -> None:
        """Serve ``strategy`` (a :class:`BalancedStrategy`)."""
        self.strategy = strategy

    @property
    def world(self) -> int:
        """The number of data-parallel ranks the global batch is shared among."""
        return int(self.strategy.distributed_sampler_kwargs["num_replicas"])

    @property
    def rank(self) -> int:
        """This process's data-parallel rank."""
        return int(self.strategy.distributed_sampler_kwargs["rank"])

    # -- the plan -------------------------------------------------------------------------------
    def caps(self) -> list[int | None]:
        """Each rank's largest micro-batch in force (None: no cap)."""
        world = self.world
        if self.max_micro_batch == "auto":
            return list(self.probed_caps) if self.probed_caps else [None] * world
        if self.max_micro_batch is None:
            return [None] * world
        if isinstance(self.max_micro_batch, int):
            return [self.max_micro_batch] * world
        self.check_per_rank_settings(world)
        return list(self.max_micro_batch)

    def check_per_rank_settings(self, world: int) -> None:
        """Refuse ``shares`` or ``max_micro_batch`` lists that do not hold one entry per rank of ``world``.

        Raises:
            ValueError: naming the setting, its value and the number of ranks.
        """
        for name, value in (("shares", self.shares), ("max_micro_batch", self.max_micro_batch)):
            if isinstance(value, (list, tuple)) and len(value) != world:
                raise SettingRefused(f"{self.name}: {name}={list(value)} has {len(value)} {'entry' if len(value) == 1 else 'entries'} for {world} "
                                     f"rank{'' if world == 1 else 's'}: give one per rank")

    def initial_weights(self) -> list[float]:
        """The shares the first plan follows (equal under ``"auto"``)."""
        if self.shares == "auto":
            return [1.0] * self.world
        self.check_per_rank_settings(self.world)
        return [float(s) for s in self.shares]

    def process_dataloader(self, dataloader: object) -> object | None:
        """The balanced training DataLoader replacing ``dataloader``, or a validation or test DataLoader batched at the
        least cap (:meth:`evaluation_batch_cap`); None: left to the strategy as it is."""
        trainer = self.strategy.lightning_module.trainer
        if trainer.state.stage in _CAPPED_EVALUATION:
            return self._capped_evaluation_loader(dataloader, trainer)
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return None
        name = self.name
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError(f"{name} slices a map-style dataset by index; an IterableDataset cannot be split by shares")
        if dataloader.batch_sampler is None:
            raise ValueError(
                f"{name}: the training DataLoader has batch_size=None (no batching: each dataset item is handed "
                f"over as it is), but {name} builds every rank's batches from single samples by their shares. Give "
                "the DataLoader a batch_size (the global batch is batch_size x ranks x accumulate_grad_batches "
                "unless global_batch_size is set) over a dataset of single samples"
            )
        world = self.world
        _check_users_sampler(name, dataloader, world)
        check_same_dataset(name, dataloader, world, distributed_sampler=trainer._accelerator_connector.use_distributed_sampler)
        if self.global_batch_size is None and dataloader.batch_size is None:
            raise ValueError(
                f"{name}: the training DataLoader has a batch_sampler and no batch_size, so the global batch is "
                f"unknown: set {type(self.strategy).__name__}(global_batch_size=...) ({name} replaces the batch sampler)"
            )
        # the accumulation the user set, read before this fit changed it (a DataLoader reloaded mid-fit must not read
        # the plan's own), and put back when the fit ends (a second fit with this Trainer trains the same global batch)
        if self._user_accumulation is None or self._user_accumulation[0] is not trainer:
            self._user_accumulation = (trainer, trainer.accumulate_grad_batches)
            self._user_batch_settings = batch_settings(trainer)
        requested = self.requested_accumulation(trainer)
        # by default a step trains what it would under plain data parallelism: a DataLoader batch per rank and micro-batch
        global_batch = self.global_batch_size or dataloader.batch_size * world * requested
        if self.max_micro_batch == "auto" and self.probed_caps is None:
            self.probed_caps = self._probe_caps(dataloader, global_batch)
        # the accumulation set is the fewest micro-batches a step runs: more where the caps (max_micro_batch, AutoFit's
        # or the probe's) hold a share
        world_most = global_batch // world
        if 1 <= world_most < requested:  # (a global batch smaller than the ranks: plan_shares says so)
            raise ValueError(
                f"{name}: accumulate_grad_batches={requested} micro-batches a step, but the global batch of {global_batch} "
                f"gives each of {world} rank(s) at most {world_most} (every rank needs a sample in every micro-batch): "
                f"set accumulate_grad_batches <= {world_most} or a larger global_batch_size"
            )
        self.plan = plan_shares(global_batch, self.initial_weights(), self.caps(), least_accumulation=requested)
        if self.plan.accumulation != requested:
            if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
                raise ValueError(
                    f"{name}: the caps (max_micro_batch, AutoFit's or the probe's) take {self.plan.accumulation} "
                    f"micro-batches a step for the global batch of {global_batch}, but a GradientAccumulationScheduler "
                    "sets the accumulation itself (over whole global batches): drop the scheduler, or the caps"
                )
            rank_zero_info(f"{name}: {self.plan.accumulation} micro-batches per step to respect max_micro_batch")
        # always: a loader built earlier in this fit (estimated_stepping_batches in configure_optimizers) may have set
        # another accumulation, under caps since changed (AutoFit's)
        trainer.accumulate_grad_batches = self.plan.accumulation
        self.speeds = [1.0] * world if not self.speeds else self.speeds
        # the DataLoader's own drop_last: plain DDP's last incomplete batches dropped (the whole ones before them train)
        drop_last = self.drop_last or bool(dataloader.drop_last)
        # overfit_batches: Lightning trains the same first batches every epoch (a sequential sampler), and so does this
        shuffle = self.shuffle and not trainer.overfit_batches
        self.sampler = HeterogeneousBatchSampler(
            len(dataloader.dataset), global_batch, self.rank, self.plan, self.seed, shuffle, self.drop_last, name,
            batches_per_step=requested, drop_last_batch=bool(dataloader.drop_last),
        )
        # a sampler made now starts its epoch's first batch, and so does the count of micro-batches trained (a
        # checkpoint's position loads later): a LearningRateFinder callback's trial steps, run in the fit before the
        # DataLoader is built again, left theirs, and the epoch after it stopped that many micro-batches early
        self.forget_position(trainer.current_epoch)
        self._count_micro_batches(trainer, requested, len(dataloader.dataset), drop_last)
        workers = dataloader.num_workers
        self.lookahead = 2 + math.ceil(workers * (dataloader.prefetch_factor or 0) / self.plan.accumulation)
        rank_zero_info(f"{name}: global batch {global_batch}, shares {list(self.plan.shares)}"
                       + held_from_weights(self.plan, self.initial_weights(), self.caps(),
                                           "equal shares (no speed measured yet)" if self.shares == "auto" else "your shares"))
        # the user's prefetching with workers (a review: the default's 2 where the user set 1 fetched global batches
        # beyond the lookahead, sliced by shares a re-plan then changed), timeout and worker start method
        with_workers = {"prefetch_factor": dataloader.prefetch_factor, "timeout": dataloader.timeout,
                        "multiprocessing_context": dataloader.multiprocessing_context} if workers else {}
        return _BalancedLoader(
            dataloader.dataset,
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            worker_init_fn=dataloader.worker_init_fn,
            persistent_workers=dataloader.persistent_workers if workers else False,
            **with_workers,
            balancer=self,
        )

    def evaluation_batch_cap(self) -> int | None:
        """The batch a validation or test DataLoader runs at on every rank: the least micro-batch cap in force (None: no
        cap). The least, not each rank's own: the ranks then run as many evaluation batches each, as FSDP2's
        all-gathers in every forward (and a user's ``sync_dist`` logged every step) need."""
        caps = [cap for cap in self.caps() if cap is not None]
        return min(caps) if caps else None

    def _capped_evaluation_loader(self, dataloader: object, trainer: Any) -> DataLoader | None:
        """``dataloader`` (validation or test) with each batch split into chunks of at most :meth:`evaluation_batch_cap`
        samples, Lightning's evaluation counts counting those chunks (:mod:`~lightning_efficient.balance.evaluation`);
        None: left as it is."""
        cap = self._evaluation_cap_built = self.evaluation_batch_cap()
        loader, chunked = capped_evaluation_loader(dataloader, cap) or (None, None)
        self.evaluation_counts.loader_processed(trainer, trainer.state.stage, chunked)
        return loader

    def build_evaluation_loaders_again_if_the_cap_changed(self, trainer: Any) -> None:
        """Where the least cap changed since the fit's validation DataLoader was built (the probe's caps, a plan of
        AutoFit's made again), have Lightning build it again before the next validation."""
        if self._evaluation_cap_built is not _NOT_BUILT and self.evaluation_batch_cap() != self._evaluation_cap_built:
            trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
            self._evaluation_cap_built = _NOT_BUILT
            self.evaluation_counts.setup_ran()

    def _count_micro_batches(self, trainer: Any, requested: int, samples: int, drop_last: bool) -> None:
        """Lightning's counts of training batches (:mod:`lightning_efficient._batch_counts`) counted the user's
        batches, ``requested`` of them a step: where the caps give a step more micro-batches, they count those, so a
        fit trains the same samples between the same checks as under plain data parallelism."""
        self._put_back_checkpoint_timing()
        self.scheduler_frequencies.put_back()
        settings = self._user_batch_settings
        for name, value in settings.items():  # the user's, unless counted again below (a plan without more micro-batches)
            setattr(trainer, name, value)
        accumulation = self.plan.accumulation
        if accumulation == requested:
            return
        # the user's batches in a rank's epoch under plain data parallelism (DistributedSampler pads to the ranks)
        per_rank = -(-samples // self.world)
        per_batch = Fraction(self.sampler.global_batch, self.world * requested)
        if self.drop_last:  # the strategy's own: whole global batches only (a review)
            batches = samples // self.sampler.global_batch * requested
        elif drop_last:  # the DataLoader's: whole DataLoader batches
            batches = int(per_rank // per_batch)
        else:
            batches = math.ceil(per_rank / per_batch)
        counts = counted_batches(settings, batches)
        self.scheduler_frequencies.count(accumulation, requested, counts, batches)
        counted = counts_in_micro_batches(trainer, counts, Fraction(accumulation, requested), epoch=(batches, len(self.sampler)),
                                          who=self.name, batch_words=f"batches ({requested} a step)",
                                          micro_words=f"micro-batches ({accumulation} a step under the caps)")
        if counted:
            said = ", ".join(f"{key}={settings[key]}" for key in counted)
            rank_zero_info(f"{self.name}: {said} of your batches count {', '.join(map(str, counted.values()))} micro-batches "
                           "while the fit runs")
        for name, value in counted.items():
            setattr(trainer, name, value)
        self._checkpoint_timing = checkpoint_timing_kept(trainer, settings, counted)

    def _put_back_checkpoint_timing(self) -> None:
        for callback, attribute, value in self._checkpoint_timing:
            setattr(callback, attribute, value)
        self._checkpoint_timing = []

    def _probe_caps(self, dataloader: DataLoader, global_batch: int) -> list[int | None]:
        """Each rank's largest micro-batch up to the global batch that trains without running out of
        memory, less the probe's safety margin (:func:`~lightning_efficient.balance.probe.probe_micro_batch`),
        all-gathered."""
        mine, failure = None, None
        try:
            mine = probe_micro_batch(self.strategy, dataloader, global_batch)
        except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together
            failure = error
        caps = gather_or_raise_together(mine, failure, f"{self.name}: max_micro_batch='auto' could not probe")
        rank_zero_info(f"{self.name}: probed max_micro_batch per rank: {caps}")
        return caps

    # -- one step -------------------------------------------------------------------------------
    def training_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``step(*args, **kwargs)`` (the strategy's own ``training_step``) timed, and scale its loss."""
        if self.sampler is None:
            return step(*args, **kwargs)
        accumulation = self.plan.accumulation
        epoch = self.strategy.lightning_module.trainer.current_epoch
        if epoch != self.counter_epoch:  # a new epoch: positions count from its start
            self.counter_epoch, self.micro_done = epoch, 0
        if self.micro_done % accumulation == 0:
            self._maybe_rebalance()
        samples = self._micro_batch_samples(args[0] if args else kwargs.get("batch"))
        self._finish_timing()
        clock = self._clock()
        waits: list[tuple[object, object]] = []
        self._open_waits, self._wait_start, self._wait_depth = waits, None, 0
        self.logging_samples = samples
        start = clock.mark()
        try:
            with collectives_marked_as_waits():  # a metric synced in the step waits for the slowest rank there
                output = step(*args, **kwargs)
        finally:
            self._open_waits = None
            self.logging_samples = None
        forward_end = clock.mark()
        self.micro_done += 1
        scaled = self._scaled(output, samples)  # may all-reduce: not part of the timing
        backward_start = clock.mark() if self.time_backward else None
        self._timed = _TimedMicroStep(start, forward_end, backward_start, samples, waits)
        return scaled

    @contextlib.contextmanager
    def backward_waits_marked(self) -> Iterator[None]:
        """Around the timed micro-step's backward: the collectives it calls through ``torch.distributed``
        (SyncBatchNorm's all-reduce of the statistics' gradients) are waits, left out of its compute time."""
        timed = self._timed
        if self._open_waits is not None:  # manual optimization: a backward within the timed step, its waits the step's
            with collectives_marked_as_waits(any_thread=True):
                yield
            return
        if not self.time_backward or timed is None or timed.backward_start is None:
            yield
            return
        self._open_waits, self._wait_start, self._wait_depth = timed.backward_waits, None, 0
        try:
            with collectives_marked_as_waits(any_thread=True):  # (on CUDA the backward runs on autograd's threads)
                yield
        finally:
            self._open_waits = None

    def _micro_batch_samples(self, batch: Any) -> int:
        """This rank's samples in the micro-batch about to train: the size the plan gives it (the sampler slices each
        micro-batch by the plan), checked against the batch's own count (:func:`~lightning_efficient._samples.batch_samples`;
        a new user's trial: a dataclass batch, a ``BatchEncoding`` or a 0-d value first was counted as one sample, and
        every rank's loss weighed by it, silently). Where they differ (a collate function that drops samples, a batch
        whose first tensor is not per sample), the plan's is used and a warning says so, once."""
        accumulation = self.plan.accumulation
        planned = self.sampler.step_plan(self.micro_done // accumulation).micro_batches(self.sampler.rank)
        samples = planned[min(self.micro_done % accumulation, len(planned) - 1)]
        counted = None if self._warned_sample_count else batch_samples(batch)  # (read until a warning was given)
        if counted not in (None, samples):
            warnings.warn(f"{self.name}: rank {self.sampler.rank}'s micro-batch holds {samples} samples by the plan, but "
                          f"its first tensor's leading dimension is {counted}; each rank's loss is weighed by the plan's "
                          "count (a collate function that drops or adds samples would weigh them otherwise)", stacklevel=2)
            self._warned_sample_count = True
        return samples

    def _clock(self) -> DeviceClock:
        device = self.strategy.root_device
        if self.clock is None or self.clock.device != device:
            self.clock = DeviceClock(device)
        return self.clock

    def gradient_accumulated(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: mark the latest gradient of the micro-step (read at the next).

        Every parameter's hook moves the same mark: off CUDA a ``time.perf_counter()`` reading; on
        CUDA one event per micro-step, created at its first gradient and re-recorded at each later one
        (no new event object per parameter)."""
        timed = self._timed
        if not self.time_backward or timed is None:
            return
        clock = self._clock()
        if not clock.on_cuda or timed.last_gradient is None:
            timed.last_gradient = clock.mark()
        else:
            timed.last_gradient.record(torch.cuda.current_stream(clock.device))

    def wait_started(self, *args: Any) -> None:
        """Forward pre-hook run before a module's own collective wait (FSDP2's all-gather), or the start of a
        collective within the step or its backward. Waits nest (a collective within FSDP2's hooks): the outermost is
        timed."""
        if self._open_waits is not None:
            self._wait_depth += 1
            if self._wait_depth == 1:
                self._wait_start = self._clock().mark()

    def wait_ended(self, *args: Any) -> None:
        """Forward pre-hook run after that wait: the interval is left out of the compute time."""
        if self._open_waits is not None and self._wait_depth > 0:
            self._wait_depth -= 1
            if self._wait_depth == 0 and self._wait_start is not None:
                self._open_waits.append((self._wait_start, self._clock().mark()))
                self._wait_start = None

    def add_hooks(self, handles: list) -> None:
        """Hooks to remove at teardown (timing hooks a strategy registers)."""
        self._hooks.extend(handles)

    def forget_position(self, epoch: int) -> None:
        """Count the position in the epoch from a fit's start, in ``epoch`` (a checkpoint's is loaded later): an
        earlier fit of the same epoch that raised, or ``Tuner.lr_find``'s steps, left theirs, which scaled the losses by
        a batch past the epoch's end and put a checkpoint's position ahead of what was trained."""
        self.micro_done, self.counter_epoch = 0, epoch

    def setup(self) -> None:
        """After the strategy's setup: forget a failed fit's counts and hook the gradients for timing."""
        self.token_normaliser.reset()  # a fit that raised mid-step must not leak its counts into this one
        self.remove_hooks()
        self._timed, self._unread = None, deque()
        self.micro_step_times.reset()
        # a plugin's collectives within the step (SelectiveTokenLoss's gather of scores) are waits, not compute
        self._hooks = [WaitMarks(self.wait_started, self.wait_ended)]
        if self.time_backward:
            self._hooks += [
                p.register_post_accumulate_grad_hook(self.gradient_accumulated)
                for p in self.strategy.lightning_module.parameters()
                if p.requires_grad
            ]

    def requested_accumulation(self, trainer: Any) -> int:
        """The ``accumulate_grad_batches`` the user set on ``trainer``: read before this fit's plan changed it (a
        DataLoader built again mid-fit, or AutoFit reading the global batch, must not read the plan's own)."""
        if self._user_accumulation is not None and self._user_accumulation[0] is trainer:
            return self._user_accumulation[1]
        return trainer.accumulate_grad_batches

    def restore_trainer(self) -> None:
        """Put back the ``accumulate_grad_batches`` and the batch counts the user set, where the plan changed them
        (at the fit's end, or its failure), and the evaluation counts the user set (after validate and test too)."""
        self.evaluation_counts.put_back()
        if self._user_accumulation is not None:
            trainer, accumulation = self._user_accumulation
            trainer.accumulate_grad_batches = accumulation
            for name, value in self._user_batch_settings.items():
                setattr(trainer, name, value)
            self._put_back_checkpoint_timing()
            self.scheduler_frequencies.put_back()
            self._user_accumulation = None
            self._user_batch_settings = {}

    def remove_hooks(self) -> None:
        """Remove every timing hook."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _finish_timing(self) -> None:
        """Turn finished micro-steps' compute time into speeds: the forward (less the waits for other
        ranks a strategy marked) and, when timed, the backward up to its last gradient (leaving out the
        loss all-reduce and DDP's final wait). A micro-step is read only once the device has passed its
        last mark (a CUDA event query, which does not wait), so timing never stalls the host on the
        device; at most :data:`_MAX_UNREAD` wait to be read."""
        if self._timed is not None:
            self._unread.append(self._timed)
            self._timed = None
        while self._unread and (self._unread[0].ready() or len(self._unread) > _MAX_UNREAD):
            self._read(self._unread.popleft())

    def _read(self, timed: _TimedMicroStep) -> None:
        clock = self._clock()
        forward = clock.seconds(timed.start, timed.forward_end) - sum(clock.seconds(a, b) for a, b in timed.waits)
        backward = 0.0
        if timed.backward_start is not None and timed.last_gradient is not None:
            last = timed.last_gradient  # (a wait past the last gradient is outside the timed backward)
            backward = clock.seconds(timed.backward_start, last) - sum(
                max(0.0, min(clock.seconds(a, b), clock.seconds(a, last))) for a, b in timed.backward_waits)
        self._observe(timed.samples / max(max(forward, 0.0) + max(backward, 0.0), 1e-9))
        self.micro_step_times.observe(timed.samples, max(forward, 0.0) + max(backward, 0.0))

    def _observe(self, speed: float) -> None:
        previous = self.local_speed
        self.local_speed = speed if previous is None else self.ema_decay * previous + (1 - self.ema_decay) * speed

    def _scaled(self, output: Any, samples: int) -> Any:
        """Scale the local loss so that the step's gradient is the mean over the whole global batch,
        however its samples are split among ranks and micro-batches.

        Lightning divides each micro-batch's loss by the accumulation ``A``, and DDP's all-reduce and
        FSDP2's reduce-scatter both average over the ``W`` data-parallel ranks. By samples, each
        micro-batch loss (a mean over its samples) is multiplied by ``samples * W * A / global_batch``
        (an epoch's short last batch: its own size) — the plan fixes every size, so no communication. By tokens (a :class:`~lightning_efficient.TokenLosses`
        or :class:`~lightning_efficient.FusedTokenLoss` output; any other dict is weighted by samples),
        the global token count of the step is only known after its last micro-batch:
        :class:`~lightning_efficient.tokens.normalize.StepTokenNormaliser` weights each micro-batch's
        token *sum* by ``W * A / K`` and the gradients by ``K / count`` once the step's last backward is
        done (:meth:`normalise_gradients`), with one all-reduce a step. A
        :class:`~lightning_efficient.tokens.output.NormalisedTokenLoss` (``SelectiveTokenLoss``'s
        output) is already weighted so by the callback and is left as it is. The weighted loss's value is the
        micro-batch's own (:func:`~lightning_efficient.tokens.normalize.shown_as`), as a plain fit hands it on.
        """
        if not self.strategy.lightning_module.automatic_optimization:
            if not self._warned_manual:
                rank_zero_warn(f"{self.name}: manual optimization: losses are not re-weighted; scale each rank's loss "
                               "by its share of the global batch yourself (strategy.current_shares).")
                self._warned_manual = True
            return output
        if isinstance(output, NormalisedTokenLoss):  # SelectiveTokenLoss's normaliser weights it for the step
            return output
        found = loss_sum_and_count(output) if isinstance(output, Mapping) and "loss" in output else None
        if found is not None:
            return {**output, "loss": self._token_weighted(*found, shown=output["loss"])}
        step_samples = self.sampler.step_samples((self.micro_done - 1) // self.plan.accumulation)  # (this micro-step's)
        return loss_weighted(output, samples * self.world * self.plan.accumulation / step_samples)

    def _token_weighted(self, local_sum: Tensor, count: Tensor, shown: Tensor) -> Tensor:
        """This micro-batch's token-loss sum, scaled by ``W * A / K`` (see :meth:`_scaled`), showing ``shown``."""
        # what Lightning divides by: a GradientAccumulationScheduler's (over whole global batches), else the plan's
        accumulation = self.strategy.lightning_module.trainer.accumulate_grad_batches
        return self.token_normaliser.micro_batch_loss(local_sum, count, accumulation, shown=shown)

    def normalise_gradients(self, optimizer: Any) -> None:
        """Divide token-weighted gradients by the step's global token count (after its last backward)."""
        self.token_normaliser.normalise_gradients(optimizer)

    def _maybe_rebalance(self) -> None:
        module = self.strategy.lightning_module
        step = module.trainer.global_step
        due = step >= self.warmup_steps and (step - self.warmup_steps) % self.rebalance_every == 0
        if self.shares != "auto" or not due or step == self.last_planned_step:
            return
        self.last_planned_step = step
        mine = torch.tensor([speed_reading(self.local_speed)], dtype=torch.float64, device=self.strategy.root_device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        speeds = [float(g) for g in gathered]
        if not all_measured(speeds):  # a rank without a reading yet: keep the shares until every rank has one
            rank_zero_info(f"{self.name}: step {step}: no speed measured yet on rank(s) "
                           f"{[r for r, v in enumerate(speeds) if not math.isfinite(v)]}; shares unchanged")
            return
        self.speeds = speeds
        current = self.sampler.plan_at(self.micro_done // self.plan.accumulation)
        candidate, gain = self._candidate(current)
        times = [s / v for s, v in zip(current.shares, self.speeds)]
        stats = {f"hetero/share_rank{r}": float(s) for r, s in enumerate(current.shares)}
        stats.update({f"hetero/step_time_rank{r}": t for r, t in enumerate(times)})
        stats["hetero/idle_fraction"] = 1.0 - min(times) / max(times)
        stats["hetero/predicted_gain"] = gain
        module.log_dict(stats, on_step=True, on_epoch=False, rank_zero_only=True)
        if gain > self.hysteresis:
            start = self.micro_done // self.plan.accumulation + self.lookahead
            self.sampler.schedule_plan(candidate, start)
            rank_zero_info(f"{self.name}: step {step}: shares {list(current.shares)} -> {list(candidate.shares)} "
                           f"from step {step + self.lookahead} on (predicted gain {gain:.1%})")

    def _candidate(self, current: SharePlan) -> tuple[SharePlan, float]:
        """The plan to adopt and its predicted gain over ``current``, from every rank's micro-step time
        modelled as fixed + per-sample cost (:class:`~lightning_efficient.balance.speed.MicroStepTimes`,
        all-gathered): a rank given fewer samples then does not look slower per sample and lose more
        (the shares of identical ranks ran away to [7, 1] on small models). ``current`` (gain 0) while a
        rank has not measured a size 4 times, or when the gain is within twice the measurements' spread."""
        global_batch = self.sampler.global_batch
        mine = torch.tensor(self.micro_step_times.fit(), dtype=torch.float64, device=self.strategy.root_device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        fixed, per_sample, noise = ([float(g[i]) for g in gathered] for i in range(3))
        if not all(math.isfinite(a) and math.isfinite(b) and b > 0 for a, b in zip(fixed, per_sample)):
            return current, 0.0
        weights = equal_time_weights(global_batch, current.accumulation, fixed, per_sample)
        candidate = plan_shares(global_batch, weights, self.caps(), self.plan.accumulation)
        before = predicted_step_time(current.shares, current.accumulation, fixed, per_sample)
        after = predicted_step_time(candidate.shares, candidate.accumulation, fixed, per_sample)
        gain = 1.0 - after / before
        return (candidate, gain) if gain > 2 * max(noise) else (current, 0.0)  # twice: both ends are measured

    # -- state ----------------------------------------------------------------------------------
    @property
    def training_epoch(self) -> int:
        """The epoch the training loop runs, or starts next (Lightning's count of processed epochs)."""
        return self.strategy.lightning_module.trainer.fit_loop.epoch_progress.current.processed

    def trained_position(self) -> tuple[int, int]:
        """``(global batches, micro-batches of the next one)`` of the sampler's epoch trained so far (not those handed
        out ahead)."""
        # the count of micro-batches trained refers to counter_epoch; once the sampler has started the next epoch (the
        # loader is iterated before that epoch's first step) nothing of it is trained yet
        if self.sampler.epoch != self.counter_epoch:
            return 0, 0
        # (an epoch's short last step may run fewer micro-batches than the others: trained to the end, it is done)
        if self.micro_done >= len(self.sampler):
            return self.sampler.batches_per_epoch, 0
        return divmod(self.micro_done, self.plan.accumulation)

    def data_state_dict(self) -> dict[str, Any]:
        """The sampler's state at the position trained (not prefetched), with the measured speeds."""
        state = self.sampler.state_dict()
        state["next_batch"], state["next_micro"] = self.trained_position()
        state["speeds"] = list(self.speeds)
        state["step_token_scale"] = self.token_normaliser.scale  # a resumed first step scales as the uninterrupted one
        return state

    def load_pending_data_state(self) -> None:
        """Hand the sampler the checkpoint's position where Lightning did not: a training DataLoader built before the
        checkpoint was restored (``trainer.estimated_stepping_batches`` in ``configure_optimizers`` builds it, for a
        ``OneCycleLR``'s total steps) is not set up again, so Lightning never loads its state, and a mid-epoch resume
        trained the epoch's first batches again (a new user's trial). Then the training iterator is made again from
        the position (the one made before read the sampler from the epoch's start)."""
        # (also at an epoch's end, where Lightning does not restart the loop and leaves the states unread: the sampler
        # learns the epoch trained, and the iterator made again starts the next one)
        load_pending_position(self.strategy.lightning_module.trainer.fit_loop, at_an_epochs_end=True)

    def load_data_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler (also on another number of ranks) and, on the same number of ranks,
        the measured speeds. A state this strategy did not save (another strategy's stateful DataLoader, left unread
        at an epoch's end) is not a position of its sampler: the epoch starts afresh, as Lightning starts it there."""
        if "schedule" not in state:
            rank_zero_warn(f"{self.name}: the checkpoint's training DataLoader state was not saved by {self.name} "
                           f"(keys {sorted(state)[:5]}): the epoch starts from its first batch (taken mid-epoch, Lightning "
                           "goes on counting from the checkpoint's batch: the epoch's last batches are then not trained)")
            return
        self.sampler.load_state_dict(state)
        self.micro_done = self.sampler.next_batch * self.plan.accumulation + self.sampler.skip_micro
        speeds = state.get("speeds") or []
        if len(speeds) == self.world:
            self.speeds = [float(s) for s in speeds]
        self.counter_epoch = self.sampler.epoch
        self.token_normaliser.scale = state.get("step_token_scale")
        # (the shares said when the DataLoader was built were the plan's before the checkpoint loaded)
        rank_zero_info(f"{self.name}: resumed at epoch {self.sampler.epoch}, global batch index {self.sampler.next_batch}, "
                       f"shares {self.current_shares}")

    @property
    def current_shares(self) -> list[int]:
        """The shares in force for the next global batch to train."""
        return list(self.sampler.step_plan(self.micro_done // self.plan.accumulation).shares)
