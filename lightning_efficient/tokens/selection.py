"""Token-selection rules in plain torch: which tokens of a batch the step loss keeps.

Every rule turns per-token *scores* into a keep mask the same way: with ``n`` valid scores in
scope and ``keep_ratio`` r, ``n_keep = n - floor((1 - r) * n)`` (that is ``ceil(r * n)``), the
threshold is the ``n_keep``-th largest valid score, and a valid token is kept when its score is at
or above the threshold (so ties at the threshold are all kept). What differs is the score:

* ``eslm``: the per-token loss or the predictive entropy. The threshold is then the Value-at-Risk
  at level alpha = 1 - r (the lower empirical alpha-quantile, ``sorted[floor(alpha * n)]``) and the
  mean loss of the kept tokens is the CVaR. With ``score="loss"`` it keeps the tokens ``topk`` keeps.
* ``rho1``: the excess loss, per-token loss minus a reference model's loss on the same token.
* ``topk``: the per-token loss.
* ``random``: uniform random numbers from a seeded generator (a uniform random subset).
* ``none``: every valid token.

Scope: the scores in scope are this process's (``gather=None``), or every rank's when ``gather``
concatenates a 1-D tensor across ranks (``scope="global"``). The global threshold is exact: every
rank gathers all valid scores (``4 x total tokens`` bytes moved per step, padded to the largest
rank's count) and takes the same order statistic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

METHODS = ("eslm", "rho1", "topk", "random", "none")
SCORES = ("loss", "entropy")

Gather = Callable[[Tensor], Tensor]


@dataclass
class Selection:
    """A keep mask and what it was chosen by.

    The summary figures are computed when first read: each is a device sync, and the callback reads
    them only on the steps it logs.

    Attributes:
        keep: bool mask of the tokens the loss keeps (a subset of the valid ones).
        threshold: the score at or above which a valid token is kept (None for ``none``).
        scores: the (detached) scores the mask was chosen by.
        valid: bool mask of the tokens that count.
    """

    keep: Tensor
    threshold: float | None
    scores: Tensor
    valid: Tensor

    @functools.cached_property
    def kept_fraction(self) -> float:
        """Kept / valid tokens in this process (0 when none is valid)."""
        n_valid = int(self.valid.sum())
        return int(self.keep.sum()) / n_valid if n_valid else 0.0

    @functools.cached_property
    def kept_mean_score(self) -> float:
        """Mean score of the kept tokens (nan when none)."""
        return _mean_or_nan(self.scores, self.keep)

    @functools.cached_property
    def dropped_mean_score(self) -> float:
        """Mean score of the valid tokens dropped (nan when none)."""
        return _mean_or_nan(self.scores, self.valid & ~self.keep)


def _mean_or_nan(scores: Tensor, where: Tensor) -> float:
    count = int(where.sum())
    return float(scores[where].mean()) if count else math.nan


def kept_count(n_valid: int, keep_ratio: float) -> int:
    """How many of ``n_valid`` tokens a ratio keeps: ``n - floor((1 - keep_ratio) * n)``."""
    if n_valid == 0:
        return 0
    return n_valid - math.floor((1.0 - keep_ratio) * n_valid + 1e-9)


def _gathered_valid_scores(scores: Tensor, valid: Tensor, gather: Gather | None) -> Tensor:
    local = scores[valid].detach().float()
    return local if gather is None else gather(local)


def threshold_keep(scores: Tensor, valid: Tensor, keep_ratio: float, gather: Gather | None = None) -> Selection:
    """Keep the valid tokens whose score is at or above the ``n_keep``-th largest score in scope.

    Args:
        scores: per-token scores, any shape.
        valid: bool mask of the same shape.
        keep_ratio: fraction to keep, in (0, 1].
        gather: concatenates a 1-D tensor across ranks for a global threshold; None for local.
    """
    in_scope = _gathered_valid_scores(scores, valid, gather)
    n_keep = kept_count(in_scope.numel(), keep_ratio)
    if n_keep == 0:
        keep = torch.zeros_like(valid)
        return _summarise(scores, valid, keep, None)
    threshold = torch.kthvalue(in_scope, in_scope.numel() - n_keep + 1).values
    keep = valid & (scores.detach().float() >= threshold)
    return _summarise(scores, valid, keep, float(threshold))


def _summarise(scores: Tensor, valid: Tensor, keep: Tensor, threshold: float | None) -> Selection:
    return Selection(keep, threshold, scores.detach().float(), valid)


def summarise_selection(scores: Tensor, valid: Tensor, keep: Tensor, threshold: float | None) -> Selection:
    """The :class:`Selection` of a keep mask already chosen (by ``threshold``, or None) from ``scores``."""
    return _summarise(scores, valid, keep, threshold)


def select_tokens(
    method: str,
    losses: Tensor,
    valid: Tensor,
    keep_ratio: float,
    *,
    entropy: Tensor | None = None,
    reference_losses: Tensor | None = None,
    score: str = "loss",
    generator: torch.Generator | None = None,
    gather: Gather | None = None,
) -> Selection:
    """Apply a selection rule (see the module docstring) to one batch's per-token losses.

    Args:
        method: one of ``eslm``, ``rho1``, ``topk``, ``random``, ``none``.
        losses: per-token losses.
        valid: bool mask, true where a token counts.
        keep_ratio: fraction of valid tokens to keep, in (0, 1].
        entropy: per-token predictive entropy (``eslm`` with ``score="entropy"``).
        reference_losses: the reference model's per-token losses (``rho1``).
        score: ``"loss"`` or ``"entropy"`` for ``eslm``.
        generator: the random source of ``random`` (a CPU generator).
        gather: concatenates a 1-D tensor across ranks for a global threshold.

    Raises:
        ValueError: for an unknown method or score, a keep_ratio outside (0, 1], or a missing input.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed: expected one of {', '.join(METHODS)}.")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio={keep_ratio!r} is not allowed: expected a fraction in (0, 1].")
    if method == "none" or keep_ratio == 1.0:
        return _summarise(losses, valid, valid.clone(), None)
    if method == "eslm":
        if score not in SCORES:
            raise ValueError(f"score={score!r} is not allowed: expected one of {', '.join(SCORES)}.")
        if score == "entropy" and entropy is None:
            raise ValueError("score='entropy' needs the per-token entropy (return FusedTokenLoss or pass entropy)")
        scores = entropy if score == "entropy" else losses
    elif method == "rho1":
        if reference_losses is None:
            raise ValueError("method='rho1' needs reference_losses (from a reference model or the batch)")
        scores = losses.detach() - reference_losses.to(losses.dtype)
    elif method == "topk":
        scores = losses
    else:
        scores = torch.rand(losses.shape, generator=generator).to(losses.device)
    return threshold_keep(scores, valid, keep_ratio, gather)


