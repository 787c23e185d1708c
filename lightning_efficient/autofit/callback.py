"""``AutoFit``: give it the memory each device has; it measures the run and sets micro-batch (with
gradient accumulation keeping the global batch), each block's activation policy and the optimizer
states' precision for the most tokens per second that fit."""

from __future__ import annotations

import statistics
import time
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_efficient._distributed import gather_objects, gather_or_raise_together
from lightning_efficient._validation import require, require_int
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.activations.discovery import find_blocks
from lightning_efficient.activations.policies import POLICIES
from lightning_efficient.autofit.budget import rank_budget, validate_budget
from lightning_efficient.autofit.measure import OptimizerSpec, can_resize, measure_rank, sample_batch
from lightning_efficient.autofit.model import FitPlan, RankProfile, plan_table, replan, search
from lightning_efficient.memory import ParameterStorages, PeakMemory, current_rss_bytes
from lightning_efficient.optim._bnb import bitsandbytes
from lightning_efficient.optim.callback import EightBitOptimizer
from lightning_efficient.optim.twins import eight_bit_classes

OptimizerChoice = Literal["32-bit", "8-bit", "8-bit paged", "8-bit offload"]
Policy = Literal["keep", "checkpoint", "selective", "offload", "disk"]
_CUDA_ONLY = ("8-bit paged", "8-bit offload")


