"""Small torch helpers shared across the plugins: storage identity, what trains, device sync and timing, seeded orders,
random streams put back."""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor


def storage_key(tensor: Tensor) -> tuple[str, int]:
    """Identity of the storage behind ``tensor``: two views of one storage share it."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def eager_saved_tensors_hooks(pack: Any, unpack: Any) -> torch.autograd.graph.saved_tensors_hooks:
    """``saved_tensors_hooks(pack, unpack)`` whose hooks torch.compile never traces. Autograd calls them from the eager
    parts of a compiled function (after a graph break), where dynamo would otherwise compile each hook again for every
    tensor shape it saw, up to its recompile limit, with a warning (a new user's trial: ``MemoryReport`` beside a model
    with a graph break)."""
    return torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(pack), torch.compiler.disable(unpack))


class Trainable(NamedTuple):
    """Which parameters of a module train (``requires_grad``): what a memory plan's gradients, optimizer states and
    saved activations were measured for. Two sets of the same size are told apart by their names' digest."""

    tensors: int
    elements: int
    names_digest: str

    @classmethod
    def of(cls, module: torch.nn.Module) -> Trainable:
        """What trains in ``module`` now."""
        training = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        digest = hashlib.sha1("\n".join(name for name, _ in training).encode()).hexdigest()
        return cls(len(training), sum(p.numel() for _, p in training), digest)

    @classmethod
    def saved(cls, value: Any) -> Trainable | None:
        """The set a checkpoint recorded (``list(trainable)``), or None where it recorded none or another form."""
        return cls(*value) if isinstance(value, (list, tuple)) and len(value) == 3 else None

    def changed_at_step_start(self, module: torch.nn.Module, batch_idx: int, accumulation: int) -> Trainable | None:
        """What trains now where it is not this set and ``batch_idx`` starts an optimizer step (its first micro-batch,
        whose gradients Lightning sets to None next: measuring there loses none); else None."""
        if batch_idx % accumulation:
            return None
        now = Trainable.of(module)
        return None if now == self else now


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


class DeviceClock:
    """Marks on a device's timeline, read without stalling the device.

    On CUDA a mark is an event recorded on the device's current stream, so the interval between two
    marks is the device's execution time, not the host's launch time; reading it waits only for
    the later mark. Elsewhere a mark is ``time.perf_counter()``, and the work is already done when
    the host records it.

    Args:
        device: the device whose work is timed.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"

    def mark(self) -> object:
        """A point on the device's timeline (enqueued after the work submitted so far)."""
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        """Seconds between two marks (on CUDA this waits for ``end`` to be reached)."""
        if self.on_cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


@contextlib.contextmanager
def random_streams_restored(device: torch.device) -> Iterator[None]:
    """torch's (CPU and this CUDA device), Python's and NumPy's global random states put back afterwards."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
