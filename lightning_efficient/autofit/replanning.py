"""AutoFit's plans made mid-fit: the block policies again with a wider margin where a measured peak is
above its prediction, and the run measured again where the parameters that train change."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_efficient._code_pages import CodePages
from lightning_efficient._distributed import gather_objects
from lightning_efficient._torch import Trainable
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.autofit.fit_inputs import (
    random_streams_restored,
    users_loader,
)
from lightning_efficient.autofit.measure import (
    OptimizerSpec,
    free_what_running_out_left,
)
from lightning_efficient.autofit.model import (
    BudgetTooSmall,
    FitPlan,
    RankProfile,
    plan_table,
    replan,
)
from lightning_efficient.autofit.notes import _WIDER_MARGIN, NOT_PROFILED, budget_advice
from lightning_efficient.autofit.readings import (
    MeasuringRanOut,
    _measuring_batches,
    _Unprofiled,
)
from lightning_efficient.memory import (
    PeakMemory,
    automatic_collection_paused,
    older_collections,
    optimizer_state_bytes,
    outside_training,
)


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


class _Replanning:
    """Plans made mid-fit, for :class:`~lightning_efficient.autofit.callback.AutoFit` (a part of it: the
    state it reads and sets is AutoFit's, set up in its ``__init__``; its other parts' methods are AutoFit's too)."""

    # AutoFit's settings and state this part reads or sets
    activation_policies: tuple[str, ...]
    blocks: Any
    _plan: FitPlan | None
    _profiles: list[RankProfile]
    _unprofiled: _Unprofiled | None
    _measured: list[dict[str, float]] | None
    _measured_against: list[int]
    _meter: PeakMemory | None
    _start_rss: int
    _step_started: float | None
    _step_times: list[float]
    _code_pages: CodePages
    _activations: ActivationMemory | None
    _user_activations: ActivationMemory | None
    _trainable_planned: Trainable | None
    _trained_when_wrapped: frozenset[str]
    _plan_key: tuple[Trainable, int] | None
    _plans_by_what_trains: dict[tuple[Trainable, int], tuple[FitPlan, list[RankProfile], _Unprofiled | None]]

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
                    trainer, _measuring_batches(strategy, users_loader(trainer)), (micro, micro), options=[optimizer],
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
