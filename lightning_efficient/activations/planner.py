"""The ``auto`` planner: per block, the policy of least time cost that fits a memory budget.

Pure functions over :class:`BlockProfile` figures, so they can be tested on synthetic profiles.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

from lightning_efficient._validation import SettingRefused


@dataclass
class BlockProfile:
    """What one block costs under each policy, measured on a real training step.

    Attributes:
        name: the block's qualified name.
        held_bytes: policy -> activation bytes the block holds for backward under it.
        cost_s: policy -> extra seconds per step it costs (recompute or transfer time).
    """

    name: str
    held_bytes: dict[str, int] = field(default_factory=dict)
    cost_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Plan:
    """A policy per block, with the activation bytes it holds and its estimated time cost."""

    policies: list[str]
    held_bytes: int
    cost_s: float
    baseline_bytes: int

    def rows(self, profiles: list[BlockProfile]) -> list[tuple[str, str, int, float]]:
        """``(block, policy, bytes saved against keep, estimated seconds)`` per block."""
        return [
            (p.name, policy, p.held_bytes["keep"] - p.held_bytes[policy], p.cost_s[policy])
            for p, policy in zip(profiles, self.policies)
        ]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget: int | float | str, baseline_bytes: int | None = None) -> int:
    """Bytes from ``budget``: an int of bytes, a string like ``"6GiB"``/``"500MB"``/``"1000"``, or a fraction in (0, 1] of
    ``baseline_bytes`` (the activation bytes with every block kept) as a float or a unitless decimal string (``"0.5"``,
    as YAML or a command line gives it); a fraction without ``baseline_bytes`` gives -1 (resolved once measured).

    Raises:
        ValueError: naming ``budget`` when it is <= 0, unparseable, a unitless decimal above 1 or under one byte.
    """
    if isinstance(budget, bool):
        raise ValueError(f"budget={budget!r} is not allowed: expected bytes, a string like '6GiB' or a fraction in (0, 1]")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget!r} is not allowed: a float is a fraction of the baseline in (0, 1]")
        if baseline_bytes is None:
            return -1  # resolved once the baseline is measured
        return int(budget * baseline_bytes)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget={budget!r} is not allowed: expected a number of bytes > 0")
        return budget
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"budget={budget!r} is not allowed: expected bytes > 0, e.g. 6GiB, 500MB or 0.5 (a fraction)")
    number, unit = match.groups()
    if not unit and "." in number:  # "0.5" from a YAML file or the command line: the fraction 0.5 means
        if float(number) > 1.0:
            raise ValueError(f"budget={budget!r} is not allowed: a number with a decimal point and no unit is a fraction "
                             "of the baseline in (0, 1]; give bytes as a whole number or with a unit (e.g. 1.5GiB)")
        return parse_budget(float(number), baseline_bytes)
    nbytes = int(float(number) * _UNITS[unit.lower()])
    if nbytes < 1:
        raise ValueError(f"budget={budget!r} is not allowed: it is less than one byte")
    return nbytes


def _hull(options: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """The options on the lower convex hull of (held bytes, cost), from most held (cheapest) to least."""
    frontier: list[tuple[int, float, str]] = []
    for option in sorted(options, key=lambda o: (o[0], o[1])):  # leanest first
        if frontier and option[1] >= frontier[-1][1]:
            continue  # dominated: holds more than a leaner option and costs no less
        frontier.append(option)
    frontier.reverse()  # most held (cheapest) first
    hull: list[tuple[int, float, str]] = []
    for option in frontier:
        while len(hull) >= 2:
            (h0, c0, _), (h1, c1, _) = hull[-2], hull[-1]
            # keep hull[-1] only if its marginal cost per byte is below the next one's
            if (c1 - c0) * (h1 - option[0]) < (option[1] - c1) * (h0 - h1):
                break
            hull.pop()
        hull.append(option)
    return hull


def plan_blocks(
    profiles: list[BlockProfile], budget_bytes: int, fixed_bytes: int = 0, policies: tuple[str, ...] | None = None
) -> Plan:
    """Choose a policy per block so that ``fixed_bytes`` + the blocks' held bytes <= ``budget_bytes``
    at the least estimated time cost.

    Greedy along each block's lower convex hull of (bytes held, cost): repeatedly take the step with
    the least extra seconds per byte saved until the budget is met, then undo any step the budget
    no longer needs. Along hulls the greedy is optimal for the fractional problem, so the plan costs
    at most the optimum plus the cost of one block's last step; the result is checked against the
    budget.

    Args:
        profiles: one per block.
        budget_bytes: the activation bytes allowed for backward.
        fixed_bytes: activation bytes outside the blocks (embeddings, head, logits), not plannable.
        policies: the policies allowed (default: all that every profile has).

    Raises:
        SettingRefused: (a ValueError) when even the leanest policy of every block exceeds the budget, with the minimum.
    """
    allowed = policies or (tuple(set.intersection(*(set(p.held_bytes) for p in profiles))) if profiles else ())
    hulls = [_hull([(p.held_bytes[k], p.cost_s[k], k) for k in allowed if k in p.held_bytes]) for p in profiles]
    minimum = fixed_bytes + sum(h[-1][0] for h in hulls)
    baseline = fixed_bytes + sum(p.held_bytes["keep"] for p in profiles)
    if minimum > budget_bytes:
        raise SettingRefused(
            f"budget={budget_bytes:,} bytes is below what the leanest plan reaches: {minimum:,} bytes "
            f"({fixed_bytes:,} outside the blocks + {minimum - fixed_bytes:,} with {', '.join(sorted({h[-1][2] for h in hulls}))}); "
            f"every block kept holds {baseline:,}"
        )
    position = [0] * len(hulls)
    held = fixed_bytes + sum(h[0][0] for h in hulls)
    steps: list[tuple[float, int]] = []
    for index, hull in enumerate(hulls):
        if len(hull) > 1:
            heapq.heappush(steps, (_rate(hull, 0), index))
    taken: list[int] = []
    while held > budget_bytes and steps:
        _, index = heapq.heappop(steps)
        hull, at = hulls[index], position[index]
        held -= hull[at][0] - hull[at + 1][0]
        position[index] = at + 1
        taken.append(index)
        if at + 2 < len(hull):
            heapq.heappush(steps, (_rate(hull, at + 1), index))
    for index in sorted(set(taken), key=lambda i: -hulls[i][position[i]][1]):  # undo steps not needed
        while position[index] > 0:
            hull, at = hulls[index], position[index]
            if held + hull[at - 1][0] - hull[at][0] > budget_bytes:
                break
            held += hull[at - 1][0] - hull[at][0]
            position[index] = at - 1
    chosen = [hulls[i][position[i]] for i in range(len(hulls))]
    plan = Plan([c[2] for c in chosen], fixed_bytes + sum(c[0] for c in chosen), sum(c[1] for c in chosen), baseline)
    assert plan.held_bytes <= budget_bytes, "planner invariant: the plan meets the budget"
    return plan


def _rate(hull: list[tuple[int, float, str]], at: int) -> float:
    saved = hull[at][0] - hull[at + 1][0]
    return (hull[at + 1][1] - hull[at][1]) / max(saved, 1)