@dataclass(frozen=True)
class KeepRatioSchedule:
    """The keep ratio by optimizer step: 1.0 (full loss) for ``warmup_steps``, then a linear ramp
    from ``start_ratio`` to ``end_ratio`` over ``ramp_steps``, then ``end_ratio``."""

    end_ratio: float
    start_ratio: float = 1.0
    warmup_steps: int = 0
    ramp_steps: int = 0

    def __call__(self, step: int) -> float:
        """The keep ratio at optimizer step ``step``."""
        if step < self.warmup_steps:
            return 1.0
        if self.ramp_steps <= 0:
            return self.end_ratio
        progress = min(1.0, (step - self.warmup_steps) / self.ramp_steps)
        return self.start_ratio + (self.end_ratio - self.start_ratio) * progress


def _quantile_grid(values: Tensor, points: int) -> Tensor:
    """``values``' quantiles at levels ``i / (points - 1)`` (linear interpolation), float64 on the host."""
    ordered = values.detach().double().sort().values.cpu()
    positions = torch.linspace(0.0, ordered.numel() - 1, points, dtype=torch.float64)
    low = positions.floor().long()
    high = positions.ceil().long()
    return ordered[low] + (ordered[high] - ordered[low]) * (positions - low)


def _merged_grid(grids: Tensor, counts: Tensor, points: int) -> Tensor:
    """The quantile grid of the mixture of several grids, each standing for ``count`` scores."""
    present = counts > 0
    grids, counts = grids[present], counts[present].double()
    values = grids.reshape(-1)
    weights = (counts / grids.shape[1]).repeat_interleave(grids.shape[1])
    order = values.argsort()
    values, cumulative = values[order], weights[order].cumsum(0)
    cumulative = (cumulative - weights[order] / 2) / cumulative[-1]  # each point at its weight's centre
    levels = torch.linspace(0.0, 1.0, points, dtype=torch.float64)
    index = torch.searchsorted(cumulative, levels).clamp(1, values.numel() - 1)
    low, high = cumulative[index - 1], cumulative[index]
    fraction = ((levels - low) / (high - low).clamp_min(1e-300)).clamp(0.0, 1.0)
    return values[index - 1] + (values[index] - values[index - 1]) * fraction


