"""Small torch helpers shared across the plugins: storage identity, device sync and timing, seeded orders, random
streams and an object's own generators put back."""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
import time
import types
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
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


_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
_NOT_HOLDING_GENERATORS = (Tensor, np.ndarray, str, bytes, bytearray, int, float, complex, type(None), type, types.ModuleType,
                           types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_SEARCHED_OBJECTS = 4096  # objects looked through for generators: a dataset that holds its samples is not walked whole
_SEARCHED_ITEMS = 64  # items looked at in one container


def held_generators(root: Any) -> list[Any]:
    """The random generators ``root`` holds (``torch.Generator``, NumPy's ``Generator`` and ``RandomState``,
    ``random.Random``), found through its attributes, containers and the objects in them (a dataset's transform), up to
    :data:`_SEARCHED_OBJECTS` objects and the first :data:`_SEARCHED_ITEMS` items of each container."""
    found, seen, queue = [], set(), deque([root])
    while queue and len(seen) < _SEARCHED_OBJECTS:
        value = queue.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, _GENERATORS) and not isinstance(value, random.SystemRandom):
            found.append(value)
        elif isinstance(value, _NOT_HOLDING_GENERATORS):
            continue
        elif isinstance(value, Mapping):
            queue.extend(itertools.islice(value.values(), _SEARCHED_ITEMS))
        elif isinstance(value, list | tuple | set | frozenset | deque):
            queue.extend(itertools.islice(value, _SEARCHED_ITEMS))
        elif isinstance(getattr(value, "__dict__", None), dict):
            queue.extend(itertools.islice(vars(value).values(), _SEARCHED_ITEMS))
    return found


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return copy.deepcopy(generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        return generator.get_state()
    return generator.getstate()


def _set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)


@contextlib.contextmanager
def held_generators_restored(*roots: Any) -> Iterator[None]:
    """The random generators ``roots`` hold (:func:`held_generators`) put back afterwards: reading a dataset's samples
    before the fit (to compare the ranks' datasets, to measure a step) must not move the generator its augmentation draws
    from, or the fit trains on other samples than plain Lightning's (a new user's seeded augmentation: weights 0.06
    apart after 2 epochs). Other state a read changes (a read counter, a cache) is the dataset's own."""
    generators = {id(generator): generator for root in roots for generator in held_generators(root)}
    states = [(generator, _generator_state(generator)) for generator in generators.values()]
    try:
        yield
    finally:
        for generator, state in states:
            _set_generator_state(generator, state)
