"""One normalisation for data parallelism: by the global count of contributing tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def distributed_world_size() -> int:
    """The default process group's size (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_sum(value: Tensor) -> Tensor:
    """``value`` summed over every rank (a copy; unchanged outside torch.distributed)."""
    total = value.detach().clone()
    if distributed_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_gather_variable(local: Tensor) -> Tensor:
    """Concatenate a 1-D tensor of any length from every rank (padded to the longest, then trimmed)."""
    world = distributed_world_size()
    if world == 1:
        return local
    count = torch.tensor([local.numel()], device=local.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    longest = int(max(c.item() for c in counts))
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(c.item())] for g, c in zip(gathered, counts)])


def global_kept_count(keep: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Every rank's number of kept tokens, summed (at least 1, so that it can divide)."""
    return global_sum(keep.sum().to(dtype)).clamp_min(1)


def globally_normalised_loss(token_losses: Tensor, keep: Tensor, global_count: Tensor | None = None) -> Tensor:
    """Sum of the kept losses over the *global* number of kept tokens, times the world size.

    DDP averages gradients over ranks, so every rank's gradient of this loss averages to the
    gradient of (sum of every rank's kept losses) / (every rank's kept count): the update is the
    same however the tokens are split across ranks. ``global_count`` is that count when the caller
    has it already (:func:`global_kept_count`); otherwise it is all-reduced here.
    """
    kept_sum = torch.where(keep, token_losses, torch.zeros((), dtype=token_losses.dtype, device=token_losses.device))
    if global_count is None:
        global_count = global_kept_count(keep, token_losses.dtype)
    return kept_sum.sum() * distributed_world_size() / global_count.to(token_losses.dtype)
