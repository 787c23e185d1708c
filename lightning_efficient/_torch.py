"""Small torch helpers shared across the plugins: storage identity, device sync, seeded orders."""

from __future__ import annotations

import torch
from torch import Tensor


def storage_key(tensor: Tensor) -> tuple[str, int]:
    """Identity of the storage behind ``tensor``: two views of one storage share it."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def synchronize(device: torch.device | str | None) -> None:
    """Wait for ``device``'s queued work (CUDA only; a no-op on CPU), so a host timer sees it done."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def seeded_permutation(length: int, seed: int, shuffle: bool = True) -> list[int]:
    """``range(length)`` permuted by a generator seeded with ``seed`` (the identity if not ``shuffle``).

    Every rank computes the same order from the same seed, so no communication is needed.
    """
    if not shuffle:
        return list(range(length))
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(length, generator=generator).tolist()
