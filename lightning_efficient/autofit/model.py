"""AutoFit's model and search: from a rank's measured figures, the predicted peak memory and step time
of every configuration, and the fastest configuration that fits the budget.

Pure functions over :class:`RankProfile` figures (no Lightning), so they can be tested on synthetic
profiles. The model, per rank, for micro-batch ``m``, a policy per block and an optimizer option ``o``:

* forward and backward peak: ``peak(m)``, piecewise linear through the peaks read with every block kept and the
  run's own optimizer states held (the line ``p0 + p1 * m`` through the two measured micro-batch sizes, and
  beyond them the larger sizes read; :meth:`RankProfile.peak_at`); each block's
  activations scale with ``m`` from the block profile (measured at one size): a plan subtracts what
  its policies free, adds the most that backward brings back at once (the block whose backward runs, whole
  again, with the blocks before it at their policies' bytes, a moved block below it already read back where
  ActivationMemory reads ahead, the blocks after it freed), and the option's optimizer-state bytes replace the
  run's own;
* the optimizer step's peak is measured per option (gradients and states held, no activations);
* time per micro-step: piecewise linear between the micro-batch sizes timed (every block kept: the two
  sizes above and a ladder of smaller ones, each again where it could be picked; the least kept; a CPU's time per sample
  is not a line in the micro-batch), extended beyond the largest by the line through the last two; plus
  the plan's recompute or transfer time (scaled with ``m``); times the number of micro-steps, plus the
  option's step time (the least of several steps).

The search keeps the global batch: under data parallelism (``uniform``) every rank runs the same
micro-batch, a divisor of the per-rank batch, with gradient accumulation making up the rest; under the
heterogeneous strategies each rank gets its own micro-batch cap and the balancer shares the global
batch by speed. The pick is the configuration of least predicted step time whose predicted peak on
every rank is at most ``budget x (1 - margin)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_efficient.activations.planner import BlockProfile, plan_blocks
from lightning_efficient.activations.policies import policy_counts

CLOSE = 0.03
"""Predicted step times within this fraction of the best count as equal: among them one keeping full-precision
optimizer states where one does (8-bit states are lossy), then the largest micro-batch (the model times forward and
backward, not the loop's own work per micro-step: hooks, loading a batch, which favours fewer, larger micro-steps)."""


def _pick(plans: list[FitPlan]) -> FitPlan | None:
    """The plan of least step time, or among those within :data:`CLOSE` of it, one keeping the optimizer states at
    full precision where one does (8-bit states are lossy: a new user's GPT-2, with room for 32-bit ones, got 8-bit
    states on a busy machine's timings), then the largest micro-batch."""
    if not plans:
        return None
    fastest = min(p.step_s for p in plans)
    close = [p for p in plans if p.step_s <= fastest * (1 + CLOSE)]
    return max(close, key=lambda p: (not _lossy(p), p.ranks[0].micro_batch, -p.step_s))


def _lossy(plan: FitPlan) -> bool:
    """Whether ``plan`` quantizes the optimizer states (8-bit, paged or offloaded)."""
    return plan.optimizer.startswith("8-bit")


@dataclass
class OptimizerOption:
    """One way to hold the optimizer states, measured on this rank.

    Attributes:
        name: ``"32-bit"``, ``"8-bit"``, ``"8-bit paged"``, ``"8-bit offload"`` or ``"as set"``.
        state_bytes: the device bytes its states hold between steps.
        step_s: seconds of one optimizer step (the least of those after the first, which creates the states).
        step_peak_bytes: peak memory during its step (gradients and states held, no activations).
    """

    name: str
    state_bytes: int
    step_s: float
    step_peak_bytes: int


def _line_through(sizes: tuple[int, int], values: tuple[float, float]) -> tuple[float, float]:
    """``(intercept, slope)`` through ``values`` at ``sizes``, never below either reading: with one size, or a slope that
    is not positive (noise), the larger reading and slope 0; an intercept that would be negative is 0, the slope kept (a
    cost growing faster than the micro-batch is not extrapolated into a negative fixed cost)."""
    (m1, m2), (v1, v2) = sizes, values
    if m1 == m2:
        return float(max(v1, v2)), 0.0
    slope = (v2 - v1) / (m2 - m1)
    if slope <= 0:  # noise: the smaller size read higher; never predict below either reading
        return float(max(v1, v2)), 0.0
    return float(max(0.0, v2 - slope * m2)), float(slope)


def _per_size(readings: list[tuple[int, Any]], keep: Callable[[Any, Any], Any], kind: type) -> list[tuple[int, Any]]:
    """One reading per micro-batch size (``keep`` of a size's readings, as ``kind``), in increasing size."""
    kept: dict[int, Any] = {}
    for size, value in readings:
        kept[int(size)] = kind(value) if int(size) not in kept else keep(kept[int(size)], kind(value))
    return sorted(kept.items())


@dataclass
class RankProfile:
    """What one rank measured: two micro-batch sizes (and the larger ones read), its blocks, its optimizer options.

    Attributes:
        sizes: the two micro-batch sizes measured (equal when only one could be).
        peak_bytes: peak memory of a forward and backward at each size, every block kept.
        step_s: seconds of a forward and backward at each size.
        run_state_bytes: the optimizer-state bytes held during those measurements.
        blocks: each block's profile, measured at ``blocks_size`` samples.
        blocks_size: the micro-batch the blocks were profiled at.
        options: the optimizer options measured.
        budget_bytes: this rank's budget.
        tokens_per_sample: tokens in one sample (for tokens/s); None for a batch without token ids (the rate is then
            in samples).
        fixed_policies: a policy per block the user set (None: AutoFit chooses).
        unmeasured_bytes: held during training but not while measuring (DDP's gradient buckets: the measured
            steps run outside DDP's forward, which allocates them); added to every prediction.
        times: ``(micro-batch, seconds)`` of a forward and backward at more sizes (every block kept, timed
            only); with ``sizes`` and ``step_s`` they make the time model (:meth:`micro_step_seconds`).
        smallest_micro_batch: the smallest micro-batch the model trains on (2 where a step on one sample failed:
            a BatchNorm's statistics).
        out_of_memory_at: the least micro-batch that ran out of device memory while measuring (None: none did); no
            plan uses it or a larger one on this rank.
        peaks: ``(micro-batch, peak bytes)`` of a forward and backward at more sizes (every block kept): sizes read
            above the budget less the margin before the sizes moved below them, a pick's micro-batch read beyond the
            sizes; with ``sizes`` and ``peak_bytes`` they make the memory model (:meth:`peak_at`).
    """

    sizes: tuple[int, int]
    peak_bytes: tuple[int, int]
    step_s: tuple[float, float]
    run_state_bytes: int
    blocks: list[BlockProfile]
    blocks_size: int
    options: list[OptimizerOption]
    budget_bytes: int
    tokens_per_sample: float | None = 1.0
    fixed_policies: list[str] | None = None
    unmeasured_bytes: int = 0
    times: list[tuple[int, float]] = field(default_factory=list)
    smallest_micro_batch: int = 1
    out_of_memory_at: int | None = None
    peaks: list[tuple[int, int]] = field(default_factory=list)

    def fits_device(self, micro: int) -> bool:
        """Whether ``micro`` is below the least micro-batch that ran out of memory while measuring."""
        return self.out_of_memory_at is None or micro < self.out_of_memory_at

    def time_points(self) -> list[tuple[int, float]]:
        """Every timed micro-batch size with its least reading, in increasing size."""
        return _per_size([*zip(self.sizes, self.step_s), *self.times], min, float)

    def micro_step_seconds(self, micro: int) -> float:
        """Predicted seconds of a forward and backward at ``micro`` samples, every block kept: linear between the
        timed sizes around it; beyond the largest, the steeper of the line through the last two and the chord from
        the smallest (one noisy segment does not make larger sizes free), or time proportional to the micro-batch
        where both are flat; below the smallest, the line through the first two, never below time proportional to
        the micro-batch; one timed size: proportional to it."""
        points = self.time_points()
        first_m, first_t = points[0]
        last_m, last_t = points[-1]
        if len(points) == 1:
            return last_t * micro / last_m
        if micro >= last_m:
            (m1, t1) = points[-2]
            slope = max((last_t - t1) / (last_m - m1), (last_t - first_t) / (last_m - first_m))
            return last_t + (slope if slope > 0 else last_t / last_m) * (micro - last_m)
        if micro <= first_m:
            m2, t2 = points[1]
            return max(first_t * micro / first_m, first_t - (t2 - first_t) / (m2 - first_m) * (first_m - micro))
        for (m1, t1), (m2, t2) in itertools.pairwise(points):
            if m1 <= micro <= m2:
                return t1 + (t2 - t1) * (micro - m1) / (m2 - m1)
        raise AssertionError("unreachable: micro lies between the first and last timed sizes")

    def peak_points(self) -> list[tuple[int, int]]:
        """Every micro-batch size whose peak was read (every block kept) with its largest reading, in increasing size."""
        return _per_size([*zip(self.sizes, self.peak_bytes), *self.peaks], max, int)

    def peak_at(self, micro: int) -> float:
        """Predicted peak bytes of a forward and backward at ``micro`` samples, every block kept: up to the second read
        size, :meth:`line` through the two smallest; between larger read sizes, linear between the two around it;
        beyond the largest, the steeper of the line through the last two and the chord from the smallest (as for
        time); never below the prediction at a smaller size. Through two sizes, :meth:`line`.

        A peak may grow more slowly at larger sizes (a loss computed in chunks of a fixed number of tokens): AutoFit
        read the benchmark's Llama at 62.3 and 82.1 MiB at 2 and 4 samples and 103.6 at 8, where the line through the
        two smallest predicted 122 at 8 and 201 at 16 (fits of 16 peak at 143)."""
        points = self.peak_points()
        (m1, v1), (m2, v2) = points[0], points[min(1, len(points) - 1)]
        p0, p1 = _line_through((m1, m2), (v1, v2))
        if micro <= m2 or len(points) <= 2:
            return float(p0 + p1 * micro)
        # beyond the second size, from the line's value there (above its reading where the line's intercept was
        # raised to 0 or a noisy slope made it flat): no larger micro-batch is predicted below a smaller one
        points[1] = (m2, max(v2, p0 + p1 * m2))
        if micro >= points[-1][0]:
            (mk, vk), (ml, vl) = points[-2], points[-1]
            slope = max((vl - vk) / (ml - mk), (vl - v1) / (ml - m1))
            predicted = vl + max(slope, 0.0) * (micro - ml)
        else:
            (ma, va), (mb, vb) = next((a, b) for a, b in itertools.pairwise(points) if a[0] <= micro <= b[0])
            predicted = va + (vb - va) * (micro - ma) / (mb - ma)
        return float(max([predicted, *(v for m, v in points if m <= micro)]))

    def line(self, values: tuple[float, float]) -> tuple[float, float]:
        """``(intercept, slope)`` through ``values`` at :attr:`sizes` (:func:`_line_through`)."""
        return _line_through(self.sizes, values)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for all-gathering and checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankProfile:
        """The inverse of :meth:`to_dict`."""
        data = dict(data)
        data["blocks"] = [BlockProfile(**b) for b in data["blocks"]]
        data["options"] = [OptimizerOption(**o) for o in data["options"]]
        data["sizes"], data["peak_bytes"], data["step_s"] = tuple(data["sizes"]), tuple(data["peak_bytes"]), tuple(data["step_s"])
        data["times"] = [(int(m), float(t)) for m, t in data.get("times", [])]
        data["peaks"] = [(int(m), int(v)) for m, v in data.get("peaks", [])]
        return cls(**data)


@dataclass
class RankChoice:
    """One rank's part of a plan, with its predictions."""

    micro_batch: int
    policies: list[str]
    peak_bytes: int
    micro_step_s: float
    step_s: float


@dataclass
class FitPlan:
    """The chosen configuration and what it is predicted to do.

    Attributes:
        optimizer: the optimizer option's name.
        ranks: each rank's micro-batch, block policies and predictions.
        accumulation: micro-steps per optimizer step (uniform micro-batch; None under the
            heterogeneous strategies, whose balancer decides it).
        step_s: predicted seconds per optimizer step.
        tokens_per_s: predicted tokens per second over all ranks (samples per second where ``rate_of`` says so).
        samples_per_step: the global batch.
        margin: the fraction of each budget left free.
        budgets: each rank's budget in bytes.
        notes: what the plan says beside its table.
        rate_of: what ``tokens_per_s`` counts: ``"tokens"``, or ``"samples"`` for batches without token ids.
    """

    optimizer: str
    ranks: list[RankChoice]
    accumulation: int | None
    step_s: float
    tokens_per_s: float
    samples_per_step: int
    margin: float
    budgets: list[int]
    notes: list[str] = field(default_factory=list)
    rate_of: str = "tokens"

    @property
    def micro_batches(self) -> list[int]:
        """Each rank's micro-batch (its cap under the heterogeneous strategies)."""
        return [r.micro_batch for r in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitPlan:
        """The inverse of :meth:`to_dict`."""
        data = dict(data)
        data["ranks"] = [RankChoice(**r) for r in data["ranks"]]
        return cls(**data)


class BudgetTooSmall(ValueError):
    """No configuration fits the budget; the message gives the smallest budget that would and its plan."""


def _scaled(blocks: list[BlockProfile], factor: float) -> list[BlockProfile]:
    return [BlockProfile(b.name, {k: int(v * factor) for k, v in b.held_bytes.items()},
                         {k: v * factor for k, v in b.cost_s.items()}) for b in blocks]


def _brought_back(blocks: list[BlockProfile], policies: list[str]) -> int:
    """The most activation bytes backward holds beyond what the blocks' policies hold (0 where every block keeps).

    Backward runs the blocks last to first. While block ``i`` runs its backward, its whole activations are live
    (kept, recomputed, or read back), the blocks before it hold what their policies hold, the blocks after it have
    been freed, and a moved block before it may already be read back (:func:`_read_ahead`); before the first,
    every block holds what its policy holds (host offload's few storages still in flight then are not counted).
    """
    held = [b.held_bytes[p] for b, p in zip(blocks, policies)]
    total = most = sum(held)
    below = 0
    for index, block in enumerate(blocks):
        live = below + block.held_bytes["keep"]
        for ahead in _read_ahead(policies, index):
            live += blocks[ahead].held_bytes["keep"] - held[ahead]
        most = max(most, live)
        below += held[index]
    return most - total


def _read_ahead(policies: list[str], index: int) -> list[int]:
    """The blocks below ``index`` already read back while block ``index`` runs its backward, as ActivationMemory
    moves them: on disk, the block just below where both are on disk (the disk store prefetches a block's
    predecessor as it reads the block back); in host memory, the nearest offloaded block below the last one
    entered (at or above ``index``), copied back on entering that one and held until its own backward."""
    ahead = []
    if index > 0 and policies[index] == "disk" and policies[index - 1] == "disk":
        ahead.append(index - 1)
    entered = next((k for k in range(index, len(policies)) if policies[k] == "offload"), None)
    if entered is not None:
        offloaded_below = [k for k in range(entered) if policies[k] == "offload"]
        if offloaded_below and offloaded_below[-1] < index:
            ahead.append(offloaded_below[-1])
    return ahead


def _predict(profile: RankProfile, blocks: list[BlockProfile], policies: list[str], micro: int, option: OptimizerOption) -> tuple[int, float]:
    """(predicted peak bytes, predicted micro-step seconds) on this rank."""
    kept = sum(b.held_bytes["keep"] for b in blocks)
    held = sum(b.held_bytes[p] for b, p in zip(blocks, policies))
    forward_backward = profile.peak_at(micro) - kept + held + _brought_back(blocks, policies) + option.state_bytes - profile.run_state_bytes
    cost = sum(b.cost_s[p] for b, p in zip(blocks, policies))
    return int(max(forward_backward, option.step_peak_bytes) + profile.unmeasured_bytes), profile.micro_step_seconds(micro) + cost


def choose_rank(profile: RankProfile, micro: int, option: OptimizerOption, policies: tuple[str, ...], margin: float) -> RankChoice | None:
    """The fastest block policies for this rank at ``micro`` samples and ``option`` within its
    budget less ``margin`` (None when none fits)."""
    usable = profile.budget_bytes * (1.0 - margin)
    blocks = _scaled(profile.blocks, micro / profile.blocks_size)
    candidates: list[list[str]] = []
    if profile.fixed_policies is not None or not blocks:
        candidates.append(list(profile.fixed_policies or []))
    else:
        base, _ = _predict(profile, blocks, ["keep"] * len(blocks), micro, option)
        all_kept = sum(b.held_bytes["keep"] for b in blocks)
        room = usable - (base - all_kept)
        leaner = _lean_plans(blocks, policies)
        # the planner counts held bytes only, not what backward brings back (a recomputed block, a block read back and
        # the next one prefetched: that depends on where each policy is): plan again leaving room for what each lean
        # plan brings back, and fall back on the lean plans themselves
        for reserve in sorted({0, *(_brought_back(blocks, lean) for lean in leaner)}):
            try:
                candidates.append(plan_blocks(blocks, int(room - reserve), 0, policies).policies)
            except ValueError:
                continue
        candidates.extend(leaner)
    best: RankChoice | None = None
    for chosen in candidates:
        peak, micro_s = _predict(profile, blocks, chosen, micro, option)
        if peak <= usable and (best is None or micro_s < best.micro_step_s):
            best = RankChoice(micro, chosen, peak, micro_s, micro_s)
    return best


def _leanest_policies(blocks: list[BlockProfile], policies: tuple[str, ...]) -> list[str]:
    """Every block at the policy holding the least (the cheaper one of equals)."""
    return [min((p for p in policies if p in b.held_bytes), key=lambda p, b=b: (b.held_bytes[p], b.cost_s[p])) for b in blocks]


def _lean_plans(blocks: list[BlockProfile], policies: tuple[str, ...]) -> list[list[str]]:
    """Every block at its leanest policy, and every block at each one policy other than keep: the plans that hold the
    least, one of which peaks the least (a policy holding less in a block may bring more back in backward)."""
    leanest = _leanest_policies(blocks, policies)
    uniform = [[p] * len(blocks) for p in policies if p != "keep" and all(p in b.held_bytes for b in blocks)]
    return [leanest, *(plan for plan in uniform if plan != leanest)]


def _leanest(profile: RankProfile, micro: int, option: OptimizerOption, policies: tuple[str, ...]) -> RankChoice:
    """The configuration at ``micro`` and ``option`` predicted to peak the least (of :func:`_lean_plans`)."""
    blocks = _scaled(profile.blocks, micro / profile.blocks_size)
    plans = [list(profile.fixed_policies)] if profile.fixed_policies is not None else _lean_plans(blocks, policies)
    predicted = [(_predict(profile, blocks, chosen, micro, option), chosen) for chosen in plans]
    (peak, micro_s), chosen = min(predicted, key=lambda item: item[0][0])
    return RankChoice(micro, chosen, peak, micro_s, micro_s)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def search(
    profiles: list[RankProfile],
    *,
    samples_per_step: int,
    heterogeneous: bool,
    margin: float,
    policies: tuple[str, ...],
    micro_batches: list[int] | None = None,
    caps: list[int | None] | None = None,
) -> FitPlan:
    """The configuration of least predicted step time that fits every rank's budget less ``margin``.

    Args:
        profiles: one per rank, in rank order.
        samples_per_step: the global batch (all ranks, one optimizer step).
        heterogeneous: each rank its own micro-batch cap, shares by speed (else one micro-batch for all).
        margin: the fraction of each budget kept free for what the model does not see.
        policies: the activation policies allowed.
        micro_batches: the micro-batch sizes allowed (default: divisors of the per-rank batch for the
            uniform case, 1..global batch for the heterogeneous one).
        caps: heterogeneous only: each rank's largest micro-batch the user set (None: no cap on it), which its plan's
            cap stays within.

    Raises:
        BudgetTooSmall: when nothing fits, with the smallest budget that would and the plan needing it.
    """
    world = len(profiles)
    names = [o.name for o in profiles[0].options]
    per_rank = samples_per_step // world
    if micro_batches is None:
        micro_batches = list(range(1, samples_per_step + 1)) if heterogeneous else divisors(per_rank)
    smallest = max(p.smallest_micro_batch for p in profiles)
    # none: the user's batch is below it too (AutoFit refuses a list of sizes all below it), and fails as in plain Lightning
    micro_batches = [m for m in micro_batches if m >= smallest] or micro_batches
    per_rank_allowed = [[m for m in micro_batches if p.fits_device(m) and (cap is None or m <= cap)]
                        for p, cap in zip(profiles, caps or [None] * world)]
    common = [m for m in micro_batches if all(p.fits_device(m) for p in profiles)]
    if not (all(per_rank_allowed) if heterogeneous else common):
        raise BudgetTooSmall(_out_of_memory_message(profiles, micro_batches))
    plans: list[FitPlan] = []
    for index in range(len(names)):
        options = [p.options[index] for p in profiles]
        if heterogeneous:
            plans.extend(_heterogeneous(profiles, options, per_rank_allowed, samples_per_step, margin, policies))
        else:
            plans.extend(_uniform(profiles, options, common, per_rank, margin, policies))
    best = _pick(plans)
    if best is None:
        raise BudgetTooSmall(_infeasible_message(profiles, common if not heterogeneous else micro_batches, margin, policies))
    return best


def _out_of_memory_message(profiles: list[RankProfile], micro_batches: list[int]) -> str:
    """Why no allowed micro-batch is left: each rank's least size that ran out of memory while measuring."""
    ran_out = "; ".join(f"rank {rank}'s device ran out of memory at {p.out_of_memory_at} samples"
                        for rank, p in enumerate(profiles) if p.out_of_memory_at is not None)
    allowed = ", ".join(map(str, micro_batches))
    return (f"AutoFit: the micro-batch{'es' if len(micro_batches) > 1 else ''} allowed ({allowed}) cannot run: {ran_out} "
            "while AutoFit measured it. Lower the DataLoader's batch size (with accumulate_grad_batches raised to keep "
            "the global batch), or let AutoFit choose the micro-batch: search_micro_batch=True and a `batch_size` "
            "attribute that train_dataloader() reads")


def blocks_matter(profiles: list[RankProfile], *, samples_per_step: int, heterogeneous: bool, margin: float,
                  micro_batches: list[int] | None = None, caps: list[int | None] | None = None) -> bool:
    """Whether a block policy other than keep could make the plan faster, from profiles measured without the blocks:
    a policy other than keep only adds time (recomputation, copies), so it can only pay where it lets a faster micro-batch
    or optimizer option fit. False when the fastest plan with no memory limit fits every budget with every block kept.

    Args:
        profiles: one per rank, in rank order (their blocks are not looked at).
        samples_per_step: the global batch (all ranks, one optimizer step).
        heterogeneous: as for :func:`search`.
        margin: the fraction of each budget kept free.
        micro_batches: the micro-batch sizes allowed (as for :func:`search`).
        caps: each rank's largest micro-batch the user set (as for :func:`search`).
    """
    settings = {"samples_per_step": samples_per_step, "heterogeneous": heterogeneous, "margin": margin,
                "policies": ("keep",), "micro_batches": micro_batches, "caps": caps}
    unlimited = search([replace(p, budget_bytes=2**62) for p in profiles], **settings)
    try:
        kept = search(profiles, **settings)
    except BudgetTooSmall:
        return True
    # (or where keeping every block fits only with lossy states that the fastest plan does without: block policies may
    # make room for full-precision ones, which the pick prefers among near-equal plans)
    return kept.step_s > unlimited.step_s or (_lossy(kept) and not _lossy(unlimited))


def _fitting_or_leanest(profile: RankProfile, micro: int, option: OptimizerOption, policies: tuple[str, ...], margin: float) -> RankChoice:
    """:func:`choose_rank`'s choice, or where nothing fits the budget less ``margin``, :func:`_leanest`'s (the least peak)."""
    return choose_rank(profile, micro, option, policies, margin) or _leanest(profile, micro, option, policies)


def replan(plan: FitPlan, profiles: list[RankProfile], *, margin: float, policies: tuple[str, ...], leanest: bool = False) -> FitPlan:
    """``plan`` with the block policies chosen again for ``margin`` (what AutoFit does when a measured peak
    is above its prediction, or when the parameters that train changed): every rank keeps its micro-batch (its cap
    under the heterogeneous strategies) and the plan's optimizer option. ``leanest``: a rank where no block policies fit
    takes those predicted to peak the least (the others choose as without it). A pure function of every rank's
    profile: each rank computes the same plan.

    Raises:
        BudgetTooSmall: when a rank's leanest block policies at its micro-batch miss its budget less ``margin`` (not
            with ``leanest``).
    """
    index = [o.name for o in profiles[0].options].index(plan.optimizer)
    options = [p.options[index] for p in profiles]
    choose = _fitting_or_leanest if leanest else choose_rank
    if plan.accumulation is None:
        again = _pick(_heterogeneous(profiles, options, [[m] for m in plan.micro_batches], plan.samples_per_step, margin, policies,
                                     choose))
    else:
        again = _pick(_uniform(profiles, options, plan.micro_batches[:1], plan.samples_per_step // len(profiles), margin, policies,
                               choose))
    if again is None:
        raise BudgetTooSmall(f"AutoFit: with margin {margin:g} no block policies fit every rank's budget at micro-batches "
                             f"{plan.micro_batches} and optimizer states {plan.optimizer}")
    again.notes = list(plan.notes)
    return again


def priced_by_reading(profile: RankProfile, choice: RankChoice, seconds: float) -> RankProfile | None:
    """``profile`` with the block policies ``choice`` uses priced up so that ``choice`` is predicted at ``seconds``, a
    micro-step timed at its micro-batch with its policies applied; None where ``choice`` keeps every block or the
    reading is within :data:`CLOSE` of the prediction (a reading below it lowers nothing: one timed micro-step can
    read fast, and a plan priced too cheap is the one that costs).

    The block profile prices each policy from its own parts (recomputation as the forward's time or its non-matmul
    share, transfers as bytes over a bandwidth), not the saved-tensor hooks' own work or a writer thread competing
    with compute, which come with each block moved or recomputed: what the reading adds above the prediction is
    shared equally by the blocks the choice moves or recomputes, and each policy it uses costs that much more in
    every block (another arrangement of the same policies is no cheaper for it). Added, not scaled: a cost priced
    small (a selective block's non-matmul share) would multiply the reading's noise.
    """
    moved = [i for i, policy in enumerate(choice.policies) if policy != "keep"]
    if not moved or not profile.blocks:
        return None
    scale = choice.micro_batch / profile.blocks_size  # block costs are measured at blocks_size samples
    cost = sum(profile.blocks[i].cost_s[choice.policies[i]] for i in moved) * scale
    predicted = profile.micro_step_seconds(choice.micro_batch) + cost
    if seconds <= predicted * (1 + CLOSE):
        return None
    used = {choice.policies[i] for i in moved}
    per_block = (seconds - predicted) / len(moved) / scale  # at blocks_size samples, as the profile's costs

    def priced(policy: str, cost_s: float) -> float:
        return cost_s + per_block if policy in used else cost_s

    blocks = [BlockProfile(b.name, dict(b.held_bytes), {p: priced(p, c) for p, c in b.cost_s.items()}) for b in profile.blocks]
    return replace(profile, blocks=blocks)


def peak_read_over(plan: FitPlan, profiles: list[RankProfile], peaks: list[int | None]) -> float | None:
    """How far above its prediction the pick's peak read, as a share of the budget, on the rank where it is the most,
    from ``peaks``: each rank's peak of a forward and backward at its micro-batch with its block policies applied,
    under the run's own optimizer states (None: not read), taken as the plan would peak (the option's states in place of
    the run's, its step's peak, what measuring does not hold). None where no reading puts its rank above its budget: a
    miss within the budget is what the margin is for (widened for it, the benchmark's Llama at its medium budget, read
    3% of its budget above its prediction and within it, went from micro-batch 4 to 2, 0.70x the best tokens/s)."""
    index = [o.name for o in profiles[0].options].index(plan.optimizer)
    worst: float | None = None
    for choice, profile, peak in zip(plan.ranks, profiles, peaks):
        if peak is None:
            continue
        option = profile.options[index]
        read = max(peak + option.state_bytes - profile.run_state_bytes, option.step_peak_bytes) + profile.unmeasured_bytes
        if read > profile.budget_bytes and read > choice.peak_bytes:
            over = (read - choice.peak_bytes) / profile.budget_bytes
            worst = over if worst is None else max(worst, over)
    return worst


def _tokens_per_s(profiles: list[RankProfile], samples: int, step_s: float) -> float:
    """Tokens a second over every rank (samples a second where a rank's batches hold no token ids)."""
    tokens = 1.0 if _rate_of(profiles) == "samples" else sum(p.tokens_per_sample for p in profiles) / len(profiles)
    return samples * tokens / max(step_s, 1e-12)


def _rate_of(profiles: list[RankProfile]) -> str:
    """What a plan's rate counts: tokens, or samples where a rank's batches hold no token ids."""
    return "samples" if any(p.tokens_per_sample is None for p in profiles) else "tokens"


def _uniform(profiles, options, micro_batches, per_rank, margin, policies, choose=choose_rank) -> list[FitPlan]:
    plans: list[FitPlan] = []
    for micro in micro_batches:
        if per_rank % micro:
            continue
        steps = per_rank // micro
        chosen = [choose(p, micro, o, policies, margin) for p, o in zip(profiles, options)]
        if any(c is None for c in chosen):
            continue
        for c, o in zip(chosen, options):
            c.step_s = steps * c.micro_step_s + o.step_s
        step_s = max(c.step_s for c in chosen)
        samples = per_rank * len(profiles)
        plans.append(FitPlan(options[0].name, chosen, steps, step_s, _tokens_per_s(profiles, samples, step_s), samples, margin,
                             [p.budget_bytes for p in profiles], rate_of=_rate_of(profiles)))
    return plans


def _heterogeneous(profiles, options, micro_batches, samples, margin, policies, choose=choose_rank) -> list[FitPlan]:
    """Each rank's fastest configuration among its own ``micro_batches[rank]`` (the largest cap among those within
    :data:`CLOSE` of the fastest), shares by speed: one plan, or none when a rank fits nothing."""
    chosen: list[RankChoice] = []
    for profile, option, allowed in zip(profiles, options, micro_batches):
        fits = [c for c in (choose(profile, micro, option, policies, margin) for micro in allowed) if c is not None]
        if not fits:
            return []
        best = max(c.micro_batch / c.micro_step_s for c in fits)
        chosen.append(max((c for c in fits if c.micro_batch / c.micro_step_s >= best / (1 + CLOSE)), key=lambda c: c.micro_batch))
    rate = sum(c.micro_batch / c.micro_step_s for c in chosen)
    step_s = samples / rate + max(o.step_s for o in options)
    for c in chosen:
        c.step_s = step_s
    return [FitPlan(options[0].name, chosen, None, step_s, _tokens_per_s(profiles, samples, step_s), samples, margin,
                    [p.budget_bytes for p in profiles], rate_of=_rate_of(profiles))]


RETRY_HEADROOM = 0.05
"""How much more than the least budget a refusal names it advises: the least is from this run's readings, which vary
between runs (on CPU, the process's RSS: a new user's retries with the least named were refused 2 times in 3, each
asking 0.7-1.4% more)."""


def _infeasible_message(profiles: list[RankProfile], micro_batches: list[int], margin: float, policies: tuple[str, ...]) -> str:
    """The smallest budget that fits (at the leanest configuration) and what it is, per rank."""
    lines = []
    for rank, profile in enumerate(profiles):
        leanest = min(((_leanest(profile, m, o, policies), o.name) for m in micro_batches[:1] for o in profile.options),
                      key=lambda pair: pair[0].peak_bytes)
        choice, option = leanest
        needed = math.ceil(choice.peak_bytes / (1.0 - margin))
        if needed > profile.budget_bytes:
            lines.append(
                f"rank {rank}: budget {profile.budget_bytes / 2**20:,.1f} MiB, but the leanest plan (micro-batch {choice.micro_batch}, "
                f"optimizer {option}, blocks {policy_counts(choice.policies)}) is predicted to peak at {choice.peak_bytes / 2**20:,.1f} MiB, "
                f"so it is predicted to need a budget of at least {needed / 2**20:,.1f} MiB ({needed:,} bytes) with margin {margin:g}; "
                # (to a tenth of a MiB: to a whole one, a new user's 4.8 MiB need was advised 6, "5% more")
                f"give {math.ceil(needed * (1 + RETRY_HEADROOM) / 2**20 * 10) / 10:,.1f} MiB, {RETRY_HEADROOM:.0%} more, for what the "
                "readings vary by between runs"
            )
    return "AutoFit: no configuration fits the budget. " + "; ".join(lines or ["every rank's leanest plan misses it"])


def plan_table(plan: FitPlan, measured: list[dict[str, float]] | None = None) -> str:
    """The plan as a table: each rank's choices, predicted peak and step time (and the measured
    figures beside them when given); a rank whose prediction is above its budget less the margin (a re-plan that took
    the leanest policies), or whose measured peak is above its budget, says so at the row's end."""
    lines = [
        f"AutoFit plan: optimizer states {plan.optimizer}, global batch {plan.samples_per_step}"
        + ((f", micro-batch {plan.ranks[0].micro_batch} x {plan.accumulation} accumulated" if plan.accumulation > 1
            else f", micro-batch {plan.ranks[0].micro_batch} (no accumulation)") if plan.accumulation is not None else ", caps per rank, shares by speed")
        + f", margin {plan.margin:.3g}; predicted {plan.tokens_per_s:,.0f} {plan.rate_of}/s, {plan.step_s * 1e3:,.1f} ms/step",
        # under the heterogeneous strategies a rank's micro-batch is at most its cap (its share may take less)
        f"  {'rank':<5} {'budget MiB':>11} {'micro' if plan.accumulation is not None else 'cap':>6}  {'blocks':<28} {'peak MiB':>10} {'ms/step':>9}"
        + (f" {'measured MiB':>13} {'measured ms':>12}" if measured else ""),
    ]
    # no policies: blocks kept unprofiled, or none found, or the user's ActivationMemory's (the notes say which)
    unplanned = "every block kept" if any(n.startswith("blocks not profiled") for n in plan.notes) else "-"
    for rank, (choice, budget) in enumerate(zip(plan.ranks, plan.budgets)):
        blocks = policy_counts(choice.policies) if choice.policies else unplanned
        row = (f"  {rank:<5} {budget / 2**20:>11,.1f} {choice.micro_batch:>6}  {blocks:<28} "
               f"{choice.peak_bytes / 2**20:>10,.1f} {choice.step_s * 1e3:>9,.1f}")
        if measured:
            m = measured[rank]
            row += f" {m['peak_bytes'] / 2**20:>13,.1f} {m['step_s'] * 1e3:>12,.1f}"
        usable = budget * (1 - plan.margin)
        if choice.peak_bytes > usable:
            row += f"  predicted above the {usable / 2**20:,.1f} MiB usable"
        if measured and measured[rank]["peak_bytes"] > budget:
            row += "  measured above the budget"
        lines.append(row)
    lines.extend(f"  note: {note}" for note in plan.notes)
    return "\n".join(lines)
