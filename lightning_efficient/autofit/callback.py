"""``AutoFit``: give it the memory each device has; it measures the run and sets micro-batch (with
gradient accumulation keeping the global batch), each block's activation policy and the optimizer
states' precision for the most tokens per second that fit."""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loops.utilities import _is_max_limit_reached
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import _TunerExitException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_efficient import _batch_counts
from lightning_efficient._batch_counts import (
    SchedulerFrequencies,
    batch_settings,
    batches_trained,
    checkpoint_timing_kept,
    counted_batches,
    counts_batches,
    counts_in_micro_batches,
    epoch_ended,
    restored_batches_counted_again,
    restored_position_moved_to_the_batchs_start,
    whole_batches_in_micro_batches,
)
from lightning_efficient._code_pages import CodePages
from lightning_efficient._distributed import gather_objects, gather_or_raise_together
from lightning_efficient._step import first_samples_batch, prepared_as_in_the_loop
from lightning_efficient._torch import Trainable
from lightning_efficient._validation import refuse_unless, require, require_int
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.activations.discovery import find_blocks, transformers_checkpointing
from lightning_efficient.activations.planner import BlockProfile
from lightning_efficient.activations.policies import POLICIES, policy_counts
from lightning_efficient.autofit.budget import check_budget_ranks, rank_budget, validate_budget
from lightning_efficient.autofit.fit_inputs import (
    StreamsAtTheLastBuild,
    agreed_restored_state,
    checkpoint_contents,
    fit_checkpoint_path,
    loader_batch_size,
    random_streams_restored,
    samplers_left_as_they_were,
)
from lightning_efficient.autofit.measure import (
    OptimizerSpec,
    _in_lockstep,
    can_resize,
    free_what_running_out_left,
    measure_blocks,
    measure_peak,
    measure_rank,
)
from lightning_efficient.autofit.model import (
    CLOSE,
    BudgetTooSmall,
    FitPlan,
    RankChoice,
    RankProfile,
    blocks_matter,
    divisors,
    peak_read_over,
    plan_table,
    priced_by_reading,
    replan,
    search,
)
from lightning_efficient.autofit.token_mean import BatchTokenMean, StepTokenMean, is_heterogeneous, token_mean_taken_elsewhere
from lightning_efficient.balance.probe import is_out_of_memory
from lightning_efficient.memory import (
    ParameterStorages,
    PeakMemory,
    automatic_collection_paused,
    collect_garbage_made_since,
    fit_start_rss_bytes,
    freed_heap_stays_resident,
    is_fsdp2,
    older_collections,
    optimizer_state_bytes,
    outside_training,
    release_free_memory,
)
from lightning_efficient.optim._bnb import bitsandbytes
from lightning_efficient.optim.callback import EightBitOptimizer
from lightning_efficient.optim.sharded import has_sharded_params
from lightning_efficient.optim.twins import eight_bit_classes, find_twin, is_stateless, paged_refusal
from lightning_efficient.resumable import load_pending_position

CONFIRM_ROUNDS = 3
"""Readings of picks beyond the measured micro-batch sizes, at most, each time the pick is checked (after the search,
and again after the pick's block policies were priced up)."""

RAN_OUT = -1.0
"""A timed reading that ran out of memory (gathered from every rank in place of its seconds)."""


def _unread(profile: RankProfile, micro: int) -> bool:
    """Whether ``micro`` is above the measured sizes and its peak was not read (beyond them, or between larger sizes
    read: predicted from a line between two readings, which a peak growing more slowly at larger sizes is above)."""
    return micro > profile.sizes[1] and micro not in dict(profile.peak_points())


def _size_to_read(profile: RankProfile, micro: int) -> int:
    """The micro-batch a rank reads when the pick is checked: its pick where that is unread, else the larger measured
    size (a reading nothing is learnt from, as every rank reads one)."""
    return micro if _unread(profile, micro) else max(micro, profile.sizes[1])


def _allocator_notes(pl_module: LightningModule) -> list[str]:
    """The plan's note on this process's allocator: on CPU where freed heap stays in the RSS (none otherwise)."""
    return [FREED_HEAP_RESIDENT] if pl_module.device.type == "cpu" and freed_heap_stays_resident() else []


def _ran_out(profile: RankProfile, size: int) -> RankProfile:
    """``profile`` where no plan uses ``size`` or more (a reading there ran out of memory, or one above it did)."""
    return replace(profile, out_of_memory_at=min(size, profile.out_of_memory_at or size))

OptimizerChoice = Literal["32-bit", "8-bit", "8-bit paged", "8-bit offload"]
Policy = Literal["keep", "checkpoint", "selective", "offload", "disk"]
_CUDA_ONLY = ("8-bit paged", "8-bit offload")