class RunningThreshold:
    """A running estimate of a selection rule's threshold, known before the step's forward pass.

    The streaming path (:mod:`lightning_efficient.tokens.streaming`) needs the threshold before it
    sees the step's scores. This estimate keeps the score quantiles of the previous optimizer steps
    (every micro-batch of a step, and under ``scope="global"`` every rank's, so that every rank uses
    the same threshold) as a grid of :attr:`POINTS` values, averaged over steps
    (``grid += smoothing * (step's grid - grid)``: an average of quantile functions), and reads the
    threshold at the level ``keep_ratio + correction``. The correction is fed back from the
    realised keep ratio: after each step that used the estimate,
    ``correction += gain * (target - realised)`` (clamped to [-0.5, 0.5]).

    Tolerance: a step's realised keep ratio differs from the target by the sampling noise of its
    ``n`` valid scores (standard deviation about ``sqrt(r (1 - r) / n)``: 0.006 at 8k tokens and
    r = 0.5) plus the shift of its score distribution from the previous steps'; the feedback drives
    the mean over steps to the target, including while training lowers the losses (a drift that
    would otherwise bias every step). Tested: on stationary or steadily drifting scores at 2,048
    tokens a step, every step within 0.05 of the target and the mean within 0.015; on the tiny demo
    at its first steps (128 tokens a step), every step within 0.2 and the mean within 0.05. A keep
    ratio of 1.0 is not estimated: the caller keeps every valid token.

    Usage per micro-batch: :meth:`threshold` (None until a step has been observed: then use the
    batch-exact selection), :meth:`observe` with the micro-batch's valid scores; after the step's last
    backward, :meth:`end_step` (on every rank, together: it gathers once under data parallelism).

    Args:
        gain: the feedback gain on the realised keep ratio, in (0, 1].
        smoothing: the weight of the newest step's quantiles in the average, in (0, 1] (1: the last
            step's alone).

    Raises:
        ValueError: for a gain or smoothing outside (0, 1].
    """

    #: quantile grid points (levels 0, 1/1024, ..., 1)
    POINTS = 1025
    #: the correction's bound: the estimate never moves the level further than this from the target
    MAX_CORRECTION = 0.5

    def __init__(self, gain: float = 0.5, smoothing: float = 0.3) -> None:
        if not (isinstance(gain, (int, float)) and 0.0 < gain <= 1.0):
            raise ValueError(f"gain={gain!r} is not allowed: expected a number in (0, 1].")
        if not (isinstance(smoothing, (int, float)) and 0.0 < smoothing <= 1.0):
            raise ValueError(f"smoothing={smoothing!r} is not allowed: expected a number in (0, 1].")
        self.gain = float(gain)
        self.smoothing = float(smoothing)
        self.grid: Tensor | None = None  # float64 on the host: the last step's score quantiles
        self.correction = 0.0  # added to the target keep ratio
        self.rank_states: list[dict[str, Any]] | None = None  # every rank's (grid, correction), for checkpoints
        self._scores: list[Tensor] = []  # this step's valid scores so far (detached, this rank)
        self._counts: Tensor | None = None  # [kept, valid] of this step's micro-batches that used the estimate
        self._target: float | None = None  # the keep ratio the estimate was used for this step

    def reset(self) -> None:
        """Forget the estimate and any step in progress."""
        self.grid = None
        self.correction = 0.0
        self.rank_states = None
        self.discard_step()

    def discard_step(self) -> None:
        """Forget what was observed in the step in progress (the estimate stays)."""
        self._scores, self._counts, self._target = [], None, None

    @property
    def pending(self) -> bool:
        """Whether scores of a step not yet folded into the estimate were observed."""
        return bool(self._scores) or self._counts is not None

    def threshold(self, keep_ratio: float) -> float | None:
        """The score at or above which a token is kept for ``keep_ratio`` (None without an estimate;
        ``-inf`` when the corrected level keeps everything)."""
        if self.grid is None:
            return None
        level = keep_ratio + self.correction
        if level >= 1.0:
            return -math.inf
        position = (1.0 - max(level, 0.0)) * (self.POINTS - 1)
        low = min(math.floor(position), self.POINTS - 2)
        fraction = position - low
        return float(self.grid[low] + (self.grid[low + 1] - self.grid[low]) * fraction)

    def observe(self, scores: Tensor, valid: Tensor, keep: Tensor | None = None, target: float | None = None) -> None:
        """Record a micro-batch's scores; with ``keep`` and ``target``, it used the estimate at keep
        ratio ``target`` and kept ``keep``: its realised ratio feeds the correction."""
        self._scores.append(scores.detach()[valid])
        if keep is not None and target is not None:
            counts = torch.stack([keep.sum(), valid.sum()]).to(torch.float64)
            self._counts = counts if self._counts is None else self._counts + counts
            self._target = target

    def end_step(self, gather: Callable[[Tensor], Tensor] | None = None, scope: str = "batch") -> None:
        """Fold the step's observations into the estimate (nothing to do when none were made).

        Args:
            gather: stacks a fixed-size 1-D tensor from every rank into ``[ranks, size]`` (None: one
                process). Every rank calls this together when given.
            scope: ``"global"``: one estimate from every rank's scores, the same on every rank;
                ``"batch"``: each rank's own (the others' are kept only for checkpoints).
        """
        device = self._scores[0].device if self._scores else torch.device("cpu")
        scores = torch.cat(self._scores) if self._scores else torch.zeros(0)
        counts = self._counts if self._counts is not None else torch.zeros(2, dtype=torch.float64)
        target = math.nan if self._target is None else self._target
        self.discard_step()
        grid = _quantile_grid(scores, self.POINTS) if scores.numel() else torch.full((self.POINTS,), math.nan, dtype=torch.float64)
        mine = torch.cat([grid, torch.tensor([float(scores.numel()), target], dtype=torch.float64), counts.cpu()])
        rows = mine.unsqueeze(0) if gather is None else gather(mine.to(device)).cpu().double()
        rank = 0 if gather is None else _rank()
        grids, numbers, targets, kept, counted = (rows[:, : self.POINTS], rows[:, self.POINTS], rows[:, self.POINTS + 1],
                                                  rows[:, self.POINTS + 2], rows[:, self.POINTS + 3])
        if scope == "global":  # every rank folds the same numbers: one estimate, the same everywhere
            grid = _merged_grid(grids, numbers, self.POINTS) if numbers.sum() > 0 else None
            used = ~targets.isnan()
            target = float(targets[used].mean()) if used.any() else math.nan
            self.rank_states = None
            self.grid, self.correction = self._folded(self._rank_state(rank), grid, float(kept.sum()), float(counted.sum()),
                                                      target)
            return
        states = [self._folded(self._rank_state(r), grids[r] if numbers[r] > 0 else None, float(kept[r]),
                               float(counted[r]), float(targets[r])) for r in range(rows.shape[0])]
        self.rank_states = [{"grid": g, "correction": c} for g, c in states] if len(states) > 1 else None
        self.grid, self.correction = states[rank]

    def _folded(self, previous: dict[str, Any], grid: Tensor | None, kept: float, counted: float,
                target: float) -> tuple[Tensor | None, float]:
        """One rank's (grid, correction) after a step: the step's grid (the previous one when it saw
        no scores) and the correction moved by the realised keep ratio (when the estimate was used)."""
        correction = previous["correction"]
        if counted > 0 and not math.isnan(target):
            error = target - kept / counted
            correction = min(max(correction + self.gain * error, -self.MAX_CORRECTION), self.MAX_CORRECTION)
        if grid is None:
            return previous["grid"], correction
        if previous["grid"] is not None and self.smoothing < 1.0:  # an average of quantile functions
            grid = previous["grid"] + self.smoothing * (grid - previous["grid"])
        return grid, correction

    def _rank_state(self, rank: int) -> dict[str, Any]:
        if self.rank_states is not None and rank < len(self.rank_states):
            return self.rank_states[rank]
        return {"grid": self.grid, "correction": self.correction}

    def state_dict(self) -> dict[str, Any]:
        """The estimate (every rank's, under data parallelism), as plain lists for a checkpoint."""
        states = self.rank_states or [{"grid": self.grid, "correction": self.correction}]
        return {"ranks": [{"grid": None if s["grid"] is None else s["grid"].tolist(), "correction": s["correction"]}
                          for s in states], "gain": self.gain, "smoothing": self.smoothing}

    def load_state_dict(self, state: dict[str, Any], rank: int = 0) -> None:
        """Restore :meth:`state_dict`'s estimate; this process takes rank ``rank``'s (rank 0's when the
        checkpoint has fewer ranks)."""
        self.discard_step()
        states = [{"grid": None if s["grid"] is None else torch.tensor(s["grid"], dtype=torch.float64),
                   "correction": float(s["correction"])} for s in state["ranks"]]
        self.rank_states = states if len(states) > 1 else None
        own = states[rank] if rank < len(states) else states[0]
        self.grid, self.correction = own["grid"], own["correction"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
