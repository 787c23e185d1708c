"""Exact memory counts in plain torch: saved-for-backward bytes, optimizer-state bytes, peak RSS.

Every count is of distinct storages (two views of one storage count once), in bytes.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from lightning_efficient._torch import storage_key


def _iter_tensors(obj: object) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _iter_tensors(value)


def first_tensor(obj: object) -> Tensor | None:
    """The first tensor in a batch (a tensor, or nested dicts, lists and tuples), or None."""
    return next(_iter_tensors(obj), None)


def distinct_storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor.layout != torch.strided:
            continue
        seen.setdefault(storage_key(tensor), tensor.untyped_storage().nbytes())
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Exact bytes of every tensor in ``optimizer.state`` (any optimizer, bitsandbytes' included).

    Tensors shared between parameters (such as bitsandbytes' quantization maps) count once.
    """
    return distinct_storage_bytes(_iter_tensors(list(optimizer.state.values())))


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's distinct parameters (tied weights count once)."""
    return distinct_storage_bytes(module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's gradients that currently exist."""
    return distinct_storage_bytes(p.grad for p in module.parameters() if p.grad is not None)


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward while the context is active.

    A ``torch.autograd.graph.saved_tensors_hooks`` context whose pack hook notes each saved
    tensor's storage and returns the tensor unchanged, so nothing is copied or kept alive longer.
    Storages of the ``exclude`` tensors (pass the model's parameters and buffers) are not counted:
    they are not activations. What an inner ``saved_tensors_hooks`` context (activation
    checkpointing, offload) packs is not seen here, by the way these hooks nest.

    Args:
        exclude: tensors whose storages are not activations.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {storage_key(t) for t in exclude if t.layout == torch.strided}
        self._seen: dict[tuple[str, int], int] = {}
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: Tensor) -> Tensor:
        if tensor.layout == torch.strided:
            key = storage_key(tensor)
            if key not in self._excluded:
                self._seen.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    @staticmethod
    def _unpack(tensor: Tensor) -> Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        """Distinct bytes saved so far."""
        return sum(self._seen.values())

    def __enter__(self) -> SavedTensorCounter:
        self._seen.clear()
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._context is not None
        self._context.__exit__(*exc)
        self._context = None


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``VmHWM`` on Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    """This process's resident set size now, in bytes (0 where unknown)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
