"""Per-rank shares of a global batch, proportional to speed and capped by memory (a pure function).

Every rank gets an integer share; the shares sum exactly to the global batch; each rank splits its
share into the same number of micro-batches (gradient accumulation steps), so every rank runs the
same number of forward/backward passes and optimizer steps and nothing hangs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SharePlan:
    """Samples per rank per optimizer step, and the micro-batches each is split into.

    Attributes:
        shares: samples of each rank per optimizer step (sum = the global batch).
        accumulation: micro-batches per optimizer step, the same on every rank.
    """

    shares: tuple[int, ...]
    accumulation: int

    def micro_batches(self, rank: int) -> list[int]:
        """Sizes of ``rank``'s micro-batches (as equal as possible, each >= 1)."""
        share, steps = self.shares[rank], self.accumulation
        return [share // steps + (1 if i < share % steps else 0) for i in range(steps)]

    def step_time(self, speeds: Sequence[float]) -> float:
        """The slowest rank's compute time per optimizer step at ``speeds`` (samples per second)."""
        return max(s / v for s, v in zip(self.shares, speeds))


def _validate(global_batch: int, speeds: Sequence[float], caps: Sequence[int | None]) -> None:
    world = len(speeds)
    if world < 1:
        raise ValueError("speeds must name at least one rank")
    if global_batch < world:
        raise ValueError(
            f"global_batch_size={global_batch} is smaller than the number of ranks ({world}): every rank needs "
            "at least one sample per step"
        )
    if any(not math.isfinite(v) or v <= 0 for v in speeds):
        raise ValueError(f"shares={list(speeds)} is not allowed: expected positive finite weights, one per rank")
    if len(caps) != world:
        raise ValueError(f"max_micro_batch={list(caps)} has {len(caps)} {'entry' if len(caps) == 1 else 'entries'} for {world} "
                         f"rank{'' if world == 1 else 's'}")
    if any(c is not None and (not isinstance(c, int) or c < 1) for c in caps):
        raise ValueError(f"max_micro_batch={list(caps)} is not allowed: expected integers >= 1 (or None: no cap)")


def _water_fill(total: int, speeds: Sequence[float], lower: Sequence[int], upper: Sequence[float]) -> list[int]:
    """Integer shares within [lower, upper], summing to ``total``, as close to proportional as possible."""
    low, high = 0.0, total / min(speeds) + 1.0
    for _ in range(200):  # bisect the multiplier so that the clipped shares sum to total
        mid = (low + high) / 2
        if sum(min(max(mid * v, lo), up) for v, lo, up in zip(speeds, lower, upper)) < total:
            low = mid
        else:
            high = mid
    ideal = [min(max(high * v, lo), up) for v, lo, up in zip(speeds, lower, upper)]
    shares = [max(lo, int(min(math.floor(x), up))) for x, lo, up in zip(ideal, lower, upper)]
    # largest remainder: hand the missing samples to the ranks with the largest fractional parts
    order = sorted(range(len(shares)), key=lambda r: (-(ideal[r] - math.floor(ideal[r])), r))
    missing = total - sum(shares)
    while missing > 0:
        progressed = False
        for r in order:
            if missing and shares[r] + 1 <= upper[r]:
                shares[r] += 1
                missing -= 1
                progressed = True
        if not progressed:
            break
    while missing < 0:  # clipping at the lower bounds can overshoot: take back from the largest
        r = max(range(len(shares)), key=lambda i: (shares[i] - lower[i], -i))
        shares[r] -= 1
        missing += 1
    return shares


def plan_shares(
    global_batch: int,
    speeds: Sequence[float],
    caps: Sequence[int | None] | None = None,
    accumulation: int | None = None,
    least_accumulation: int = 1,
) -> SharePlan:
    """Shares of ``global_batch`` proportional to ``speeds``, within each rank's micro-batch cap.

    Args:
        global_batch: samples per optimizer step over all ranks (>= number of ranks).
        speeds: each rank's samples per second (or any positive weights).
        caps: each rank's largest micro-batch (None: no cap).
        accumulation: micro-batches per step; None picks the smallest number (from
            ``least_accumulation``) for which the caps do not hold the shares away from proportional (or,
            failing that, the fastest feasible one).
        least_accumulation: where ``accumulation`` is None, the fewest micro-batches per step to consider
            (the ``accumulate_grad_batches`` a user set), at most ``global_batch // ranks``.

    Returns:
        The plan that minimises the slowest rank's time for that accumulation.

    Raises:
        ValueError: with the numbers, for a global batch smaller than the ranks, bad speeds or caps,
            or caps under which no accumulation up to ``global_batch // ranks`` fits the batch.
    """
    caps = list(caps) if caps is not None else [None] * len(speeds)
    _validate(global_batch, speeds, caps)
    world = len(speeds)
    most_accumulation = global_batch // world
    if accumulation is None and (isinstance(least_accumulation, bool) or not isinstance(least_accumulation, int)
                                 or least_accumulation < 1 or least_accumulation > most_accumulation):
        raise ValueError(f"least_accumulation={least_accumulation!r} is not allowed: expected an integer from 1 to "
                         f"{most_accumulation} (global batch {global_batch} over {world} rank(s))")
    candidates = [accumulation] if accumulation is not None else range(least_accumulation, most_accumulation + 1)
    best: SharePlan | None = None
    for steps in candidates:
        lower = [steps] * world
        upper = [math.inf if c is None else steps * c for c in caps]
        if sum(lower) > global_batch or sum(upper) < global_batch:
            continue
        shares = _water_fill(global_batch, speeds, lower, upper)
        plan = SharePlan(tuple(shares), steps)
        unconstrained = all(s < u for s, u in zip(shares, upper))
        if best is None or plan.step_time(speeds) < best.step_time(speeds) - 1e-12:
            best = plan
        if unconstrained:
            break
    if best is None:
        most = sum(math.inf if c is None else c for c in caps)
        raise ValueError(
            f"global_batch_size={global_batch} cannot be split over {world} ranks with max_micro_batch={caps}"
            + (f" and accumulation={accumulation}" if accumulation is not None else "")
            + f": at most {most} samples fit in one micro-step and every rank needs at least one sample per micro-step"
        )
    return best


def held_from_weights(plan: SharePlan, weights: Sequence[float], caps: Sequence[int | None], weights_said: str) -> str:
    """Why ``plan``'s shares are not those ``weights`` alone give (:func:`_water_fill` without bounds), where a bound
    holds a rank's share away: ``""``, or ``" (rank 1: a sample in each of its 3 micro-batches; <weights_said> alone
    give [6, 2])"`` (a new user's trial: shares 3:1 over 8 samples under caps [2, 8] trained 5:3, and nothing said why).
    A rank moved only by another's bound is not named."""
    free = _water_fill(sum(plan.shares), weights, [0] * len(weights), [math.inf] * len(weights))
    said = []
    for rank, (share, alone, cap) in enumerate(zip(plan.shares, free, caps)):
        if cap is not None and share == cap * plan.accumulation and share < alone:
            said.append(f"rank {rank}: its cap, {cap} a micro-batch")
        elif share == plan.accumulation and share > alone:
            said.append(f"rank {rank}: a sample in each of its {share} micro-batches" if share > 1 else
                        f"rank {rank}: a sample in its micro-batch")
    return f" ({'; '.join(said)}; {weights_said} alone give {free})" if said else ""


def _shrunk_upper(plan: SharePlan, accumulation: int) -> list[int]:
    """Each rank's most samples in ``accumulation`` micro-batches none larger than ``plan``'s largest on that rank."""
    return [min(share, accumulation * -(-share // plan.accumulation)) for share in plan.shares]


def shrunk_capacity(plan: SharePlan, accumulation: int) -> int:
    """The most samples :func:`shrunk_plan` can share in ``accumulation`` micro-batches."""
    return sum(_shrunk_upper(plan, accumulation))


def shrunk_plan(plan: SharePlan, samples: int, accumulation: int | None = None) -> SharePlan:
    """``plan`` for a global batch of ``samples`` fewer than its own (an epoch's short last batch), in
    ``accumulation`` micro-batches (at most ``plan``'s; None: ``plan``'s): shares in proportion to ``plan``'s, each at
    least the accumulation (a sample in every micro-batch) and with no micro-batch above ``plan``'s largest on that rank
    (so within any cap ``plan`` kept).

    Raises:
        ValueError: where ``samples`` cannot be shared so.
    """
    world, full, total = len(plan.shares), plan.accumulation, sum(plan.shares)
    steps = full if accumulation is None else accumulation
    if not 1 <= steps <= full:
        raise ValueError(f"accumulation={accumulation} is not allowed: expected 1 to {full} (plan {list(plan.shares)})")
    upper = _shrunk_upper(plan, steps)
    if not world * steps <= samples <= sum(upper):
        raise ValueError(f"samples={samples} is not allowed: expected {world * steps} to {sum(upper)} (plan {list(plan.shares)} "
                         f"in {steps} micro-batches)")
    if samples == total and steps == full:
        return plan
    return SharePlan(tuple(_water_fill(samples, plan.shares, [steps] * world, upper)), steps)


def largest_fitting_batch(fits: Callable[[int], bool], upper: int) -> int:
    """The largest micro-batch in ``[1, upper]`` for which ``fits(size)`` is true, assuming that what
    fits at one size fits at every smaller one: doubling from 1, then bisection.

    Raises:
        ValueError: when not even one sample fits.
    """
    if not fits(1):
        raise ValueError("max_micro_batch='auto': not even a micro-batch of 1 sample fits in device memory")
    good, size = 1, 2
    while size <= upper and fits(size):
        good, size = size, size * 2
    bad = min(size, upper + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