@contextlib.contextmanager
def _info_lines_left_out(prefix: str) -> Iterator[None]:
    """Lightning's rank-zero info lines that start with ``prefix`` are not printed meanwhile."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")

    def printed(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(prefix)

    logger.addFilter(printed)
    try:
        yield
    finally:
        logger.removeFilter(printed)


def _trains_a_step(trainer: Trainer) -> bool:
    """Whether the fit starting trains a step, as far as Lightning's loop can tell before it runs: not where
    ``limit_train_batches=0``, nor where ``max_steps`` or ``max_epochs`` is reached already (a second ``fit`` of one
    Trainer; a finished run's checkpoint, where it is loaded by ``on_fit_start``)."""
    if trainer.limit_train_batches == 0:
        return False
    loop = trainer.fit_loop
    step, epochs = loop.epoch_loop.global_step, loop.epoch_progress.current.processed
    loaded = trainer._checkpoint_connector._loaded_checkpoint
    if loaded:
        step = loaded.get("global_step", step)
        progress = loaded.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
        epochs = progress.get("processed", epochs)
    return not (_is_max_limit_reached(step, loop.max_steps) or _is_max_limit_reached(epochs, loop.max_epochs))


def _ladder(candidates: list[int], below: int, most: int = 3) -> tuple[int, ...]:
    """Up to ``most`` of ``candidates`` under ``below``, geometrically spaced (each at most half the one above it).
    One is among them where it is near enough: it is left out when measured where the model cannot train on one sample
    or the ranks run in step (see :func:`~lightning_efficient.autofit.measure.measure_rank`)."""
    chosen: list[int] = []
    limit = below // 2
    while len(chosen) < most:
        fitting = [m for m in candidates if 1 <= m <= limit]
        if not fitting:
            break
        chosen.append(max(fitting))
        limit = chosen[-1] // 2
    return tuple(sorted(chosen))


def _ddp_bucket_bytes(strategy: Any) -> int:
    """Bytes of DDP's gradient buckets (one copy of the trainable parameters' gradients, unless they are views of
    the buckets): allocated by DDP's own forward, which the measured steps do not run; 0 for other strategies."""
    from lightning.pytorch.strategies import DDPStrategy

    if not isinstance(strategy, DDPStrategy) or strategy.world_size < 2:
        return 0
    if getattr(strategy, "_ddp_kwargs", {}).get("gradient_as_bucket_view"):
        return 0
    return sum(p.numel() * p.element_size() for p in strategy.lightning_module.parameters() if p.requires_grad)


def _cannot_build(name: str, optimizers: list[torch.optim.Optimizer]) -> str | None:
    """Why the optimizer option ``name`` cannot hold these optimizers' states (None: it can)."""
    for index, optimizer in enumerate(optimizers):
        if isinstance(optimizer, eight_bit_classes()) or is_stateless(optimizer):
            continue
        if find_twin(optimizer) is None:
            return f"optimizer {index} ({type(optimizer).__name__}) has no bitsandbytes 8-bit twin"
        if name == "8-bit paged" and paged_refusal(optimizer):
            return f"optimizer {index}: {paged_refusal(optimizer)}"
        if name == "8-bit offload" and has_sharded_params(optimizer):
            return f"optimizer {index} steps sharded (DTensor) parameters, which host offload refuses"
    return None


#: what the advice to fit again with a wider margin leads to (a new user took it for a promise that a plan would fit)
_WIDER_MARGIN = (" (as wide as this miss: a new fit chooses its micro-batch and optimizer states again too), which plans for "
                 "peaks that much above the predictions, or, where no plan fits then, refuses the budget before the first "
                 "step, naming the least that would do")
#: the plan's note on CPU where glibc's allocator keeps freed heap in the RSS (a new user's trial: measured peaks 14-80%
#: above the predictions, above tight budgets in about half the fits; within 13% with the threshold set)
FREED_HEAP_RESIDENT = ("on CPU, memory is the process's RSS, in which glibc's allocator keeps the heap it freed: fits can read "
                       "well above these predictions (new users' models: 14-80%); MALLOC_MMAP_THRESHOLD_=131072 in the "
                       "environment the process starts with makes the RSS count what is held (fits then run 1.2-2x slower)")

#: the plan's note when the blocks were not profiled before the first step
NOT_PROFILED = "blocks not profiled: the fastest plan fits with every block kept"
PRICING_ROUNDS = 2
"""The most times a pick's block policies are timed and priced up before the search's plan is taken as it is."""


@dataclass
class _Unprofiled:
    """What profiling the blocks later needs: the batch source, the blocks and the policies allowed (each rank profiles
    them at its profile's ``blocks_size``, its smaller measured size)."""

    batches: Any
    blocks: list
    policies: tuple[str, ...]


class MeasuringRanOut(RuntimeError):
    """Raised on every rank alike where measuring ran out of memory on one or more ranks (each named with its error)."""


def budget_advice(plan: FitPlan, measured: list[dict[str, float]], advised: float) -> str | None:
    """The larger budget for each rank measured over its budget whose plan was predicted above the budget less the
    margin (the leanest, taken after an unfreeze): no margin mends that miss. Each budget holds the rank's measured peak
    within it less the wider of the plan's margin and ``advised`` (a larger budget lets the search take a larger plan,
    which may miss alike). None where no rank is so."""
    above = [(rank, m["peak_bytes"]) for rank, (m, r, b) in enumerate(zip(measured, plan.ranks, plan.budgets))
             if m["peak_bytes"] > b and r.peak_bytes > b * (1 - plan.margin)]
    if not above:
        return None
    wider = max(plan.margin, advised)
    budgets = " and ".join(f"{'the' if len(plan.ranks) == 1 else f'rank {rank} a'} budget of at least "
                           f"{math.ceil(peak / (1 - wider) / 2**20):,} MiB" for rank, peak in above)
    return (f"give {budgets}" + (f" and AutoFit(margin={wider:.2f})" if wider > plan.margin else "")
            + f" ({'its plan was' if len(above) == 1 else 'their plans were'} predicted above the budget less the margin, "
            "which no margin mends)")


def _keep_still_fits(plan: FitPlan, profiles: list[RankProfile], margin: float) -> bool:
    """Whether every rank's blocks, all kept, are predicted within its budget less ``margin`` (the profiles' blocks
    not profiled: then a re-plan at that margin would keep them all)."""
    try:
        replan(plan, [replace(p, blocks=[]) for p in profiles], margin=margin, policies=("keep",))
    except BudgetTooSmall:
        return False
    return True


_MEASURED_AGAIN = "measured and planned again at step"
"""How the note of a plan made mid-fit for other trainable parameters starts."""


def _held_state_bytes(trainer: Trainer) -> int:
    """The bytes the fit's optimizers hold in states now (this rank's)."""
    return sum(optimizer_state_bytes(o) for o in trainer.strategy.optimizers)


def _warn_if_ddp_leaves_them_unsynchronised(trainer: Trainer, module: LightningModule, wrapped: frozenset[str]) -> None:
    """Warn where parameters train under torch's DDP that did not when the fit started (``wrapped``): DDP synchronises
    the gradients of those that required them when it wrapped the module, and no others (plain Lightning's too: a new
    test's backbone, unfrozen at epoch 1, was 6e-4 apart on two ranks after three steps)."""
    if not isinstance(getattr(trainer.strategy, "model", None), DistributedDataParallel):
        return
    later = [name for name, p in module.named_parameters() if p.requires_grad and name not in wrapped]
    if later:
        rank_zero_warn(f"AutoFit: {len(later)} parameter tensor(s) train now that did not when DDP wrapped the module "
                       f"({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}): torch's DistributedDataParallel averages "
                       "the gradients only of the parameters that trained then, so the ranks' copies of these drift apart (in "
                       "plain Lightning too). Unfreeze them before the fit, or use FSDP2 (ModelParallelStrategy), whose ranks "
                       "stay in step.")


def _measuring_batches(strategy: Any, loader: Any) -> Any:
    """``size -> batch`` for measuring steps: the first ``size`` samples of ``loader``'s dataset, or, where its samples
    cannot be drawn by index, its first batch whatever the size (its samplers left as they were)."""
    if can_resize(loader):
        return lambda size: first_samples_batch(strategy, loader, size)
    with samplers_left_as_they_were(loader):
        first = prepared_as_in_the_loop(strategy, next(iter(loader)))
    return lambda size: first


def _users_loader(trainer: Trainer) -> Any:
    """The training DataLoader the fit's ``train_dataloader()`` returns, for AutoFit to read, with the random streams
    a draw in it moves put back (a review: a split drawn there moved Python's and NumPy's streams on)."""
    with random_streams_restored(trainer.strategy.root_device):
        return trainer.fit_loop._data_source.dataloader()


def _warn_of_batch_statistics(module: LightningModule, batch: int, micro: int) -> None:
    """Warn where ``module`` has batch-norm layers in training: they normalise over each micro-batch, so splitting the
    user's batch changes what they compute (a new user's trial: weights 0.04 apart after 8 steps at 2 x 4, silently)."""
    norms = [name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        rank_zero_warn(
            f"AutoFit: {len(norms)} batch-norm layer(s) ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
            f"normalise over each micro-batch: at the plan's micro-batch of {micro} they see {micro} samples where your "
            f"batch had {batch}, and their statistics and the update change with it. Give AutoFit(search_micro_batch="
            "False) to keep the batch."
        )


class AutoFit(Callback):
    """Chooses micro-batch, per-block activation policy and optimizer-state precision for the most
    tokens per second whose predicted peak memory fits the budget, from measured steps of this run.

    Before the first step it measures (state restored afterwards, see
    :mod:`lightning_efficient.autofit.measure`): a forward and backward at two micro-batch sizes (peak
    memory and time, so both are fitted as lines, not extrapolated from one point), each block's
    activation bytes and recompute/transfer cost under each policy, and each optimizer option's state
    bytes, step time and step peak on this hardware. It then searches (:func:`~lightning_efficient.autofit.model.search`)
    and prints the plan as a table with the predicted peak and tokens/s; after ``report_after_steps``
    optimizer steps it prints the measured figures beside the predictions, and if a measured peak is
    above its prediction it plans the block policies again with the margin widened by the difference,
    and says so. Where the parameters that train change (a ``BaseFinetuning`` callback unfreezing layers), it
    measures again and plans the block policies again before that step. The plan is saved in checkpoints; a
    resume with the same settings reuses it.

    What it sets: the micro-batch through the module's or datamodule's ``batch_size`` attribute (as
    Lightning's batch-size finder does) and ``trainer.accumulate_grad_batches`` so the global batch stays
    as configured; under ``hetero_ddp``/``hetero_fsdp`` each rank's ``max_micro_batch`` cap (the
    balancer shares the global batch by measured speed); the block policies through an
    :class:`ActivationMemory` it adds; the optimizer through an :class:`EightBitOptimizer` it adds. A user
    who also sets one of those callbacks keeps that setting (its policy or precision is then measured,
    not searched), and the plan says so. Put ``AutoFit`` before them in ``callbacks``. Where the plan splits the
    batch, a ``TokenLosses``/``FusedTokenLoss`` step stays the mean over the batch's valid tokens
    (:mod:`~lightning_efficient.autofit.token_mean`).

    Memory is what :class:`~lightning_efficient.MemoryReport` measures: on CUDA
    ``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS above its RSS when the fit started.

    Args:
        budget: per device: bytes, a size string (``"6GiB"``), ``"auto"`` (CUDA: the device's memory less
            5%; CPU: the available memory shared by this host's ranks, less 5%), or a list of those with one per rank. A float
            (``0.5``, ``6e9``) is refused: AutoFit's budget is memory, not a fraction (write ``6000000000`` or ``"6GB"``).
        margin: the fraction of each budget the predicted peak leaves free, for what a prediction misses.
        search_micro_batch: search the micro-batch (False: keep the DataLoader's).
        micro_batches: the micro-batch sizes to choose from (as DeepSpeed's autotuner's ``micro_batch_sizes``), of those
            the search allows: sizes dividing each rank's batch (under the heterogeneous strategies, up to the global
            batch); None: all of them. Checked against the batch before the first step.
        activation_policies: the block policies to choose from (``["keep"]``: activations are not planned).
            ``offload`` is considered on CUDA only.
        optimizer_options: the optimizer-state options to choose from; the paged and offloaded ones on CUDA only.
        blocks: which modules are blocks, as for :class:`ActivationMemory`.
        min_8bit_size: as for :class:`EightBitOptimizer`.
        report_after_steps: optimizer steps after which the measured figures are printed beside the predicted.
        plan_only: end the fit once the plan is printed, before the first step (``trainer.fit`` returns; the plan
            is :attr:`plan`), as Lightning's batch-size finder ends a tuning fit; what ``lightning-efficient plan`` does.
            Refused under a strategy that spawns its processes (``ddp_spawn``): the plan would be made, and lost, in
            them; plan under ``ddp`` (the same plan) or with ``lightning-efficient plan``, which does so.

    Raises:
        ValueError: naming the argument for a bad value; before the first step, when no configuration fits
            (:class:`~lightning_efficient.autofit.model.BudgetTooSmall`, with the smallest budget that would
            and the plan that needs it), or for settings AutoFit cannot plan around.
    """

    def __init__(
        self,
        budget: int | float | str | list[int | float | str],
        margin: float = 0.10,
        search_micro_batch: bool = True,
        micro_batches: list[int] | None = None,
        activation_policies: list[Policy] | None = None,
        optimizer_options: list[OptimizerChoice] | None = None,
        blocks: Literal["auto"] | list[str] = "auto",
        min_8bit_size: int = 4096,
        report_after_steps: int = 3,
        plan_only: bool = False,
    ) -> None:
        validate_budget(budget)
        require(isinstance(margin, (int, float)) and not isinstance(margin, bool) and 0.0 <= margin < 1.0,
                "margin", margin, "a fraction in [0, 1)")
        require(isinstance(search_micro_batch, bool), "search_micro_batch", search_micro_batch, "True or False")
        require(isinstance(plan_only, bool), "plan_only", plan_only, "True or False")
        require(micro_batches is None or (isinstance(micro_batches, list) and micro_batches and all(
            isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in micro_batches)), "micro_batches", micro_batches,
            "None or a non-empty list of integers >= 1")
        require(micro_batches is None or search_micro_batch, "micro_batches", micro_batches,
                "None where search_micro_batch=False (the DataLoader's micro-batch is kept)")
        policies = list(activation_policies) if activation_policies is not None else ["keep", "selective", "checkpoint", "offload", "disk"]
        require(all(p in POLICIES for p in policies) and "keep" in policies, "activation_policies", activation_policies,
                "a list of " + ", ".join(POLICIES) + " that includes 'keep'")
        choices = ("32-bit", "8-bit", "8-bit paged", "8-bit offload")
        options = list(optimizer_options) if optimizer_options is not None else list(choices)
        require(bool(options) and all(o in choices for o in options), "optimizer_options", optimizer_options,
                "a non-empty list of " + ", ".join(repr(c) for c in choices))
        require(blocks == "auto" or (isinstance(blocks, list) and blocks and all(isinstance(b, str) for b in blocks)),
                "blocks", blocks, "'auto' or a non-empty list of class names / name patterns")
        require_int("min_8bit_size", min_8bit_size, 1)
        require_int("report_after_steps", report_after_steps, 1)
        self.budget = budget
        self.margin = float(margin)
        self.search_micro_batch = search_micro_batch
        self.micro_batches = None if micro_batches is None else list(micro_batches)  # as given (said back so)
        self._micro_batch_sizes = None if micro_batches is None else sorted(set(micro_batches))
        self.activation_policies = tuple(policies)
        self.optimizer_options = tuple(options)
        self.blocks = blocks
        self.min_8bit_size = min_8bit_size
        self.report_after_steps = report_after_steps
        self.plan_only = plan_only
        self._activations: ActivationMemory | None = None  # the callbacks AutoFit added (kept for later fits)
        self._optimizer: EightBitOptimizer | None = None
        self._user_activations: ActivationMemory | None = None
        self._user_optimizer: EightBitOptimizer | None = None
        self._plan: FitPlan | None = None
        self._profiles: list[RankProfile] = []
        self._restored: dict[str, Any] | None = None
        self._checkpoint_states: dict[str, Any] = {}  # the callbacks' states in the checkpoint this fit resumes from
        self._undo_settings: list[Any] = []
        self._scheduler_frequencies = SchedulerFrequencies()  # interval="step" schedulers step after the user's steps
        self._epoch_end_validation = _batch_counts.EpochEndValidation()  # decided in the user's batches
        self._resumed_step_saved = _batch_counts.ResumedStepSaved()  # no ModelCheckpoint saves the resumed step again
        self._meter: PeakMemory | None = None
        self._start_rss = 0
        self._unprofiled: _Unprofiled | None = None  # the blocks left unprofiled before the first step
        self._checkpoint_micro_batch: int | None = None  # what the resumed checkpoint counted its batches in
        self._users_batch_size: int | None = None  # the training DataLoader's batch size when this fit planned
        #: after a ``plan_only`` fit whose plan splits the batch: the settings that count its training batches, which
        #: AutoFit counts in micro-batches as it fits (``lightning-efficient plan`` then keeps AutoFit in its config)
        self.batch_counting: list[str] = []
        #: after a ``plan_only`` fit whose plan splits the batch of a DataLoader dropping its last incomplete batch: the
        #: micro-batches of the user's whole batches an epoch trains (the plan's config limits its epochs to them)
        self.epoch_micro_batches: int | None = None
        self._users_accumulation: int | None = None  # the trainer's accumulate_grad_batches before the plan's
        self._code_pages = CodePages()  # off CUDA: the library code measuring touched is handed back after it
        self._step_started: float | None = None
        self._measured_against: list[int] = []  # each rank's predicted peak when the measured figures were read
        self._step_times: list[float] = []
        self._measured: list[dict[str, float]] | None = None
        self.planning_s = 0.0
        self.planning_peak_bytes = 0  # this rank's peak while planning (CUDA: allocated; CPU: RSS above the fit's start)
        self._trainer_rank = 0
        self._precision: str | None = None
        self._micro_searched = False
        self._built_again = False  # the training DataLoader built before the plan was built again in on_fit_start
        self._last_build = StreamsAtTheLastBuild()
        self._token_mean = BatchTokenMean()  # the batch's token mean where the plan splits it
        self._trainable_planned: Trainable | None = None  # what trained when the plan was made
        # this fit's plans, the profiles they were made from and their blocks left unprofiled, by what trained and the
        # optimizer state bytes held when each was made; the key of the plan in force
        self._plans_by_what_trains: dict[tuple[Trainable, int], tuple[FitPlan, list[RankProfile], _Unprofiled | None]] = {}
        self._plan_key: tuple[Trainable, int] | None = None
        self._trained_when_wrapped: frozenset[str] = frozenset()  # the parameters that trained when the fit started

    # -- set-up ---------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        user = self._user_optimizer  # a plan priced for its states is not reused without it (nor it for another)
        return {"precision": self._precision, "budget": self.budget, "margin": self.margin, "search_micro_batch": self.search_micro_batch,
                "micro_batches": self._micro_batch_sizes,
                "activation_policies": list(self.activation_policies), "optimizer_options": list(self.optimizer_options),
                "blocks": self.blocks, "min_8bit_size": self.min_8bit_size,
                "optimizer_as_set": None if user is None else {"bits": user.bits, "paged": user.paged, "offload": user.offload,
                                                               "min_8bit_size": user.min_8bit_size}}

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        callbacks = trainer.callbacks
        require(sum(isinstance(c, AutoFit) for c in callbacks) == 1, "callbacks", "two AutoFit", "one AutoFit per Trainer")
        self.refuse_plan_only_where_spawned(trainer)
        self._last_build.watch(trainer.fit_loop)
        if any(isinstance(c, GradientAccumulationScheduler) for c in callbacks):
            raise ValueError("AutoFit sets accumulate_grad_batches itself; it cannot work beside a GradientAccumulationScheduler")
        mine = (self._activations, self._optimizer)
        self._user_activations = next((c for c in callbacks if isinstance(c, ActivationMemory) and c not in mine), None)
        self._user_optimizer = next((c for c in callbacks if isinstance(c, EightBitOptimizer) and c not in mine), None)
        if self._user_activations is not None and self._user_activations.policy == ["auto"]:
            raise ValueError(
                "ActivationMemory(policy='auto') beside AutoFit: AutoFit plans the block policies itself, within its own "
                "budget; drop ActivationMemory, or give it a fixed policy for AutoFit to keep"
            )
        # read before the start is (what reading maps is handed back by then), and only where it is needed: the
        # strategy restores after AutoFit plans, an ActivationMemory of AutoFit's may have to be there for its state, or
        # the search may pick 32-bit states only (the checkpoint's may be 8-bit)
        self._checkpoint_states = {}
        wants_8bit = self.may_use_8bit
        resumed_8bit = False
        if getattr(trainer.strategy, "restore_checkpoint_after_setup", False) or not wants_8bit or (
                self._user_activations is None and not any(isinstance(c, ActivationMemory) for c in callbacks)):
            contents = checkpoint_contents(*fit_checkpoint_path(trainer))
            self._checkpoint_states = contents.callback_states
            resumed_8bit = contents.eight_bit_states or not contents.read  # (not read: they may be)
        self._adopt_activations(trainer, self._checkpoint_states)
        # a checkpoint with 8-bit states resumed where the search cannot pick them (32-bit only): the states are
        # dequantized as they load (the module's own optimizer cannot read bitsandbytes' layout); with 32-bit states
        # the converter leaves them as they are, so a rank that could not read the checkpoint adds it all the same
        wants_8bit = wants_8bit or resumed_8bit
        if wants_8bit or self._user_optimizer is not None:
            bitsandbytes()  # its import (native libraries) is not training memory: loaded before the start is read
        if trainer.strategy.root_device.type != "cuda":
            self._code_pages.snapshot()  # (before the start is read: its own few bytes are not the fit's)
        self._start_rss = fit_start_rss_bytes()  # what earlier work freed, or left as garbage, is not counted in it
        self._precision = str(trainer.precision)
        if self._user_optimizer is None and wants_8bit:
            # added now, not when planning: it must exist when a checkpoint is loaded (it converts states); the
            # same one in every fit of this AutoFit (its state key is the checkpoint's), into each Trainer's list
            if self._optimizer is None:
                self._optimizer = EightBitOptimizer(bits=32, min_8bit_size=self.min_8bit_size)
            if self._optimizer not in callbacks:
                callbacks.insert(callbacks.index(self) + 1, self._optimizer)

    def _adopt_activations(self, trainer: Trainer, states: dict[str, Any]) -> None:
        """Add this AutoFit's :class:`ActivationMemory` now when the checkpoint holds the state of one and the user
        set none (it is the one AutoFit added to the checkpointed fit): Lightning then hands it that state, rather than
        warning that the checkpoint's callback is missing (asking for one, which AutoFit would then keep as the
        user's) and dropping its state. :meth:`_apply` sets its policies in ``on_fit_start``."""
        if self._user_activations is not None or any(isinstance(c, ActivationMemory) for c in trainer.callbacks):
            return
        candidate = self._activations or self._own_activations(["keep"])
        if candidate.state_key not in states:
            return
        self._activations = candidate
        trainer.callbacks.insert(trainer.callbacks.index(self) + 1, candidate)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = (checkpoint.get("callbacks") or {}).get(self.state_key)
        self._restored = dict(saved) if saved else None

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        mine = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if mine is not None:  # whether a resume starts within an epoch (at a DataLoader batch) or at the next one
            mine["mid_epoch"] = not epoch_ended(trainer.fit_loop.epoch_loop.batch_progress)

    @override
    def state_dict(self) -> dict[str, Any]:
        counts = self._token_mean.saved_counts()  # (one host sync for the rank's count)
        return {"settings": self._settings(), "plan": None if self._plan is None else self._plan.to_dict(),
                "measured": self._measured,
                # a resumed first step scales its token sums as the uninterrupted run's (the same rounding)
                **{key: counts.get(key) for key in ("step_token_scale", "rank_token_count")},
                "trainable": None if self._trainable_planned is None else list(self._trainable_planned)}

    # -- planning -------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_build.stop()
        if pl_module.automatic_optimization is False:
            raise ValueError("AutoFit measures training steps with automatic optimization; this module uses manual optimization")
        self._plan = None  # a fit refused below shows no earlier fit's plan
        self._trainable_planned, self._plans_by_what_trains, self._plan_key = None, {}, None
        self._trained_when_wrapped = frozenset(name for name, p in pl_module.named_parameters() if p.requires_grad)
        self.planning_peak_bytes = 0
        self._measured, self._step_times, self._step_started = None, [], None
        self._measured_against = []
        self._unprofiled = None
        self._checkpoint_micro_batch = self._users_batch_size = None
        self.batch_counting, self.epoch_micro_batches = [], None
        self._users_accumulation = None
        self._trainer_rank = trainer.global_rank
        self._meter = PeakMemory(pl_module.device, self._start_rss)
        restored, self._restored = self._restored, None
        states, self._checkpoint_states = self._checkpoint_states, {}
        if not self.plan_only and not _trains_a_step(trainer):
            rank_zero_info("AutoFit: this fit trains no step (max_steps or max_epochs reached already, or "
                           "limit_train_batches=0): nothing measured or planned.")
            return
        if restored is None and getattr(trainer.strategy, "restore_checkpoint_after_setup", False):
            # ModelParallelStrategy / hetero_fsdp load checkpoints after on_fit_start: this callback's part as read in setup
            saved = states.get(self.state_key)
            restored = dict(saved) if saved else None
        started = time.perf_counter()
        planning = PeakMemory(pl_module.device, self._start_rss)  # the peak while planning, through every reading's reset
        planning.reset(release=False)
        older = older_collections()
        restored = agreed_restored_state(restored)
        plan, failure = None, None
        try:
            plan = self._reusable(restored, trainer)
        except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together (none left waiting)
            failure = error
        # what the reuse is checked against can differ by rank (a budget each rank sets for itself): every rank
        # reuses the plan or none does
        reusing = gather_or_raise_together(plan is not None, failure, "AutoFit could not check the checkpoint's plan")
        if any(reusing) and not all(reusing):
            rank_zero_info(f"AutoFit: rank(s) {[r for r, reuses in enumerate(reusing) if not reuses]} cannot reuse the "
                           "checkpoint's plan; planning again on every rank.")
            plan = None
        reused = plan is not None
        if reused:
            rank_zero_info("AutoFit: the checkpoint's plan is reused (same budget and settings); not measured again.")
            # the notes of the process that planned, but this one's allocator
            plan.notes = [*_allocator_notes(pl_module), *(n for n in plan.notes if n != FREED_HEAP_RESIDENT)]
            self._micro_searched = self.search_micro_batch
        try:
            if plan is None:
                # a checkpoint taken mid-epoch resumes at a DataLoader batch, which the plan's micro-batch must keep the
                # samples of; one taken at an epoch's end (or before this flag was saved: assumed mid-epoch) does not
                saved = None if not restored or restored.get("plan") is None or not restored.get("mid_epoch", True) else (
                    FitPlan.from_dict(restored["plan"]))
                try:
                    # measuring draws nothing the run would have drawn; no collection frees earlier garbage between readings
                    with random_streams_restored(pl_module.device), automatic_collection_paused():
                        plan = self._plan_now(trainer, pl_module, keep_micro_batch=saved)
                finally:
                    # measuring can leave gradients (zeros) on FSDP2's sharded parameters (those of a module a
                    # forward-only pass left unsharded are out of reach when the run's state is put back); the fit starts
                    # without any, as plain Lightning's does: torch's distributed checkpoint (ModelParallelStrategy's
                    # resume, after this hook) loads no optimizer states into an optimizer whose parameters hold gradients
                    pl_module.zero_grad(set_to_none=True)
        except BaseException:  # also when no plan fits: the process goes on (a fit with another budget, a notebook)
            with contextlib.suppress(Exception):  # the error that stopped planning is the one raised
                self._release_what_measuring_left(older, pl_module.device)
            raise
        self._release_what_measuring_left(older, pl_module.device)
        self.planning_s = time.perf_counter() - started
        self.planning_peak_bytes = planning.read()
        self._plan = plan
        # (a reused plan was made for the parameters that trained then: a BaseFinetuning callback may unfreeze after this)
        self._trainable_planned = (Trainable.saved((restored or {}).get("trainable")) if reused else None) or Trainable.of(pl_module)
        self._plan_key = (self._trainable_planned, _held_state_bytes(trainer))
        self._plans_by_what_trains[self._plan_key] = (plan, self._profiles, self._unprofiled)
        rank_zero_info(plan_table(plan) + f"\n  {'reused' if reused else 'planned'} in {self.planning_s:.2f} s"
                       + ("" if reused else self._planning_peak_line(plan, trainer.global_rank)))
        if self.plan_only:
            self.batch_counting = self._what_counts_batches(trainer, plan)
            self.epoch_micro_batches = self._epoch_of_whole_batches(trainer, plan)
            raise _TunerExitException()  # Lightning tears the fit down and returns from fit, as after its own tuners
        self._checkpoint_micro_batch = self._checkpoints_micro_batch(restored, trainer)
        # (a checkpoint's running token count: a resumed first step rounds as the uninterrupted run's)
        self._apply(plan, trainer, pl_module, token_counts=restored)

    def _checkpoints_micro_batch(self, restored: dict[str, Any] | None, trainer: Trainer) -> int | None:
        """The batch size the checkpoint this fit resumes from counted its DataLoader batches in: its AutoFit plan's
        micro-batch, or, from a checkpoint without AutoFit's state, the DataLoader's batch size before this plan (the
        user's, which the checkpoint's fit drew). None where the fit does not resume, the heterogeneous strategies
        count the batches (their balancer), or it is not known."""
        if trainer.ckpt_path is None or self._heterogeneous(trainer):
            return None
        if restored is not None:
            saved = FitPlan.from_dict(restored["plan"]) if restored.get("plan") is not None else None
            return saved.micro_batches[0] if saved is not None and saved.accumulation is not None else None
        # (no checkpoint's plan: planned now, from this DataLoader; not the `batch_size` attribute, which a DataLoader
        # passed to fit() does not read)
        return self._users_batch_size

    def _what_counts_batches(self, trainer: Trainer, plan: FitPlan) -> list[str]:
        """What of this fit counts its training batches, where the plan splits them (each said as the user set it):
        AutoFit counts it in micro-batches while it fits (:meth:`_rescale_batch_counts`), which a config of fixed
        settings cannot carry (a new user's trial: `lightning-efficient plan`'s config left ``limit_train_batches: 3``
        counting micro-batches of 4 where the batch was 16, and trained 2 steps of 12 samples, not 6 of 16)."""
        if self._split(trainer, plan) is None:
            return []
        found = [f"{name}={value!r}" for name, value in batch_settings(trainer).items() if counts_batches(value)]
        found += [f"a {type(config.scheduler).__name__} stepped every {config.frequency} batches"
                  for config in trainer.lr_scheduler_configs if config.interval == "step" and config.frequency > 1]
        return found

    def _epoch_of_whole_batches(self, trainer: Trainer, plan: FitPlan) -> int | None:
        """Where the plan splits the batch of a DataLoader that drops its last incomplete batch, and drops less at the
        micro-batch: the micro-batches of the user's whole batches in an epoch (the samples plain Lightning trains, which
        AutoFit limits its epochs to as it fits); else None."""
        split = self._split(trainer, plan)
        epoch = None if split is None else self._rank_epoch(trainer)
        if epoch is None or not epoch[1]:
            return None
        kept = whole_batches_in_micro_batches(epoch[0], *split)
        return kept if kept < epoch[0] // split[1] else None

    def _split(self, trainer: Trainer, plan: FitPlan) -> tuple[int, int] | None:
        """(the user's batch, this rank's micro-batch) where the plan splits the batch into micro-batches; else None."""
        batch, micro = self._users_batch_size, plan.ranks[trainer.global_rank].micro_batch
        return (batch, micro) if plan.accumulation is not None and isinstance(batch, int) and micro != batch else None

    def refuse_plan_only_where_spawned(self, trainer: Trainer) -> None:
        """Raise :class:`~lightning_efficient._validation.SettingRefused` for ``plan_only`` under a strategy that spawns its
        processes (``ddp_spawn``): Lightning ends a tuning fit by an exception it catches where it launched the processes,
        so a spawned process raised it and the plan stayed there (a new user's trial). The command line calls this
        before the processes start, and says it in one line; ``setup`` calls it in them."""
        refuse_unless(not (self.plan_only and isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)), "AutoFit",
                      "plan_only", True, "False under a strategy that spawns its processes (the plan would be made, and lost, "
                      "in them): plan under strategy='ddp', which gives the same plan, or with `lightning-efficient plan`")

    def _planning_peak_line(self, plan: FitPlan, rank: int) -> str:
        """The peak while planning (this rank's), and why it may be above the budget."""
        budget = plan.budgets[rank]
        line = f", peak while planning {self.planning_peak_bytes / 2**20:,.1f} MiB"
        if self.planning_peak_bytes > budget:
            line += (f", above the budget ({budget / 2**20:,.1f} MiB): AutoFit reads micro-batches that may miss the "
                     "budget to find those that fit (on CPU holding a copy of the run's state to put back); on a GPU of "
                     "the budget's size such a reading runs out of memory, which AutoFit takes as the same answer (not "
                     "under FSDP2 or a SyncBatchNorm, where the ranks measure in step)")
        return line

    def _release_what_measuring_left(self, older: int, device: torch.device) -> None:
        # on CPU the fit's memory is its RSS: the library code only measuring ran (every policy, every optimizer option)
        # would stay resident and read as training memory; it is unmapped (the fit faults back in the pages it runs)
        self._code_pages.release_touched()
        # what measuring left as garbage is not the fit's
        collect_garbage_made_since(older)
        release_free_memory(device)

    def _reusable(self, restored: dict[str, Any] | None, trainer: Trainer) -> FitPlan | None:
        if not restored or restored.get("plan") is None:
            return None
        plan = FitPlan.from_dict(restored["plan"])
        # (a checkpoint from before micro_batches was a setting planned with every size)
        if {"micro_batches": None, **(restored.get("settings") or {})} != self._settings():
            rank_zero_info("AutoFit: the checkpoint's plan was made with other settings; planning again.")
            return None
        if plan.samples_per_step != self._samples_per_step(trainer):
            rank_zero_info(f"AutoFit: the checkpoint's plan is for a global batch of {plan.samples_per_step}, not "
                           f"{self._samples_per_step(trainer)}; planning again.")
            return None
        if len(plan.ranks) != trainer.world_size:
            rank_zero_info(f"AutoFit: the checkpoint's plan is for {len(plan.ranks)} ranks, not {trainer.world_size}; planning again.")
            return None
        then, now = Trainable.saved(restored.get("trainable")), Trainable.of(trainer.lightning_module)
        if then is not None and then != now:  # (a BaseFinetuning callback's unfrozen layers, frozen again by its resume)
            rank_zero_info(f"AutoFit: the checkpoint's plan was made while {then.elements:,} parameters trained, "
                           f"{now.elements:,} now; planning again.")
            return None
        return plan

    def _heterogeneous(self, trainer: Trainer) -> bool:
        return is_heterogeneous(trainer.strategy)

    def _samples_per_step(self, trainer: Trainer, loader: Any = None) -> int:
        """The global batch the user set (before AutoFit changes anything)."""
        loader = _users_loader(trainer) if loader is None else loader
        batch_size = loader_batch_size(loader)
        accumulation = trainer.accumulate_grad_batches
        if self._heterogeneous(trainer):
            if trainer.strategy.global_batch_size:
                return trainer.strategy.global_batch_size
            # the user's, not what the strategy's plan set where the loader was built already (in configure_optimizers)
            accumulation = trainer.strategy.balancer.requested_accumulation(trainer)
        return batch_size * trainer.world_size * accumulation

    def _allowed_micro_batches(self, per_rank: int, samples: int, heterogeneous: bool) -> list[int] | None:
        """The user's ``micro_batches`` the search can take (None: every size it allows), refused where none is."""
        if self._micro_batch_sizes is None:
            return None
        limit = samples if heterogeneous else per_rank
        allowed = [m for m in self._micro_batch_sizes if m <= limit and (heterogeneous or per_rank % m == 0)]
        refuse_unless(bool(allowed), "AutoFit", "micro_batches", self.micro_batches,
                       f"sizes up to the global batch of {samples} samples" if heterogeneous
                       else f"sizes dividing each rank's {per_rank} samples a step: {divisors(per_rank)}")
        return allowed

    def init_args(self) -> dict[str, Any]:
        """The constructor's arguments this callback holds (``plan_only`` left out): what a config file gives to build
        it again."""
        return {"budget": self.budget, "margin": self.margin, "search_micro_batch": self.search_micro_batch,
                "micro_batches": self.micro_batches, "activation_policies": list(self.activation_policies),
                "optimizer_options": list(self.optimizer_options), "blocks": self.blocks,
                "min_8bit_size": self.min_8bit_size, "report_after_steps": self.report_after_steps}

    def _plan_now(self, trainer: Trainer, pl_module: LightningModule, keep_micro_batch: FitPlan | None = None) -> FitPlan:
        """Measure every rank and search. ``keep_micro_batch``: the checkpoint's plan, whose micro-batch is kept
        when it still fits (a resume mid-epoch must keep the samples per step of each DataLoader batch)."""
        strategy = trainer.strategy
        loader = _users_loader(trainer)
        require(isinstance(loader, torch.utils.data.DataLoader), "train_dataloader", type(loader).__name__,
                "one DataLoader (AutoFit measures its samples)")
        heterogeneous = self._heterogeneous(trainer)
        batch_size = self._users_batch_size = loader_batch_size(loader)
        world = trainer.world_size
        check_budget_ranks(self.budget, world)  # the same on every rank: raised before anything is measured
        notes: list[str] = _allocator_notes(pl_module)
        resizable = can_resize(loader)
        samples = self._samples_per_step(trainer, loader)
        if heterogeneous:
            per_rank = samples
            searched = resizable and self.search_micro_batch
            refuse_unless(searched or self.micro_batches is None, "AutoFit", "micro_batches", self.micro_batches,
                           "None for this DataLoader, whose micro-batches cannot be sized (its own batch_sampler, or a "
                           "dataset not drawn by index)")
            # a cap the user set stays an upper limit on the plan's (a new user's trial: [2, None] beside AutoFit trained
            # rank 0 at 12 a micro-batch); "auto", the probe, AutoFit's measurement replaces
            users_caps = None if strategy.max_micro_batch in (None, "auto") else strategy.balancer.caps()
            if strategy.max_micro_batch == "auto":
                notes.append("the strategy's max_micro_batch='auto' is replaced by the plan's caps (its own measurement)")
            elif users_caps is not None:
                notes.append(f"the strategy's max_micro_batch={strategy.max_micro_batch!r} is kept: each rank's cap is "
                             "within yours")
        else:
            users_caps = None
            per_rank = samples // world
            # a DataLoader given to fit() is not rebuilt from the `batch_size` attribute (Lightning's batch-size finder
            # refuses such loaders too)
            from_hook = trainer.fit_loop._data_source.is_module()
            searched = self.search_micro_batch and resizable and from_hook and lightning_hasattr(pl_module, "batch_size")
            if self.search_micro_batch and not searched:
                why = ("it was passed to fit(), which nothing rebuilds; return it from train_dataloader() built with "
                       "self.batch_size for AutoFit to choose the micro-batch" if resizable and not from_hook
                       else "no `batch_size` attribute on the module or datamodule to set" if resizable
                       else "it batches with its own batch_sampler" if loader.batch_size is None
                       else "its dataset cannot be drawn by index")
                # (every rank alike: nothing measured yet)
                refuse_unless(self.micro_batches is None, "AutoFit", "micro_batches", self.micro_batches,
                               f"None for this DataLoader, whose micro-batch AutoFit cannot choose: {why}")
                notes.append("micro-batch kept at the DataLoader's: " + why)
        self._micro_searched = searched
        if searched:
            m2 = min(max(batch_size, 2), per_rank)
            sizes = (max(1, m2 // 2), m2)
            micro_batches = self._allowed_micro_batches(per_rank, samples, heterogeneous)
            # smaller candidates are timed too (a CPU's time per sample is not a line in the micro-batch, below the
            # smallest timed size least of all: the demo's grid read one sample faster a sample than two, which the
            # line through two and four put slower): up to three, each at most half the one above; on a resume that
            # keeps the checkpoint's micro-batch, that one alone (its time read, not extrapolated from the line)
            candidates = micro_batches or ([2**k for k in range(per_rank.bit_length())] if heterogeneous else divisors(per_rank))
            ladder = _ladder(candidates, sizes[0]) if keep_micro_batch is None else tuple(keep_micro_batch.micro_batches[:1])
        else:
            sizes = (batch_size, batch_size)
            micro_batches = [batch_size]
            ladder = ()
        batches = _measuring_batches(strategy, loader)
        blocks, fixed, policies = self._blocks(pl_module, notes)
        options = self._optimizer_specs(trainer, pl_module, notes)
        # the blocks the user fixed policies for are profiled now (their peak depends on them); the others once the
        # search shows that their policies matter
        profiles = self._every_ranks_profile(
            trainer, batches, sizes, options=options, blocks=blocks if fixed is not None else [], policies=policies,
            fixed=fixed, budget=lambda: rank_budget(self.budget, trainer.global_rank, world, pl_module.device, max(1, trainer.num_devices)),
            margin=self.margin, ladder=ladder)
        if blocks and fixed is None:
            unprofiled = _Unprofiled(batches, blocks, policies)
            # every rank decides alike (from the gathered profiles); profiled now on a resume (its micro-batch must be kept,
            # which the block policies may be what makes fit) and under FSDP2 (profiling mid-fit would leave gradients on
            # FSDP2's unsharded parameters, as measuring does before the first step, where they are cleared)
            later = keep_micro_batch is None and not any(is_fsdp2(m) for m in pl_module.modules()) and not blocks_matter(
                profiles, samples_per_step=samples, heterogeneous=heterogeneous, margin=self.margin, micro_batches=micro_batches,
                caps=users_caps)
            if later:  # profiled only if the pick's reading or a measured peak asks for a re-plan
                notes.append(NOT_PROFILED)
                self._unprofiled = unprofiled
            else:
                profiles = self._with_blocks(profiles, strategy, unprofiled)
        self._profiles = profiles
        plan = None
        saved = keep_micro_batch
        if saved is not None and not heterogeneous and saved.accumulation is not None and searched:
            try:
                plan = search(profiles, samples_per_step=samples, heterogeneous=False, margin=self.margin, policies=policies,
                              micro_batches=saved.micro_batches[:1])
                kept = saved.micro_batches[0]
                outside = "" if micro_batches is None or kept in micro_batches else f", outside micro_batches={self.micro_batches}"
                notes.append(f"micro-batch {kept} kept from the checkpoint's plan{outside} (a resume mid-epoch needs it)")
            except BudgetTooSmall:
                notes.append(f"the checkpoint's micro-batch {saved.micro_batches[0]} does not fit this budget: chosen again")
        settings = {"samples_per_step": samples, "heterogeneous": heterogeneous, "margin": self.margin,
                    "micro_batches": micro_batches if plan is None else saved.micro_batches[:1], "caps": users_caps}
        if plan is None:
            plan = search(profiles, policies=policies, **settings)

        def again(found: list[RankProfile], margin: float | None = None) -> FitPlan:
            # a pick's peak read above the budget: the rest of the planning keeps the wider margin, once a plan meets it
            trial = settings if margin is None else {**settings, "margin": margin}
            if self._unprofiled is not None and blocks_matter(found, **trial):  # the pick's reading moved the line
                found = self._with_blocks(found, strategy, self._unprofiled)
                self._unprofiled, self._profiles = None, found
                notes.remove(NOT_PROFILED)
            planned = search(found, policies=policies, **trial)
            settings.update(trial)
            return planned

        def beyond_measured(plan: FitPlan) -> bool:
            # measured where it is safe to: every block kept at the pick is predicted within the budget
            return searched and any(_unread(p, r.micro_batch) and p.peak_at(r.micro_batch) <= p.budget_bytes
                                    for r, p in zip(plan.ranks, self._profiles))

        def to_read(plan: FitPlan) -> list[int]:
            return [_size_to_read(p, r.micro_batch) for r, p in zip(plan.ranks, self._profiles)]

        def confirmed(plan: FitPlan) -> FitPlan:
            # each reading that moves the pick onto another micro-batch beyond the measured sizes (one that ran out of
            # memory moves it down) reads that one too, a few times at most; a size once read is not read again
            read: list[set[int]] = [set() for _ in self._profiles]

            def settled(plan: FitPlan) -> bool:
                return not beyond_measured(plan) or all(s in done for s, done in zip(to_read(plan), read))

            for _ in range(CONFIRM_ROUNDS):
                if settled(plan):
                    return plan
                for size, done in zip(to_read(plan), read):
                    done.add(size)
                plan = self._confirmed(plan, self._profiles, strategy, batches, notes, again)
            if settled(plan):
                return plan
            # the readings ran out with a pick still unread: where one ran out of memory, no plan goes beyond the largest
            # size that trained
            capped = [p if p.out_of_memory_at is None else _ran_out(p, max(m for m, _ in p.time_points()) + 1)
                      for p in self._profiles]
            if capped == self._profiles:
                return plan
            self._profiles = capped
            return again(capped)

        plan = confirmed(plan)
        if fixed is None and self._unprofiled is None:  # AutoFit chose the block policies
            timed = plan
            plan = self._priced(plan, trainer, pl_module, batches, notes, again)
            if plan is not timed:  # priced out of its pick, perhaps onto a micro-batch not read yet
                plan = confirmed(plan)
        notes.extend(f"rank {rank}: no micro-batch of {p.out_of_memory_at} or more (a reading at or above it ran out of "
                     "memory while measuring)" for rank, p in enumerate(self._profiles) if p.out_of_memory_at is not None)
        plan.notes.extend(notes)
        return plan

    def _every_ranks_profile(self, trainer: Trainer, batches: Any, sizes: tuple[int, int], *, options: list[OptimizerSpec],
                             blocks: list, policies: tuple[str, ...], fixed: list[str] | None, budget: Any, margin: float,
                             ladder: tuple[int, ...] = (), failing: str = "AutoFit could not measure",
                             running_out_told: bool = False) -> list[RankProfile]:
        """Every rank's :func:`~lightning_efficient.autofit.measure.measure_rank` (``budget``: this rank's, read inside, so
        that a bad one raises on every rank together), gathered; a failure on any rank raises on every rank.
        ``running_out_told``: where a rank ran out of memory (and no rank failed otherwise), every rank raises
        :class:`MeasuringRanOut` alike, for the caller to go on from."""
        strategy = trainer.strategy
        profile, failure = None, None
        exclude = ParameterStorages(strategy.lightning_module).track()
        try:
            mine = budget()
            measured = measure_rank(strategy, batches, sizes, meter=self._meter, options=options, exclude=exclude, blocks=blocks,
                                    policies=policies, budget_bytes=mine, usable_bytes=int(mine * (1.0 - margin)),
                                    fixed_policies=fixed, ladder=ladder)
            measured.unmeasured_bytes = _ddp_bucket_bytes(strategy)
            profile = measured.to_dict()
        except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together
            if running_out_told and is_out_of_memory(error):
                profile = {"ran_out": str(error)}  # (leaving here drops the error, its traceback and the step's tensors)
            else:
                failure = error
        finally:
            exclude.stop()
        gathered = gather_or_raise_together(profile, failure, failing)
        # (decided from the gathered figures: every rank alike, where a rank's own error raised on it alone left the
        # others waiting in their next collective; a review)
        ran_out = [f"rank {rank}: {p['ran_out']}" for rank, p in enumerate(gathered) if "ran_out" in p]
        if ran_out:
            raise MeasuringRanOut("; ".join(ran_out))
        return [RankProfile.from_dict(p) for p in gathered]

    def _with_blocks(self, profiles: list[RankProfile], strategy: Any, unprofiled: _Unprofiled, *,
                     mid_fit: bool = False) -> list[RankProfile] | None:
        """``profiles`` with every rank's blocks profiled (every rank together, each at the smaller size it measured).
        Before the first step a failure on any rank raises on every rank; ``mid_fit``, every rank gets None instead
        (the fit goes on as it is)."""
        started = time.perf_counter()
        mine, failure = None, None
        exclude = ParameterStorages(strategy.lightning_module).track()
        try:
            size = profiles[strategy.global_rank].blocks_size
            mine = [asdict(b) for b in measure_blocks(strategy, unprofiled.batches, size, blocks=unprofiled.blocks,
                                                      exclude=exclude, policies=unprofiled.policies)]
        except Exception as error:  # noqa: BLE001 - every rank learns of it (and raises it together before the first step)
            failure = error
        finally:
            exclude.stop()
        if mid_fit:
            gathered = gather_objects(None if failure is not None else mine)
            if any(g is None for g in gathered):
                rank_zero_warn(f"AutoFit: profiling the blocks failed on a rank ({failure!r} here): the plan stays as it is")
                return None
        else:
            gathered = gather_or_raise_together(mine, failure, "AutoFit could not profile the blocks")
        self.planning_s += time.perf_counter() - started  # measuring, wherever it happens
        return [replace(p, blocks=[BlockProfile(**b) for b in g]) for p, g in zip(profiles, gathered)]

    def _confirmed(self, plan: FitPlan, profiles: list[RankProfile], strategy: Any, batches: Any, notes: list[str],
                   again: Any) -> FitPlan:
        """A pick above the measured sizes whose peak was not read (beyond them, or between larger sizes read) is
        measured too (every block kept): its peak joins the read peaks
        and its time the timed sizes (:meth:`~lightning_efficient.autofit.model.RankProfile.peak_at`); where either
        reads above the prediction (the time by more than :data:`~lightning_efficient.autofit.model.CLOSE`), the
        search runs again."""
        rank = strategy.global_rank
        mine, profile = plan.ranks[rank], profiles[rank]
        reading, failure = None, None
        size = _size_to_read(profile, mine.micro_batch)
        try:
            reading = (size, *measure_peak(strategy, batches, size, self._meter))
        except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together
            if is_out_of_memory(error) and not _in_lockstep(strategy.lightning_module):
                reading = (size, None, None)  # no plan on this rank may use it (leaving here drops the step's tensors)
            else:
                failure = error
        if reading is not None and reading[1] is None:
            free_what_running_out_left(strategy.root_device)
        readings = gather_or_raise_together(reading, failure, "AutoFit could not measure its pick")
        updated: list[RankProfile] = []
        moved: dict[int, set[str]] = {}  # each size whose reading moved the prediction: what moved (peak, time)
        ran_out: list[str] = []  # each size that ran out of memory, and on which rank
        for rank_read, ((size, peak, seconds), p) in enumerate(zip(readings, profiles)):
            if peak is None:  # no plan on this rank goes half way (or more) from the largest size that trained to it
                below = max((m for m, _ in p.time_points() if m < size), default=size) if _unread(p, size) else size
                ran_out.append(f"{size} on rank {rank_read}")
                updated.append(_ran_out(p, max(below + 1, (size + below + 1) // 2)))
                continue
            if not _unread(p, size):
                updated.append(p)
                continue
            if seconds > p.micro_step_seconds(size) * (1 + CLOSE):
                moved.setdefault(size, set()).add("time")
            if peak > p.peak_at(size):
                moved.setdefault(size, set()).add("peak")
            updated.append(replace(p, peaks=[*p.peaks, (size, peak)], times=[*p.times, (size, seconds)]))
        self._profiles = updated
        if not moved and not ran_out:
            return plan
        if ran_out:
            notes.append(f"an earlier pick's micro-batch ran out of memory when read ({', '.join(ran_out)}): planned again below it")
        if moved:
            read = "; ".join(f"{size}: {' and '.join(sorted(what, reverse=True))}" for size, what in sorted(moved.items()))
            notes.append(f"an earlier pick's micro-batch read above its prediction ({read}): planned again with its reading")
        return again(updated)

    def _priced(self, plan: FitPlan, trainer: Trainer, pl_module: LightningModule, batches: Any, notes: list[str],
                again: Any) -> FitPlan:
        """Where the pick moves or recomputes blocks, the search runs again where a micro-step with them costs more.

        Each rank runs a micro-step at its micro-batch with its block policies applied (twice where the first is timed
        above the prediction on a rank: the least time, the most peak), and the search runs again, at most
        :data:`PRICING_ROUNDS` times, where a reading says the pick costs more than predicted:

        * its time above the prediction prices those policies up
          (:func:`~lightning_efficient.autofit.model.priced_by_reading`): the block profile prices a policy from its
          parts, not the saved-tensor hooks' own work or a writer thread competing with compute (plans with them ran
          13-17% slower than predicted on a CPU);
        * its peak above the budget (:func:`~lightning_efficient.autofit.model.peak_read_over`) widens the margin by
          the miss, as a measured peak does after the first steps, but before the first step:
          the block profile does not see what a block's recomputation or read-back allocates beyond its saved
          tensors, nor the peak line beyond the sizes measured with every block kept (a new user's 3-layer LSTM under
          hetero_ddp, one block on disk at 16 samples: predicted 49 MiB, 86 measured in the fit).

        A plan keeping every block is timed and measured by the measured sizes already."""
        lockstep = _in_lockstep(pl_module)
        for _ in range(PRICING_ROUNDS):
            if all(p == "keep" for r in plan.ranks for p in r.policies):
                return plan
            mine = plan.ranks[trainer.global_rank]
            # where the ranks run in step, a rank keeping every block runs the micro-step too (its reading unused)
            read = lockstep or any(p != "keep" for p in mine.policies)
            seconds: list[float | None] = [None] * trainer.world_size
            peaks: list[int | None] = [None] * trainer.world_size
            repriced: list[RankProfile | None] = [None] * trainer.world_size
            for _ in range(2):
                reading, failure = None, None
                try:
                    reading = self._read_with_policies(mine, trainer, pl_module, batches) if read else None
                except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together
                    if is_out_of_memory(error) and not lockstep:
                        reading = RAN_OUT  # leaving here drops the step's tensors
                    else:
                        failure = error
                if reading == RAN_OUT:
                    free_what_running_out_left(pl_module.device)
                gathered = gather_or_raise_together(reading, failure, "AutoFit could not time its pick")
                if RAN_OUT in gathered:
                    break
                seconds = [s if g is None else g[1] if s is None else min(s, g[1]) for s, g in zip(seconds, gathered)]
                peaks = [p if g is None else g[0] if p is None else max(p, g[0]) for p, g in zip(peaks, gathered)]
                repriced = [None if s is None else priced_by_reading(p, c, s) for p, c, s in zip(self._profiles, plan.ranks, seconds)]
                if all(r is None for r in repriced):  # within the prediction (on the second attempt: at the lower reading)
                    break
            over = None if RAN_OUT in gathered else peak_read_over(plan, self._profiles, peaks)
            if RAN_OUT in gathered:  # that rank's micro-batch is planned no more, with any block policies
                ran_out = [c.micro_batch for c, g in zip(plan.ranks, gathered) if g == RAN_OUT]
                self._profiles = [_ran_out(p, c.micro_batch) if g == RAN_OUT else p
                                  for p, c, g in zip(self._profiles, plan.ranks, gathered)]
                notes.append(f"an earlier pick ran out of memory with its block policies applied (micro-batch "
                             f"{', '.join(map(str, ran_out))}): planned again below it")
            elif all(r is None for r in repriced) and over is None:
                return plan
            counts = "; ".join(policy_counts(r.policies) for r in plan.ranks)
            if any(r is not None for r in repriced):
                self._profiles = [p if r is None else r for p, r in zip(self._profiles, repriced)]
                slowest = max(s / c.micro_step_s for s, c, r in zip(seconds, plan.ranks, repriced) if r is not None)
                notes.append(f"an earlier pick's block policies ({counts}) ran {slowest - 1:.0%} above its predicted micro-step: "
                             "priced up by that reading and planned again")
            margin = None
            if over is not None:
                margin = min(0.95, plan.margin + over)
                notes.append(f"an earlier pick's block policies ({counts}) peaked {over:.1%} of the budget above its "
                             f"prediction when read, above the budget: planned again with margin {margin:.2f}")
            try:
                plan = again(self._profiles, margin)
            except BudgetTooSmall:
                if margin is None:
                    raise
                # nothing fits the wider margin: the pick stays (its block prices as read), at the margin it was planned
                # with, and the peak measured in the fit says what it does
                notes[-1] = (f"the pick's block policies ({counts}) peaked {over:.1%} of the budget above its "
                             f"prediction when read, above the budget; with margin {margin:.2f} no plan fits: kept")
                if any(r is not None for r in repriced):
                    notes[-2] = notes[-2].replace("an earlier pick's", "the pick's").replace(" and planned again", "")
                return plan
        return plan

    def _read_with_policies(self, choice: RankChoice, trainer: Trainer, pl_module: LightningModule,
                            batches: Any) -> tuple[int, float]:
        """``(peak bytes, seconds)`` of one forward and backward at ``choice``'s micro-batch with its block policies
        applied."""
        activations = None
        try:
            if any(p != "keep" for p in choice.policies):
                activations = ActivationMemory(policy=list(choice.policies), blocks=self.blocks)
                with _info_lines_left_out("ActivationMemory:"):  # they would describe the fit's blocks, which this is not
                    activations.on_fit_start(trainer, pl_module)
            return measure_peak(trainer.strategy, batches, choice.micro_batch, self._meter)
        finally:
            if activations is not None:
                activations._undo()

    def _blocks(self, pl_module: LightningModule, notes: list[str]) -> tuple[list, list[str] | None, tuple[str, ...]]:
        """The blocks to profile, the policies the user fixed (None: AutoFit chooses), the policies allowed."""
        policies = tuple(p for p in self.activation_policies if p != "offload" or pl_module.device.type == "cuda")
        user = self._user_activations
        if user is not None and user.plan is not None:
            notes.append(f"block policies kept as set by ActivationMemory(policy={user.policy!r}) (already applied, measured as they are)")
            return [], None, ("keep",)
        try:
            blocks = find_blocks(pl_module, user.blocks if user is not None else self.blocks)
        except ValueError as error:
            notes.append(f"block policies not planned: {error}")
            return [], None, ("keep",)
        if user is not None:
            # where the user's callback turns transformers' checkpointing off at its own start, it is off for the
            # measuring too (the fit's peak is that without it)
            user._take_over_transformers_checkpointing(pl_module, blocks)
            fixed = user.policy * len(blocks) if len(user.policy) == 1 else list(user.policy)
            notes.append(f"block policies kept as set by ActivationMemory(policy={user.policy!r})")
            return blocks, fixed, tuple(dict.fromkeys(("keep", *fixed)))
        if policies == ("keep",):
            return [], None, policies
        if transformers_checkpointing(pl_module, blocks):  # the user's setting, kept as AutoFit keeps theirs
            notes.append("block policies kept as transformers' gradient checkpointing sets them (gradient_checkpointing_enable(): "
                         "every layer recomputed; measured as it is)")
            return [], None, ("keep",)
        return blocks, None, policies

    def _optimizer_specs(self, trainer: Trainer, pl_module: LightningModule, notes: list[str]) -> list[OptimizerSpec]:
        strategy = trainer.strategy

        def own() -> list[torch.optim.Optimizer]:
            return list(strategy.optimizers)

        user = self._user_optimizer
        if user is not None:
            # (the same words whether it converted the optimizers before AutoFit's turn or not: a new user's trial)
            set_as = (f"EightBitOptimizer(bits={user.bits}" + (", paged=True" if user.paged else "")
                      + (f", offload={user.offload!r}" if user.offload else "") + ")")
            notes.append(f"optimizer states kept as set by {set_as}")
            if any(isinstance(o, eight_bit_classes()) for o in strategy.optimizers) or user.bits == 32:
                return [OptimizerSpec("as set", own, own=True)]
            return [self._twin_spec("as set", trainer, pl_module, paged=user.paged, offload=bool(user.offload), like=user)]
        on_cuda = pl_module.device.type == "cuda"
        if all(is_stateless(o) for o in strategy.optimizers):
            notes.append("the optimizer keeps no state: nothing to hold in 8 bits")
            return [OptimizerSpec("32-bit", own, own=True)]
        specs = [OptimizerSpec("32-bit", own, own=True)] if "32-bit" in self.optimizer_options else []
        names = [n for n in self.optimizer_options if n != "32-bit" and (on_cuda or n not in _CUDA_ONLY)]
        if not specs and not names:  # only CUDA options asked for, on CPU
            notes.append("the optimizer options asked for need CUDA; 8-bit measured instead")
            names = ["8-bit"]
        for name in names:
            reason = _cannot_build(name, strategy.optimizers)
            if not reason and not EightBitOptimizer(min_8bit_size=self.min_8bit_size).holds_8bit_states(own(), pl_module):
                reason = (f"no parameter would hold 8-bit states (each below min_8bit_size={self.min_8bit_size:,} or an "
                          "embedding, kept 32-bit)")
            if reason:
                notes.append(f"optimizer states {name} not considered: {reason}")
                continue
            specs.append(self._twin_spec(name, trainer, pl_module, paged=name == "8-bit paged", offload=name == "8-bit offload"))
        if not specs:
            notes.append("optimizer states kept as the module built them")
            specs.append(OptimizerSpec("32-bit", own, own=True))
        return specs

    def _twin_spec(self, name: str, trainer: Trainer, pl_module: LightningModule, *, paged: bool, offload: bool,
                   like: EightBitOptimizer | None = None) -> OptimizerSpec:
        settings = {} if like is None else {"keep_32bit": like.keep_32bit or None, "embeddings_32bit": like.embeddings_32bit,
                                            "strict": like.strict}
        builder = EightBitOptimizer(min_8bit_size=like.min_8bit_size if like else self.min_8bit_size, **settings)
        return OptimizerSpec(name, lambda: builder.build_twins(list(trainer.strategy.optimizers), pl_module, paged=paged, offload=offload),
                             builder.drop_overrides)

    # -- applying -------------------------------------------------------------------------------
    def _apply(self, plan: FitPlan, trainer: Trainer, pl_module: LightningModule, token_counts: dict[str, Any] | None = None) -> None:
        mine = plan.ranks[trainer.global_rank]
        built = trainer.fit_loop._combined_loader is not None
        if self._heterogeneous(trainer):
            strategy = trainer.strategy
            self._undo_settings.append((strategy, "max_micro_batch", strategy.max_micro_batch))
            strategy.max_micro_batch = plan.micro_batches
            trainer.fit_loop._combined_loader = None  # built again under the plan's caps, as below
        elif plan.accumulation is not None and self._micro_searched and lightning_hasattr(pl_module, "batch_size"):
            current = lightning_getattr(pl_module, "batch_size")
            if current != mine.micro_batch:
                self._undo_settings.append(("batch_size", current))
                lightning_setattr(pl_module, "batch_size", mine.micro_batch)
                # a training DataLoader built already (reading trainer.estimated_stepping_batches in configure_optimizers
                # builds it, for a OneCycleLR's total_steps: the same number of optimizer steps at the plan's global
                # batch) is built again, at the plan's micro-batch, when the loop starts
                trainer.fit_loop._combined_loader = None
                self._rescale_batch_counts(trainer, current, mine.micro_batch, plan.accumulation)
                # (a StepTokenMean the user set does what this would)
                if not token_mean_taken_elsewhere(trainer) and not any(isinstance(c, StepTokenMean) for c in trainer.callbacks):
                    self._token_mean.install(trainer, pl_module, f"one batch of {current}", token_counts)
                _warn_of_batch_statistics(pl_module, current, mine.micro_batch)
            self._undo_settings.append((trainer, "accumulate_grad_batches", trainer.accumulate_grad_batches))
            self._users_accumulation = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = plan.accumulation
        if self._user_activations is None and ((mine.policies and any(p != "keep" for p in mine.policies)) or self._activations):
            policies = list(mine.policies) or ["keep"]
            if self._activations is None:
                self._activations = self._own_activations(policies)
            self._activations.policy = policies
            callbacks = trainer.callbacks
            if self._activations not in callbacks:  # Lightning calls its on_fit_start next, in this same loop
                callbacks.insert(callbacks.index(self) + 1, self._activations)
        if self._optimizer is not None:
            eight = plan.optimizer.startswith("8-bit")
            self._optimizer.bits = 8 if eight else 32
            self._optimizer.paged = plan.optimizer == "8-bit paged"
            self._optimizer.offload = "cpu" if plan.optimizer == "8-bit offload" else None
        self._built_again = built and trainer.fit_loop._combined_loader is None
        if self._built_again:
            self._build_training_loader_again(trainer)

    def _build_training_loader_again(self, trainer: Trainer) -> None:
        """Build the training DataLoader Lightning built before the plan (``trainer.estimated_stepping_batches`` read in
        ``configure_optimizers``) again now, from the random streams as that build found them, then put the streams back
        as they are (:class:`~lightning_efficient.autofit.fit_inputs.StreamsAtTheLastBuild`): built again by the loop, it
        drew a second time, and a shuffled DataLoader trained other samples at every step than plain Lightning's (a new
        user's OneCycleLR: weights 3e-2 apart)."""
        with self._last_build.replayed():
            trainer.fit_loop.setup_data()

    def _load_the_checkpoints_data_position(self, trainer: Trainer) -> None:
        """The checkpoint's DataLoader position, which Lightning restores after ``on_fit_start``, into the DataLoader
        built again there, and the iterator made again from it (from the streams of the build: no draw plain Lightning
        does not make), as the loop's own build after the restore loaded it before AutoFit built it in ``on_fit_start``
        (a review: a mid-epoch resume trained the epoch's first batches again). Plain Lightning, whose DataLoader built
        in ``configure_optimizers`` is not built again after the restore, leaves the position unread and trains the
        epoch's first batches again; the heterogeneous strategies load it too (there the balancer does)."""
        if self._built_again and not self._heterogeneous(trainer):
            load_pending_position(trainer.fit_loop, at_an_epochs_end=False, iterator_streams=self._last_build.replayed)

    def _rescale_batch_counts(self, trainer: Trainer, batch: Any, micro: int, accumulation: int) -> None:
        """Lightning's counts of training batches (:mod:`lightning_efficient._batch_counts`) counted the user's
        DataLoader batches of ``batch``: they count the plan's micro-batches of ``micro`` while the fit runs, so the
        same samples train between the same checks (a new user's trial: ``limit_train_batches=2`` trained half the
        samples). A DataLoader that drops its last incomplete batch drops less at the micro-batch: the epoch is then
        limited to the micro-batches of the user's whole batches (a review: 10 samples in batches of 4 trained 10 in 3
        steps, where plain Lightning trains 8 in 2). Schedulers stepped every few batches step after the user's steps
        (:class:`~lightning_efficient._batch_counts.SchedulerFrequencies`, ``accumulation`` micro-batches a step)."""
        if isinstance(batch, bool) or not isinstance(batch, int):
            return
        settings = batch_settings(trainer)
        counting = dict(settings)
        epoch = None
        rank_epoch = self._rank_epoch(trainer)
        if rank_epoch is not None:  # (batches, micro-batches) of an epoch
            samples, drops_last = rank_epoch
            if drops_last:  # the micro-batches that hold the user's whole batches, the samples plain Lightning trains
                whole = samples // batch
                epoch = (whole, whole_batches_in_micro_batches(samples, batch, micro))
                limit = counting.get("limit_train_batches")
                if epoch[1] < samples // micro and isinstance(limit, float) and limit == 1.0:
                    counting["limit_train_batches"] = whole  # (the whole epoch: its micro-batches, below)
            else:
                epoch = (math.ceil(samples / batch), math.ceil(samples / micro))
        epoch_batches = None if epoch is None else epoch[0]
        counts = counted_batches(counting, epoch_batches)
        self._scheduler_frequencies.count(accumulation, trainer.accumulate_grad_batches, counts, epoch_batches)
        if not counts:
            return
        counted = counts_in_micro_batches(trainer, counts, Fraction(batch, micro), epoch=epoch, who="AutoFit",
                                          batch_words=f"batches of {batch} samples", micro_words=f"micro-batches of {micro}")
        if "val_check_interval" in counts and epoch is not None:
            self._epoch_end_validation.keep(trainer, batches_trained(counts, epoch[0]), counts["val_check_interval"])
        for name, value in counted.items():
            self._undo_settings.append((trainer, name, settings[name]))
            setattr(trainer, name, value)
        self._undo_settings += checkpoint_timing_kept(trainer, settings, counted)

    @staticmethod
    def _rank_epoch(trainer: Trainer) -> tuple[int, bool] | None:
        """This rank's samples in an epoch and whether the training DataLoader drops its last incomplete batch (None
        where the dataset has no length): what the DataLoader's sampler draws, split over the ranks where Lightning puts
        a ``DistributedSampler`` in its place (a review: with ``use_distributed_sampler=False`` every rank draws the whole
        dataset, and an epoch counted as half of it stepped a scheduler after every step of its second half)."""
        try:
            loader = _users_loader(trainer)
            samples = len(loader.sampler)
        except Exception:  # noqa: BLE001 - no loader or an iterable dataset: nothing to count by
            return None
        distributed = trainer.world_size > 1 and trainer._accelerator_connector.use_distributed_sampler
        if distributed and not isinstance(loader.sampler, DistributedSampler):
            samples = math.ceil(samples / trainer.world_size)
        return samples, bool(getattr(loader, "drop_last", False))

    def _undo(self, pl_module: LightningModule) -> None:
        self._token_mean.remove()
        self._scheduler_frequencies.put_back()
        self._epoch_end_validation.put_back()
        for item in reversed(self._undo_settings):
            if item[0] == "batch_size":
                lightning_setattr(pl_module, "batch_size", item[1])
            else:
                setattr(*item)
        self._undo_settings = []

    # -- measured beside predicted --------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plan = self._plan
        if plan is not None and plan.accumulation is not None and any(isinstance(s, tuple) and s[0] == "batch_size" for s in self._undo_settings):
            loader = trainer.train_dataloader
            size = getattr(loader, "batch_size", None)
            wanted = plan.ranks[trainer.global_rank].micro_batch
            if size is not None and size != wanted:
                raise ValueError(
                    f"AutoFit set batch_size={wanted}, but the training DataLoader has batch_size={size}: train_dataloader() "
                    "does not read the `batch_size` attribute, so the global batch would change. Build the DataLoader with "
                    "self.batch_size, or AutoFit(search_micro_batch=False)"
                )
        self._count_the_checkpoints_batches_again(trainer)
        self._load_the_checkpoints_data_position(trainer)
        if self._meter is not None:
            self._meter.reset()
        self._resumed_step_saved.fit_started()  # (the plan's micro-batches split each step)

    def _count_the_checkpoints_batches_again(self, trainer: Trainer) -> None:
        """The restored loop's batch counts in this plan's micro-batches, where the checkpoint's fit drew batches of
        another size (a plain Lightning fit's, or a plan whose micro-batch no longer fits)."""
        plan, checkpoints, self._checkpoint_micro_batch = self._plan, self._checkpoint_micro_batch, None
        if plan is None or checkpoints is None or plan.accumulation is None:
            return
        micro = plan.ranks[trainer.global_rank].micro_batch
        counted = restored_batches_counted_again(trainer, Fraction(checkpoints, micro))
        users = self._users_accumulation
        if users and plan.accumulation % users == 0:  # (each batch of the user's: this many of the plan's micro-batches)
            moved = restored_position_moved_to_the_batchs_start(trainer, plan.accumulation // users)
            if moved is not None:
                rank_zero_info(f"AutoFit: the checkpoint was saved {moved[0]} micro-batch(es) into one of your batches "
                               f"(split in {moved[1]}), whose gradients are in no checkpoint: that batch trains from its "
                               "first micro-batch again, as plain Lightning trains it again.")
        if counted is None or epoch_ended(trainer.fit_loop.epoch_loop.batch_progress):  # (the next epoch starts afresh)
            return
        before, after, inside = counted
        said = (f"AutoFit: the checkpoint counted {before} batch(es) of {checkpoints} samples into its epoch: {after} "
                f"micro-batch(es) of {micro} now, so the epoch ends, steps and validates where it would have")
        if inside:
            rank_zero_warn(f"{said}, but for the position, {before * checkpoints} samples in, which falls inside a "
                           f"micro-batch of {micro}: counted down to {after}, the epoch trains up to one micro-batch more "
                           "than the checkpoint left.")
        else:
            rank_zero_info(f"{said}.")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._trainable_planned is not None and self._plan is not None:
            trainable = self._trainable_planned.changed_at_step_start(pl_module, batch_idx, trainer.accumulate_grad_batches)
            if trainable is not None:
                self._plan_for_what_trains_now(trainer, pl_module, trainable)
        self._scheduler_frequencies.before_batch(trainer, batch_idx)
        self._resumed_step_saved.before_batch(trainer)
        if self._step_started is None:
            self._step_started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._plan is None or self._measured is not None or self._step_started is None:
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        now = time.perf_counter()
        self._step_times.append(now - self._step_started)
        self._step_started = now
        if len(self._step_times) < self.report_after_steps:
            return
        # the first step is the slowest (allocations, lazy initialisation): the median of the others
        times = self._step_times[1:] or self._step_times
        mine = {"peak_bytes": float(self._meter.read() if self._meter else 0), "step_s": statistics.median(times)}
        self._measured = gather_objects(mine)
        self._measured_against = [r.peak_bytes for r in self._plan.ranks]  # a re-plan below replaces the plan
        steps = f"{len(self._step_times)} step{'s' if len(self._step_times) > 1 else ''}"
        rank_zero_info(f"AutoFit: measured after {steps}\n" + plan_table(self._plan, self._measured))
        self._replan_if_above(trainer, pl_module)

    def _replan_if_above(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Plan the block policies again with a wider margin where a measured peak is above its prediction.

        Every rank decides alike (from the all-gathered figures) and computes the same plan, then switches
        its own blocks (an :class:`ActivationMemory` is added on a rank that had none)."""
        plan, measured = self._plan, self._measured
        assert plan is not None and measured is not None
        unprofiled, self._unprofiled = self._unprofiled, None  # needed by this re-plan only (it holds a batch source)
        over, worst = max(((m["peak_bytes"] - r.peak_bytes) / b, i) for i, (m, r, b) in enumerate(zip(measured, plan.ranks, plan.budgets)))
        if over <= 0:
            return
        # what every message below starts with: the figures, then the miss as a share of the budget (what a margin is)
        whose = "the" if len(plan.ranks) == 1 else f"rank {worst}'s"
        missed = (f"AutoFit: {whose} measured peak, {measured[worst]['peak_bytes'] / 2**20:,.1f} MiB, is above its "
                  f"prediction, {plan.ranks[worst].peak_bytes / 2**20:,.1f} MiB, by {over:.1%} of its budget "
                  f"({plan.budgets[worst] / 2**20:,.1f} MiB)")
        margin = min(0.95, plan.margin + over)
        widened = f"{margin:.2f} (the plan's margin plus the miss, {over:.1%} of the budget)"
        above_usable = any(m["peak_bytes"] > b * (1 - plan.margin) for m, b in zip(measured, plan.budgets))
        above_budget = any(m["peak_bytes"] > b for m, b in zip(measured, plan.budgets))
        # the margin is for what a prediction misses: a plan measured within its budget fits, and the next fit needs a
        # margin as wide as this miss (not this one's widened by it, which grew at every fit taking the advice)
        advised = min(0.95, math.ceil((over + 0.01) * 100) / 100)
        # a rank over its budget whose plan was predicted above the budget less the margin (the leanest, taken after an
        # unfreeze) missed it by what no margin mends: then a larger budget, holding the measured peak within it less
        # the margin (the wider of the two: a larger budget lets the search take a larger plan, which may miss alike)
        fits = budget_advice(plan, measured, advised) or f"fit again with AutoFit(margin={advised:.2f}){_WIDER_MARGIN}"
        took_the_miss = (f"; it is within the budget on every rank (above it less the margin, {plan.margin:.2f}): the "
                         "margin took the miss, and the fit goes on as planned")
        if unprofiled is not None and self._profiles:
            if _keep_still_fits(plan, self._profiles, margin):
                rank_zero_info(f"{missed}; with margin {widened} every block kept still fits: the plan stays as it is.")
                return
            rank_zero_info(f"{missed}: profiling the blocks (not needed before the first step)")
            # as before the first step: no collection frees the fit's garbage between readings, and the code only
            # profiling ran does not stay resident
            older = older_collections()
            if pl_module.device.type != "cuda":
                self._code_pages.snapshot()
            with outside_training(pl_module.device):
                try:
                    with random_streams_restored(pl_module.device), automatic_collection_paused():
                        profiled = self._with_blocks(self._profiles, trainer.strategy, unprofiled, mid_fit=True)
                finally:
                    self._release_what_measuring_left(older, pl_module.device)
            if profiled is None:
                return
            self._profiles = profiled
            plan.notes = [n for n in plan.notes if n != NOT_PROFILED]
        if not self._profiles or self._user_activations is not None or not self._profiles[0].blocks:
            if not above_usable:  # the plan is measured to fit: nothing to change
                rank_zero_info(f"{missed}; it is within the budget less the margin ({plan.margin:.2f}) on every rank: "
                               "the fit goes on as planned.")
                return
            if not above_budget:
                rank_zero_info(f"{missed}{took_the_miss}.")
                return
            why = ("the plan was reused from the checkpoint, not measured, so there is no block profile to plan them "
                   "from" if not self._profiles else "the block policies are your ActivationMemory's"
                   if self._user_activations is not None else "no blocks were found to change")
            rank_zero_warn(f"{missed}. AutoFit changes only block policies mid-fit, and {why}: the fit goes on as "
                           f"planned; for a plan that fits, {fits}.")
            return
        # the micro-batch and the optimizer stay (changing them mid-fit would change the data order and the
        # states); each rank's block policies are chosen again for the wider margin
        policies = tuple(p for p in self.activation_policies if p != "offload" or pl_module.device.type == "cuda")
        try:
            again = replan(plan, self._profiles, margin=margin, policies=policies)
        except ValueError:
            if not above_usable:  # a wider margin than the plan's own is what no block plan meets: the plan fits
                rank_zero_info(f"{missed}; with margin {widened} no block plan fits at this micro-batch and precision, and "
                               f"it is within the budget less the margin ({plan.margin:.2f}) on every rank: the fit goes "
                               "on as planned.")
                return
            if not above_budget:
                rank_zero_info(f"{missed}; with margin {widened} no block plan fits at this micro-batch and precision"
                               f"{took_the_miss}.")
                return
            rank_zero_warn(f"{missed}, and with margin {widened} no block plan fits at this micro-batch and precision "
                           f"(AutoFit changes only block policies mid-fit): the fit goes on as planned; for a plan that "
                           f"fits, {fits}.")
            return
        if [r.policies for r in again.ranks] == [r.policies for r in plan.ranks]:
            rank_zero_info(f"{missed}; with margin {widened} the block policies stay as they are.")
            return
        again.notes.append(f"block policies planned again with margin {margin:.2f} after a measured peak {over:.1%} of the "
                           "budget above its prediction")
        rank_zero_info(f"{missed}; block policies planned again with margin {margin:.2f}:\n" + plan_table(again))
        self._switch_policies(list(again.ranks[trainer.global_rank].policies), trainer, pl_module)
        self._plan = again
        if self._plan_key is not None:  # (taken back for these parameters, it is this plan now)
            self._plans_by_what_trains[self._plan_key] = (again, self._profiles, self._unprofiled)

    def _plan_for_what_trains_now(self, trainer: Trainer, pl_module: LightningModule, trainable: Trainable) -> None:
        """Measure the run again and choose the block policies again: the parameters that train changed since the plan
        was made (a ``BaseFinetuning`` callback unfroze layers, whose gradients, optimizer states and saved activations
        the plan did not hold; or froze some). Every rank must change what trains at the same step (a
        ``BaseFinetuning`` callback does): every rank measures there, together. As for a re-plan after a measured peak,
        the micro-batch and the optimizer states stay (changing them mid-fit would change the data order and the
        states); where no block policies fit on a rank, that rank takes those predicted to peak the least and a warning
        gives the figures; where measuring fails (out of memory), the plan stays, with a warning. A set planned for
        earlier in this fit, with the optimizer holding as many state bytes as then, takes that plan back unmeasured (a
        set frozen and unfrozen in turn); where the optimizer holds more (states of parameters trained since), it is
        measured again. The measured figures are read again after
        ``report_after_steps`` steps; what measuring holds and takes is left out of the fit's meters
        (:func:`~lightning_efficient.memory.outside_training`)."""
        plan = self._plan
        assert plan is not None and self._meter is not None and self._trainable_planned is not None
        planned, self._trainable_planned = self._trainable_planned, trainable
        changed = (f"AutoFit: {trainable.elements:,} parameters train now ({trainable.tensors} tensors), "
                   f"{planned.elements:,} when the plan was made ({planned.tensors} tensors)")
        _warn_if_ddp_leaves_them_unsynchronised(trainer, pl_module, self._trained_when_wrapped)
        key = (trainable, _held_state_bytes(trainer))
        known = self._plans_by_what_trains.get(key)
        if all(gather_objects(known is not None)):  # (every rank alike: where one would measure, every rank does)
            assert known is not None
            rank_zero_info(f"{changed}: planned for these, with the optimizer's states as they are, earlier in this fit; "
                           "that plan is taken back:\n" + plan_table(known[0]))
            self._plan_key = key
            self._take_plan(*known, trainer, pl_module)
            return
        strategy, rank = trainer.strategy, trainer.global_rank
        blocks, fixed, policies = self._blocks(pl_module, [])  # (the plan's notes say already whose they are)
        # measured with every block kept, as before the first step (AutoFit's own policies are put back or changed below)
        mine = self._activations if self._user_activations is None and self._activations in trainer.callbacks else None
        if mine is not None:
            mine._undo()
        micro = plan.ranks[rank].micro_batch
        optimizer = OptimizerSpec(plan.optimizer, lambda: list(strategy.optimizers), own=True)  # (its states as they are)
        older = older_collections()
        if pl_module.device.type != "cuda":
            self._code_pages.snapshot()
        measuring = PeakMemory(pl_module.device, self._start_rss)
        profiles, ran_out = None, None
        with outside_training(pl_module.device), random_streams_restored(pl_module.device), automatic_collection_paused():
            measuring.reset(release=False)
            try:
                profiles = self._every_ranks_profile(
                    trainer, _measuring_batches(strategy, _users_loader(trainer)), (micro, micro), options=[optimizer],
                    blocks=blocks, policies=policies, fixed=fixed, budget=lambda: plan.budgets[rank], margin=plan.margin,
                    failing="AutoFit could not measure again", running_out_told=True)
            except MeasuringRanOut as error:  # every rank gets it alike: each keeps the plan
                ran_out = str(error)
            finally:  # (after a caught error is dropped: what it held is freed too)
                measured_peak = measuring.read()
                if ran_out is not None:
                    free_what_running_out_left(pl_module.device)
                self._release_what_measuring_left(older, pl_module.device)
        if ran_out is not None:
            pl_module.zero_grad(set_to_none=True)
            rank_zero_warn(f"{changed}. Measuring them ran out of memory ({ran_out}); the plan stays as it was, which was "
                           "not measured for these parameters. For a plan that fits, fit with them trainable from the start "
                           "or give a larger budget.")
            self._take_plan(plan, self._profiles, self._unprofiled, trainer, pl_module, unwrapped=mine is not None)
            return
        assert profiles is not None
        try:
            again = replan(plan, profiles, margin=plan.margin, policies=policies)
            missed = ""
        except BudgetTooSmall:
            again = replan(plan, profiles, margin=plan.margin, policies=policies, leanest=True)
            missed = "; ".join(f"rank {r}: {c.peak_bytes / 2**20:,.1f} MiB predicted, {b * (1 - plan.margin) / 2**20:,.1f} MiB usable"
                               for r, (c, b) in enumerate(zip(again.ranks, again.budgets)) if c.peak_bytes > b * (1 - plan.margin))
        if self._user_activations is not None and self._user_activations.plan is not None:
            for choice in again.ranks:  # (measured as they are: the user's, the same on every rank)
                choice.policies = list(self._user_activations.plan)
        # (the blocks were profiled now where there are any; an earlier change's note is this one's now)
        again.notes = [*(n for n in plan.notes if (n != NOT_PROFILED or not blocks) and not n.startswith(_MEASURED_AGAIN)),
                       f"{_MEASURED_AGAIN} {trainer.global_step}: {trainable.elements:,} parameters train, "
                       f"{planned.elements:,} when planned (micro-batch and optimizer states kept)"]
        if missed:
            then = ("the fit goes on with the block policies predicted to peak the least" if self._user_activations is None
                    else "the fit goes on with your ActivationMemory's block policies")
            rank_zero_warn(f"{changed}. Measured again: no block policies fit at micro-batch(es) {plan.micro_batches} and "
                           f"optimizer states {plan.optimizer} ({missed}); {then}. For a plan that fits, give a larger "
                           "budget, or fit with these parameters trainable from the start for AutoFit to choose the "
                           "micro-batch and optimizer states for them.")
        budget = plan.budgets[rank]
        above = ("" if measured_peak <= budget else ", above the budget: measuring holds every block's activations at the "
                 "plan's micro-batch (on CPU also a copy of the run's state); on a GPU of the budget's size such a reading "
                 "runs out of memory, and the plan stays")
        rank_zero_info(f"{changed}: measured again at the plan's micro-batch (peak while measuring {measured_peak / 2**20:,.1f} "
                       f"MiB{above}); " + ("block policies planned again:" if self._user_activations is None
                                          else "block policies kept as set:") + "\n" + plan_table(again))
        self._plans_by_what_trains[key], self._plan_key = (again, profiles, None), key
        self._take_plan(again, profiles, None, trainer, pl_module, unwrapped=mine is not None)
        # (no gradients left on FSDP2's parameters, as after measuring before the first step; Lightning sets them to None
        # before this step's backward in any case)
        pl_module.zero_grad(set_to_none=True)

    def _take_plan(self, plan: FitPlan, profiles: list[RankProfile], unprofiled: _Unprofiled | None, trainer: Trainer,
                   pl_module: LightningModule, *, unwrapped: bool = False) -> None:
        """``plan`` (made from ``profiles``, with ``unprofiled`` blocks for a re-plan to profile) from this step on: this
        rank's block policies applied where AutoFit sets them (``unwrapped``: AutoFit's ActivationMemory unwrapped its
        blocks, which are wrapped again whatever the policies), the measured figures read again for it after
        ``report_after_steps`` steps."""
        assert self._meter is not None
        self._plan, self._profiles, self._unprofiled = plan, profiles, unprofiled
        # (none: the blocks were not profiled, every one kept)
        policies = list(plan.ranks[trainer.global_rank].policies) or ["keep"]
        applied = (self._activations.plan if self._activations is not None and self._activations in trainer.callbacks
                   and not unwrapped else None)
        if self._user_activations is None and applied != (policies * len(applied) if applied and len(policies) == 1 else policies):
            self._switch_policies(policies, trainer, pl_module)
        self._measured, self._step_times, self._step_started, self._measured_against = None, [], None, []
        self._meter.reset()

    def _own_activations(self, policies: list[str]) -> ActivationMemory:
        """The :class:`ActivationMemory` AutoFit adds, under ``policies`` (its messages name AutoFit's plan as their
        setter, not the user)."""
        activations = ActivationMemory(policy=policies, blocks=self.blocks)
        activations._policies_chosen_by = "AutoFit"
        return activations

    def _switch_policies(self, policies: list[str], trainer: Trainer, pl_module: LightningModule) -> None:
        """This rank's blocks under ``policies`` from the next step on (mid-fit)."""
        if self._activations is None:
            if all(p == "keep" for p in policies):
                return
            self._activations = self._own_activations(policies)
            trainer.callbacks.insert(trainer.callbacks.index(self) + 1, self._activations)
        else:
            self._activations._undo()
            self._activations.policy = policies
            if self._activations not in trainer.callbacks:
                trainer.callbacks.insert(trainer.callbacks.index(self) + 1, self._activations)
        self._activations.on_fit_start(trainer, pl_module)  # wired as at the start of fit, which has passed

    # -- clean-up -------------------------------------------------------------------------------
    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._last_build.stop()
        self._restored, self._checkpoint_states = None, {}  # a checkpoint's plan belongs to its own fit
        self._unprofiled = None  # (its batches hold the fit's DataLoader)
        self._undo(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._last_build.stop()
        self._restored, self._checkpoint_states, self._unprofiled = None, {}, None
        self._undo(pl_module)  # Lightning skips teardown when fit raises

    def memory_figures(self) -> dict[str, int]:
        """This rank's budget, predicted peak and micro-batch (and measured peak once read, beside the prediction it was
        read against; after a re-plan, the new plan's prediction too), for :class:`MemoryReport`."""
        if self._plan is None or self._trainer_rank >= len(self._plan.ranks):
            return {}
        mine = self._plan.ranks[self._trainer_rank]
        figures = {"autofit_budget_bytes": self._plan.budgets[self._trainer_rank], "autofit_predicted_peak_bytes": mine.peak_bytes,
                   "autofit_micro_batch": mine.micro_batch}
        if self._measured is not None:
            figures["autofit_measured_peak_bytes"] = int(self._measured[self._trainer_rank]["peak_bytes"])
            against = self._measured_against[self._trainer_rank]
            if against != mine.peak_bytes:
                figures["autofit_predicted_peak_bytes"], figures["autofit_replanned_peak_bytes"] = against, mine.peak_bytes
        return figures

    @property
    def may_use_8bit(self) -> bool:
        """Whether the search may choose 8-bit optimizer states (which load bitsandbytes)."""
        return any(o != "32-bit" for o in self.optimizer_options)

    @property
    def plan(self) -> FitPlan | None:
        """The plan of the current or last fit (None before one is made)."""
        return self._plan

    @property
    def profiles(self) -> list[RankProfile]:
        """What each rank measured for the plan (empty when it came from a checkpoint)."""
        return list(self._profiles)

    @property
    def measured(self) -> list[dict[str, float]] | None:
        """Each rank's measured peak bytes and median step seconds after ``report_after_steps`` steps."""
        return self._measured

