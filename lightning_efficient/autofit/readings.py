"""AutoFit's readings, each taken on every rank together (a failure on one rank raises on all of them): the
profiles measured before the first step, the blocks profiled when the plan needs them, a pick's micro-batch
read where it was predicted, and its block policies timed and priced up."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_efficient._code_pages import CodePages
from lightning_efficient._distributed import gather_objects, gather_or_raise_together
from lightning_efficient._step import first_samples_batch, prepared_as_in_the_loop
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.activations.planner import BlockProfile
from lightning_efficient.activations.policies import policy_counts
from lightning_efficient.autofit.fit_inputs import samplers_left_as_they_were
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
    peak_read_over,
    priced_by_reading,
)
from lightning_efficient.balance.probe import is_out_of_memory
from lightning_efficient.memory import (
    ParameterStorages,
    PeakMemory,
    collect_garbage_made_since,
    release_free_memory,
)

RAN_OUT = -1.0
"""A timed reading that ran out of memory (gathered from every rank in place of its seconds)."""


PRICING_ROUNDS = 2
"""The most times a pick's block policies are timed and priced up before the search's plan is taken as it is."""


def _unread(profile: RankProfile, micro: int) -> bool:
    """Whether ``micro`` is above the measured sizes and its peak was not read (beyond them, or between larger sizes
    read: predicted from a line between two readings, which a peak growing more slowly at larger sizes is above)."""
    return micro > profile.sizes[1] and micro not in dict(profile.peak_points())


def _size_to_read(profile: RankProfile, micro: int) -> int:
    """The micro-batch a rank reads when the pick is checked: its pick where that is unread, else the larger measured
    size (a reading nothing is learnt from, as every rank reads one)."""
    return micro if _unread(profile, micro) else max(micro, profile.sizes[1])


def _ran_out(profile: RankProfile, size: int) -> RankProfile:
    """``profile`` where no plan uses ``size`` or more (a reading there ran out of memory, or one above it did)."""
    return replace(profile, out_of_memory_at=min(size, profile.out_of_memory_at or size))


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


def _ddp_bucket_bytes(strategy: Any) -> int:
    """Bytes of DDP's gradient buckets (one copy of the trainable parameters' gradients, unless they are views of
    the buckets): allocated by DDP's own forward, which the measured steps do not run; 0 for other strategies."""
    from lightning.pytorch.strategies import DDPStrategy

    if not isinstance(strategy, DDPStrategy) or strategy.world_size < 2:
        return 0
    if getattr(strategy, "_ddp_kwargs", {}).get("gradient_as_bucket_view"):
        return 0
    return sum(p.numel() * p.element_size() for p in strategy.lightning_module.parameters() if p.requires_grad)


@dataclass
class _Unprofiled:
    """What profiling the blocks later needs: the batch source, the blocks and the policies allowed (each rank profiles
    them at its profile's ``blocks_size``, its smaller measured size)."""

    batches: Any
    blocks: list
    policies: tuple[str, ...]


class MeasuringRanOut(RuntimeError):
    """Raised on every rank alike where measuring ran out of memory on one or more ranks (each named with its error)."""


def _measuring_batches(strategy: Any, loader: Any) -> Any:
    """``size -> batch`` for measuring steps: the first ``size`` samples of ``loader``'s dataset, or, where its samples
    cannot be drawn by index, its first batch whatever the size (its samplers left as they were)."""
    if can_resize(loader):
        return lambda size: first_samples_batch(strategy, loader, size)
    with samplers_left_as_they_were(loader):
        first = prepared_as_in_the_loop(strategy, next(iter(loader)))
    return lambda size: first


class _Readings:
    """Every rank's readings for :class:`~lightning_efficient.autofit.callback.AutoFit` (a part of it: the
    state it reads and sets is AutoFit's, set up in its ``__init__``; its other parts' methods are AutoFit's too)."""

    # AutoFit's settings and state this part reads or sets
    blocks: Any
    planning_s: float
    _profiles: list[RankProfile]
    _meter: PeakMemory | None
    _code_pages: CodePages

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

    def _release_what_measuring_left(self, older: int, device: torch.device) -> None:
        # on CPU the fit's memory is its RSS: the library code only measuring ran (every policy, every optimizer option)
        # would stay resident and read as training memory; it is unmapped (the fit faults back in the pages it runs)
        self._code_pages.release_touched()
        # what measuring left as garbage is not the fit's
        collect_garbage_made_since(older)
        release_free_memory(device)
