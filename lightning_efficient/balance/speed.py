"""A rank's compute time per micro-step as a fixed cost plus a cost per sample (pure Python).

Shares proportional to samples per second assume that a micro-step's time is proportional to its
samples. On small models a fixed cost per micro-step (kernel launches, hooks, the optimizer's
bookkeeping, Python) dominates, and then a rank given fewer samples looks slower *per sample*, is
given fewer still, and the shares run away ([4, 4] -> [5, 3] -> [6, 2] -> [7, 1] on identical
ranks). :class:`MicroStepTimes` fits ``seconds = fixed + per_sample * samples`` from the micro-step
sizes a rank has trained, and :func:`equal_time_weights` gives the shares that end every rank's
step together under that model; :func:`predicted_step_time` is the slowest rank's step time.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence

_SIZES_KEPT = 4  # the most recently trained micro-batch sizes the fit uses (older ones may be stale)


class MicroStepTimes:
    """One rank's compute seconds per micro-step, per micro-batch size: the median of the latest few
    (a pre-empted or stalled micro-step does not move it), leaving out the first micro-step measured
    (one-time costs: lazy initialisation, the allocator's first requests).

    Args:
        window: micro-steps per size the median is taken over.
    """

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self.recent: OrderedDict[int, deque[float]] = OrderedDict()
        self._first_seen = False

    def observe(self, samples: int, seconds: float) -> None:
        """Add one micro-step of ``samples`` that computed for ``seconds``."""
        if samples < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        if not self._first_seen:
            self._first_seen = True
            return
        times = self.recent.pop(samples, None) or deque(maxlen=self.window)
        times.append(seconds)
        self.recent[samples] = times  # the most recently trained size last
        while len(self.recent) > _SIZES_KEPT:
            self.recent.popitem(last=False)

    @property
    def seconds(self) -> dict[int, float]:
        """The median seconds of each micro-batch size kept."""
        return {n: statistics.median(times) for n, times in self.recent.items()}

    def fit(self, min_count: int = 4) -> tuple[float, float, float]:
        """``(fixed, per_sample, noise)``: seconds of a micro-step and the measurements' relative spread
        (median absolute deviation over median, the largest over the sizes used), from the sizes
        measured at least ``min_count`` times; ``(nan, nan, nan)`` before any was.

        From one size the split cannot be told: all of it is counted per sample (proportional
        shares). From several, a least-squares line, kept to ``fixed >= 0`` and ``per_sample > 0``."""
        used = {n: times for n, times in self.recent.items() if len(times) >= min_count}
        if not used:
            return math.nan, math.nan, math.nan
        noise = 0.0
        for times in used.values():
            middle = statistics.median(times)
            noise = max(noise, statistics.median(abs(t - middle) for t in times) / middle)
        points = sorted((n, statistics.median(times)) for n, times in used.items())
        if len(points) == 1:
            n, t = points[0]
            return 0.0, t / n, noise
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread
        floor = 1e-3 * min(t / n for n, t in points)  # a size that took no longer is noise, not a free sample
        if slope <= floor:
            return max(mean_t - floor * mean_n, 0.0), floor, noise
        fixed = mean_t - slope * mean_n
        if fixed < 0:  # through the origin instead
            return 0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points), noise
        return fixed, slope, noise

    def reset(self) -> None:
        """Forget every measurement (a new fit: its first micro-step is left out again)."""
        self.recent.clear()
        self._first_seen = False


def equal_time_weights(global_batch: int, accumulation: int, fixed: Sequence[float], per_sample: Sequence[float]) -> list[float]:
    """Samples per rank (summing to ``global_batch``) for which every rank's step —
    ``accumulation * fixed + per_sample * samples`` — takes the same time; a rank whose fixed cost
    alone exceeds that time gets a token weight (the planner still gives it its minimum)."""
    inverse = [1.0 / b for b in per_sample]
    level = (global_batch + sum(accumulation * a / b for a, b in zip(fixed, per_sample))) / sum(inverse)
    weights = [(level - accumulation * a) / b for a, b in zip(fixed, per_sample)]
    return [max(w, 1e-6 * global_batch) for w in weights]


def predicted_step_time(shares: Sequence[int], accumulation: int, fixed: Sequence[float], per_sample: Sequence[float]) -> float:
    """The slowest rank's compute seconds per optimizer step with ``shares`` split into ``accumulation`` micro-batches."""
    return max(accumulation * a + b * s for s, a, b in zip(shares, fixed, per_sample))
