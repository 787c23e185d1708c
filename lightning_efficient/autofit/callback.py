"""``AutoFit``: give it the memory each device has; it measures the run and sets micro-batch (with
gradient accumulation keeping the global batch), each block's activation policy and the optimizer
states' precision for the most tokens per second that fit."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loops.utilities import _is_max_limit_reached
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import _TunerExitException
from typing_extensions import override

from lightning_efficient import _batch_counts
from lightning_efficient._batch_counts import (
    SchedulerFrequencies,
    epoch_ended,
)
from lightning_efficient._code_pages import CodePages
from lightning_efficient._distributed import gather_objects, gather_or_raise_together
from lightning_efficient._torch import Trainable
from lightning_efficient._validation import refuse_unless, require, require_int
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.activations.policies import POLICIES
from lightning_efficient.autofit.applying import _Applying
from lightning_efficient.autofit.budget import validate_budget
from lightning_efficient.autofit.evaluation import EvaluationAtYourBatch
from lightning_efficient.autofit.fit_inputs import (
    StreamsAtTheLastBuild,
    agreed_restored_state,
    checkpoint_contents,
    fit_checkpoint_path,
    random_streams_restored,
)
from lightning_efficient.autofit.model import (
    FitPlan,
    RankProfile,
    plan_table,
)
from lightning_efficient.autofit.notes import FREED_HEAP_RESIDENT, _allocator_notes
from lightning_efficient.autofit.planning import _Planning
from lightning_efficient.autofit.readings import (
    _Readings,
    _Unprofiled,
)
from lightning_efficient.autofit.replanning import _held_state_bytes, _Replanning
from lightning_efficient.autofit.token_mean import BatchTokenMean
from lightning_efficient.memory import (
    PeakMemory,
    automatic_collection_paused,
    fit_start_rss_bytes,
    older_collections,
)
from lightning_efficient.optim._bnb import bitsandbytes
from lightning_efficient.optim.callback import EightBitOptimizer

OptimizerChoice = Literal["32-bit", "8-bit", "8-bit paged", "8-bit offload"]
Policy = Literal["keep", "checkpoint", "selective", "offload", "disk"]


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


class AutoFit(_Planning, _Readings, _Applying, _Replanning, Callback):
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
        #: after a ``plan_only`` fit whose plan splits an epoch's short last batch of yours: that batch's samples, which
        #: AutoFit weighs as plain Lightning's step does as it fits (``lightning-efficient plan`` then keeps AutoFit)
        self.short_last_batch: int | None = None
        self._users_accumulation: int | None = None  # the trainer's accumulate_grad_batches before the plan's
        self._epoch_started_over: int | None = None  # an epoch resumed mid-way whose DataLoader starts its data over
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
        self._evaluation = EvaluationAtYourBatch()  # validation and test at your batches where the plan splits them
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
        self.batch_counting, self.epoch_micro_batches, self.short_last_batch = [], None, None
        self._users_accumulation = None
        self._trainer_rank = trainer.global_rank
        self._meter = PeakMemory(pl_module.device, self._start_rss)
        restored, self._restored = self._restored, None
        states, self._checkpoint_states = self._checkpoint_states, {}
        if restored is None and getattr(trainer.strategy, "restore_checkpoint_after_setup", False):
            # ModelParallelStrategy / hetero_fsdp load checkpoints after on_fit_start: this callback's part as read in setup
            saved = states.get(self.state_key)
            restored = dict(saved) if saved else None
        if not self.plan_only and not _trains_a_step(trainer):
            rank_zero_info("AutoFit: this fit trains no step (max_steps or max_epochs reached already, or "
                           "limit_train_batches=0): nothing measured or planned.")
            self._draw_the_checkpoints_micro_batches(restored, trainer, pl_module)
            return
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
            self.short_last_batch = self._short_last_batch(trainer, plan)
            raise _TunerExitException()  # Lightning tears the fit down and returns from fit, as after its own tuners
        self._checkpoint_micro_batch = self._checkpoints_micro_batch(restored, trainer)
        # (a checkpoint's running token count: a resumed first step rounds as the uninterrupted run's)
        self._apply(plan, trainer, pl_module, token_counts=restored)


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


    def init_args(self) -> dict[str, Any]:
        """The constructor's arguments this callback holds (``plan_only`` left out): what a config file gives to build
        it again."""
        return {"budget": self.budget, "margin": self.margin, "search_micro_batch": self.search_micro_batch,
                "micro_batches": self.micro_batches, "activation_policies": list(self.activation_policies),
                "optimizer_options": list(self.optimizer_options), "blocks": self.blocks,
                "min_8bit_size": self.min_8bit_size, "report_after_steps": self.report_after_steps}


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
        # a mid-epoch resume's DataLoader that keeps no position (plain Lightning's neither) draws the epoch from its start
        progress = trainer.fit_loop.epoch_loop.batch_progress
        mid_epoch = progress.current.ready > 0 and not epoch_ended(progress)
        keeps_position = callable(getattr(trainer.train_dataloader, "load_state_dict", None))
        self._epoch_started_over = trainer.current_epoch if mid_epoch and not keeps_position else None
        if self._meter is not None:
            self._meter.reset()
        self._resumed_step_saved.fit_started()  # (the plan's micro-batches split each step)


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
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._run_the_sampler_to_its_end_as_yours_would(trainer)

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


    # -- evaluation and clean-up -----------------------------------------------------------------
    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation.evaluation_started()

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation.evaluation_started()

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

