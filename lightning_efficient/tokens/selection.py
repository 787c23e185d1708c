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

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

METHODS = ("eslm", "rho1", "topk", "random", "none")
SCORES = ("loss", "entropy")

Gather = Callable[[Tensor], Tensor]


@dataclass
class Selection:
    """A keep mask and what it was chosen by.

    Attributes:
        keep: bool mask of the tokens the loss keeps (a subset of the valid ones).
        threshold: the score at or above which a valid token is kept (None for ``none``).
        kept_fraction: kept / valid tokens in this process.
        kept_mean_score: mean score of the kept tokens (nan when none).
        dropped_mean_score: mean score of the valid tokens dropped (nan when none).
    """

    keep: Tensor
    threshold: float | None
    kept_fraction: float
    kept_mean_score: float
    dropped_mean_score: float


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
    scores = scores.detach().float()
    dropped = valid & ~keep
    n_valid = int(valid.sum())
    n_kept = int(keep.sum())
    kept_mean = float(scores[keep].mean()) if n_kept else math.nan
    dropped_mean = float(scores[dropped].mean()) if n_valid > n_kept else math.nan
    return Selection(keep, threshold, n_kept / n_valid if n_valid else 0.0, kept_mean, dropped_mean)


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