class PlanReady(Exception):
    """Raised by ``AutoFit(plan_only=True)`` once the plan is printed: the fit stops before its first step."""

    def __init__(self, plan: FitPlan, table: str) -> None:
        super().__init__("AutoFit(plan_only=True): planned, not trained")
        self.plan = plan
        self.table = table


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
    and says so. The plan is saved in checkpoints; a resume with the same settings reuses it.

    What it sets: the micro-batch through the module's or datamodule's ``batch_size`` attribute (as
    Lightning's batch-size finder does) and ``trainer.accumulate_grad_batches`` so the global batch stays
    as configured; under ``hetero_ddp``/``hetero_fsdp`` each rank's ``max_micro_batch`` cap (the
    balancer shares the global batch by measured speed); the block policies through an
    :class:`ActivationMemory` it adds; the optimizer through an :class:`EightBitOptimizer` it adds. A user
    who also sets one of those callbacks keeps that setting (its policy or precision is then measured,
    not searched), and the plan says so. Put ``AutoFit`` before them in ``callbacks``.

    Memory is what :class:`~lightning_efficient.MemoryReport` measures: on CUDA
    ``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS above its RSS when the fit started.

    Args:
        budget: per device: bytes, a size string (``"6GiB"``), ``"auto"`` (CUDA: the device's memory less
            5%; CPU: the available memory shared by this host's ranks, less 5%), or a list with one per rank.
        margin: the fraction of each budget the predicted peak leaves free, for what a prediction misses.
        search_micro_batch: search the micro-batch (False: keep the DataLoader's).
        activation_policies: the block policies to choose from (``["keep"]``: activations are not planned).
            ``offload`` is considered on CUDA only.
        optimizer_options: the optimizer-state options to choose from; the paged and offloaded ones on CUDA only.
        blocks: which modules are blocks, as for :class:`ActivationMemory`.
        min_8bit_size: as for :class:`EightBitOptimizer`.
        report_after_steps: optimizer steps after which the measured figures are printed beside the predicted.
        plan_only: stop with :class:`PlanReady` once the plan is printed (what ``lightning-efficient plan`` does).

    Raises:
        ValueError: naming the argument for a bad value; before the first step, when no configuration fits
            (:class:`~lightning_efficient.autofit.model.BudgetTooSmall`, with the smallest budget that would
            and the plan that needs it), or for settings AutoFit cannot plan around.
    """

    def __init__(
        self,
        budget: int | str | list[int | str],
        margin: float = 0.10,
        search_micro_batch: bool = True,
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
        policies = list(activation_policies or ("keep", "selective", "checkpoint", "offload", "disk"))
        require(all(p in POLICIES for p in policies) and "keep" in policies, "activation_policies", activation_policies,
                "a list of " + ", ".join(POLICIES) + " that includes 'keep'")
        choices = ("32-bit", "8-bit", "8-bit paged", "8-bit offload")
        options = list(optimizer_options or choices)
        require(bool(options) and all(o in choices for o in options), "optimizer_options", optimizer_options,
                "a non-empty list of " + ", ".join(repr(c) for c in choices))
        require(blocks == "auto" or (isinstance(blocks, list) and blocks and all(isinstance(b, str) for b in blocks)),
                "blocks", blocks, "'auto' or a non-empty list of class names / name patterns")
        require_int("min_8bit_size", min_8bit_size, 1)
        require_int("report_after_steps", report_after_steps, 1)
        self.budget = budget
        self.margin = float(margin)
        self.search_micro_batch = search_micro_batch
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
        self._undo_settings: list[Any] = []
        self._meter: PeakMemory | None = None
        self._start_rss = 0
        self._step_started: float | None = None
        self._step_times: list[float] = []
        self._measured: list[dict[str, float]] | None = None
        self.planning_s = 0.0

    # -- set-up ---------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        return {"budget": self.budget, "margin": self.margin, "search_micro_batch": self.search_micro_batch,
                "activation_policies": list(self.activation_policies), "optimizer_options": list(self.optimizer_options),
                "blocks": self.blocks}

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        callbacks = trainer.callbacks
        require(sum(isinstance(c, AutoFit) for c in callbacks) == 1, "callbacks", "two AutoFit", "one AutoFit per Trainer")
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
        wants_8bit = any(o != "32-bit" for o in self.optimizer_options)
        if wants_8bit or self._user_optimizer is not None:
            bitsandbytes()  # its import (native libraries) is not training memory: loaded before the start is read
        self._start_rss = current_rss_bytes()
        if self._user_optimizer is None and wants_8bit and self._optimizer is None:
            # added now, not when planning: it must exist when a checkpoint is loaded (it converts states)
            self._optimizer = EightBitOptimizer(bits=32, min_8bit_size=self.min_8bit_size)
            callbacks.insert(callbacks.index(self) + 1, self._optimizer)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = (checkpoint.get("callbacks") or {}).get(self.state_key)
        self._restored = dict(saved) if saved else None

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"settings": self._settings(), "plan": None if self._plan is None else self._plan.to_dict(),
                "measured": self._measured}

    # -- planning -------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if pl_module.automatic_optimization is False:
            raise ValueError("AutoFit measures training steps with automatic optimization; this module uses manual optimization")
        self._measured, self._step_times, self._step_started = None, [], None
        self._meter = PeakMemory(pl_module.device, self._start_rss)
        restored, self._restored = self._restored, None
        started = time.perf_counter()
        plan = self._reusable(restored, trainer)
        if plan is None:
            plan = self._plan_now(trainer, pl_module)
        self.planning_s = time.perf_counter() - started
        self._plan = plan
        table = plan_table(plan)
        rank_zero_info(table + f"\n  planned in {self.planning_s:.2f} s")
        if self.plan_only:
            raise PlanReady(plan, table)
        self._apply(plan, trainer, pl_module)

    def _reusable(self, restored: dict[str, Any] | None, trainer: Trainer) -> FitPlan | None:
        if not restored or restored.get("plan") is None:
            return None
        plan = FitPlan.from_dict(restored["plan"])
        if restored.get("settings") != self._settings():
            rank_zero_info("AutoFit: the checkpoint's plan was made with other settings; planning again.")
            return None
        if len(plan.ranks) != trainer.world_size:
            rank_zero_info(f"AutoFit: the checkpoint's plan is for {len(plan.ranks)} ranks, not {trainer.world_size}; planning again.")
            return None
        rank_zero_info("AutoFit: the checkpoint's plan is reused (same budget and settings); not measured again.")
        return plan

    def _heterogeneous(self, trainer: Trainer) -> bool:
        return hasattr(trainer.strategy, "balancer")

    def _plan_now(self, trainer: Trainer, pl_module: LightningModule) -> FitPlan:
        strategy = trainer.strategy
        loader = trainer.fit_loop._data_source.dataloader()
        require(isinstance(loader, torch.utils.data.DataLoader), "train_dataloader", type(loader).__name__,
                "one DataLoader (AutoFit measures its samples)")
        heterogeneous = self._heterogeneous(trainer)
        batch_size = loader.batch_size or 1
        world = trainer.world_size
        notes: list[str] = []
        resizable = can_resize(loader)
        if heterogeneous:
            samples = strategy.global_batch_size or batch_size * world * trainer.accumulate_grad_batches
            per_rank = samples
            searched = resizable and self.search_micro_batch
        else:
            per_rank = batch_size * trainer.accumulate_grad_batches
            samples = per_rank * world
            searched = self.search_micro_batch and resizable and lightning_hasattr(pl_module, "batch_size")
            if self.search_micro_batch and not searched:
                notes.append("micro-batch kept at the DataLoader's: " + (
                    "no `batch_size` attribute on the module or datamodule to set" if resizable
                    else "its dataset cannot be drawn by index"))
        if searched:
            m2 = min(max(batch_size, 2), per_rank)
            sizes = (max(1, m2 // 2), m2)
            micro_batches = None
        else:
            sizes = (batch_size, batch_size)
            micro_batches = [batch_size]
        first = None if resizable else strategy.batch_to_device(next(iter(loader)))

        def batches(size: int) -> Any:
            return sample_batch(strategy, loader, size) if first is None else first

        blocks, fixed, policies = self._blocks(pl_module, notes)
        options = self._optimizer_specs(trainer, pl_module, notes)
        rank = trainer.global_rank
        profile, failure = None, None
        exclude = ParameterStorages(pl_module).track()
        try:
            budget = rank_budget(self.budget, rank, world, pl_module.device, max(1, trainer.num_devices))
            profile = measure_rank(strategy, batches, sizes, meter=self._meter, options=options, blocks=blocks, exclude=exclude,
                                   policies=policies, budget_bytes=budget, fixed_policies=fixed).to_dict()
        except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together
            failure = error
        finally:
            exclude.stop()
        profiles = [RankProfile.from_dict(p) for p in gather_or_raise_together(profile, failure, "AutoFit could not measure")]
        self._profiles = profiles
        plan = search(profiles, samples_per_step=samples, heterogeneous=heterogeneous, margin=self.margin, policies=policies,
                      micro_batches=micro_batches)
        plan.notes.extend(notes)
        return plan

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
            fixed = user.policy * len(blocks) if len(user.policy) == 1 else list(user.policy)
            notes.append(f"block policies kept as set by ActivationMemory(policy={user.policy!r})")
            return blocks, fixed, tuple(dict.fromkeys(("keep", *fixed)))
        if policies == ("keep",):
            return [], None, policies
        return blocks, None, policies

    def _optimizer_specs(self, trainer: Trainer, pl_module: LightningModule, notes: list[str]) -> list[OptimizerSpec]:
        strategy = trainer.strategy

        def own() -> list[torch.optim.Optimizer]:
            return list(strategy.optimizers)

        user = self._user_optimizer
        if user is not None:
            if any(isinstance(o, eight_bit_classes()) for o in strategy.optimizers) or user.bits == 32:
                notes.append(f"optimizer states kept as set by EightBitOptimizer(bits={user.bits})")
                return [OptimizerSpec("as set", own, own=True)]
            notes.append(f"optimizer states kept as set by EightBitOptimizer(bits={user.bits}, paged={user.paged}, offload={user.offload!r})")
            return [self._twin_spec("as set", trainer, pl_module, paged=user.paged, offload=bool(user.offload), like=user)]
        on_cuda = pl_module.device.type == "cuda"
        specs = [OptimizerSpec("32-bit", own, own=True)] if "32-bit" in self.optimizer_options else []
        for name in self.optimizer_options:
            if name == "32-bit" or (name in _CUDA_ONLY and not on_cuda):
                continue
            spec = self._twin_spec(name, trainer, pl_module, paged=name == "8-bit paged", offload=name == "8-bit offload")
            specs.append(spec)
        if not specs:  # only CUDA options asked for, on CPU
            notes.append("the asked optimizer options need CUDA; 8-bit measured instead")
            specs.append(self._twin_spec("8-bit", trainer, pl_module, paged=False, offload=False))
        return specs

    def _twin_spec(self, name: str, trainer: Trainer, pl_module: LightningModule, *, paged: bool, offload: bool,
                   like: EightBitOptimizer | None = None) -> OptimizerSpec:
        settings = {} if like is None else {"keep_32bit": like.keep_32bit or None, "embeddings_32bit": like.embeddings_32bit}
        builder = EightBitOptimizer(min_8bit_size=like.min_8bit_size if like else self.min_8bit_size, **settings)
        return OptimizerSpec(name, lambda: builder.build_twins(list(trainer.strategy.optimizers), pl_module, paged=paged, offload=offload),
                             builder.drop_overrides)

    # -- applying -------------------------------------------------------------------------------
    def _apply(self, plan: FitPlan, trainer: Trainer, pl_module: LightningModule) -> None:
        mine = plan.ranks[trainer.global_rank]
        if self._heterogeneous(trainer):
            strategy = trainer.strategy
            self._undo_settings.append((strategy, "max_micro_batch", strategy.max_micro_batch))
            strategy.max_micro_batch = plan.micro_batches
        elif plan.accumulation is not None and lightning_hasattr(pl_module, "batch_size"):
            current = lightning_getattr(pl_module, "batch_size")
            if current != mine.micro_batch:
                self._undo_settings.append(("batch_size", current))
                lightning_setattr(pl_module, "batch_size", mine.micro_batch)
            self._undo_settings.append((trainer, "accumulate_grad_batches", trainer.accumulate_grad_batches))
            trainer.accumulate_grad_batches = plan.accumulation
        if self._user_activations is None and ((mine.policies and any(p != "keep" for p in mine.policies)) or self._activations):
            policies = list(mine.policies) or ["keep"]
            if self._activations is None:
                self._activations = ActivationMemory(policy=policies, blocks=self.blocks)
                callbacks = trainer.callbacks
                callbacks.insert(callbacks.index(self) + 1, self._activations)  # Lightning calls its on_fit_start next
            else:
                self._activations.policy = policies
        if self._optimizer is not None:
            eight = plan.optimizer.startswith("8-bit")
            self._optimizer.bits = 8 if eight else 32
            self._optimizer.paged = plan.optimizer == "8-bit paged"
            self._optimizer.offload = "cpu" if plan.optimizer == "8-bit offload" else None

    def _undo(self, pl_module: LightningModule) -> None:
        for item in reversed(self._undo_settings):
            if item[0] == "batch_size":
                lightning_setattr(pl_module, "batch_size", item[1])
            else:
                setattr(*item)
        self._undo_settings = []

    # -- measured beside predicted --------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._meter is not None:
            self._meter.reset()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
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
        rank_zero_info("AutoFit: measured after " f"{len(self._step_times)} steps\n" + plan_table(self._plan, self._measured))
        self._replan_if_above(trainer, pl_module)

    def _replan_if_above(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Plan the block policies again with a wider margin where a measured peak is above its prediction.

        Every rank decides alike (from the all-gathered figures) and computes the same plan, then switches
        its own blocks (an :class:`ActivationMemory` is added on a rank that had none)."""
        plan, measured = self._plan, self._measured
        assert plan is not None and measured is not None
        over = max((m["peak_bytes"] - r.peak_bytes) / b for m, r, b in zip(measured, plan.ranks, plan.budgets))
        if over <= 0:
            return
        margin = min(0.95, plan.margin + over)
        if not self._profiles or self._user_activations is not None or not self._profiles[0].blocks:
            rank_zero_warn(f"AutoFit: a measured peak is {over:.1%} of the budget above its prediction; nothing AutoFit "
                           f"can change now (plan again with margin={margin:.2f}).")
            return
        try:
            again = replan(plan, self._profiles, margin=margin, policies=self.activation_policies)
        except ValueError as error:
            rank_zero_warn(f"AutoFit: a measured peak is {over:.1%} of the budget above its prediction, and with margin "
                           f"{margin:.2f} no block plan fits at this micro-batch and precision: {error}")
            return
        rank_zero_info(f"AutoFit: a measured peak was {over:.1%} of the budget above its prediction; block policies planned "
                       f"again with margin {margin:.2f}:\n" + plan_table(again))
        self._switch_policies(list(again.ranks[trainer.global_rank].policies), trainer, pl_module)
        self._plan = again

    def _switch_policies(self, policies: list[str], trainer: Trainer, pl_module: LightningModule) -> None:
        """This rank's blocks under ``policies`` from the next step on (mid-fit)."""
        if self._activations is None:
            if all(p == "keep" for p in policies):
                return
            self._activations = ActivationMemory(policy=policies, blocks=self.blocks)
            trainer.callbacks.insert(trainer.callbacks.index(self) + 1, self._activations)
        else:
            self._activations._undo()
            self._activations.policy = policies
        self._activations.on_fit_start(trainer, pl_module)  # wired as at the start of fit, which has passed

    # -- clean-up -------------------------------------------------------------------------------
    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._undo(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._undo(pl_module)  # Lightning skips teardown when fit raises

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

