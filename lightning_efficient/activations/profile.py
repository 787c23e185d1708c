"""Profiling one real training step per block: bytes each policy holds and what each costs in time.

What a policy *really* holds is counted, not what an outer ``saved_tensors_hooks`` sees (which
misses what checkpointing keeps inside its own frame):

* ``keep``: the distinct storages the block saves for backward (its parameters excluded);
* ``checkpoint``: the block's tensor inputs, which checkpointing keeps to recompute from;
* ``selective``: the inputs plus the outputs of the ops it saves (matmuls, attention), counted
  exactly with a ``TorchDispatchMode`` over the block's forward;
* ``offload``/``disk``: the saved tensors under ``min_bytes`` and the casts or views of parameters
  (autocast's weight copies), which stay on the device.

Costs: ``checkpoint`` recomputes the forward; ``selective`` recomputes the ops it does not save
(their share of the forward, timed op by op); ``offload``/``disk`` move the bytes at the measured
bandwidth (out and back).

Device work is timed with :class:`~lightning_efficient._torch.DeviceClock`: on CUDA, events recorded
on the stream around each block and each op, read after the step, so a time is the device's
execution time (not the host's launch time) and nothing synchronises between ops.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_efficient._torch import DeviceClock, storage_key
from lightning_efficient.activations.offload import is_copy_of
from lightning_efficient.activations.planner import BlockProfile
from lightning_efficient.activations.policies import SAVED_BY_SELECTIVE, selective_refusal
from lightning_efficient.memory import distinct_storage_bytes, local_storage


class _OpTimer(TorchDispatchMode):
    """Marks each op on the device's timeline and sums the output bytes of the ops ``selective`` saves.

    The marks are read (:meth:`read`) once the forward is done: on CUDA only then does the host wait.
    """

    def __init__(self, clock: DeviceClock) -> None:
        super().__init__()
        self.clock = clock
        self.saved_bytes = 0
        self.saved_time = 0.0
        self.other_time = 0.0
        self._marks: list[tuple[bool, object, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = self.clock.mark()
        out = func(*args, **(kwargs or {}))
        self._marks.append((func in SAVED_BY_SELECTIVE, start, self.clock.mark()))
        if func in SAVED_BY_SELECTIVE:
            self.saved_bytes += distinct_storage_bytes(t for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        return out

    def read(self) -> None:
        """Sum the marked intervals into ``saved_time`` and ``other_time``."""
        for saved, start, end in self._marks:
            elapsed = self.clock.seconds(start, end)
            if saved:
                self.saved_time += elapsed
            else:
                self.other_time += elapsed
        self._marks.clear()


def disk_bandwidth(directory: str | None, nbytes: int = 32 * 2**20, file_bytes: int = 2 * 2**20) -> tuple[float, float]:
    """Measured (write, read) bytes per second of ``nbytes`` in scratch files of ``file_bytes`` in ``directory``,
    each written and read back as the disk policy does with a saved tensor (``tofile``, ``fromfile`` into a new
    array). One file at a time: the measurement holds about two files' bytes, not ``nbytes`` twice over (a re-plan
    during training measures it too, and on CPU what it holds is training memory).

    Args:
        directory: where the scratch files go (``None``: the system's temporary directory).
        nbytes: the bytes moved each way (positive).
        file_bytes: the bytes of each file (positive; at most ``nbytes`` are used).
    """
    for name, value in (("nbytes", nbytes), ("file_bytes", file_bytes)):
        if value <= 0:
            raise ValueError(f"disk_bandwidth: {name}={value} is not allowed: a positive number of bytes")
    data = np.random.default_rng(0).integers(0, 255, min(file_bytes, nbytes), dtype=np.uint8)
    if directory:
        directory = os.path.expanduser(directory)
        os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=directory)
    paths = [os.path.join(scratch, str(index)) for index in range(max(1, nbytes // len(data)))]
    try:
        start = time.perf_counter()
        for path in paths:
            data.tofile(path)
        write = time.perf_counter() - start
        start = time.perf_counter()
        for path in paths:
            np.fromfile(path, dtype=np.uint8)
        read = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    moved = len(paths) * len(data)
    return moved / max(write, 1e-9), moved / max(read, 1e-9)


def host_bandwidth(device: torch.device, nbytes: int = 64 * 2**20) -> float:
    """Measured device-to-host bytes per second into pinned memory (CUDA only)."""
    clock = DeviceClock(device)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target.copy_(source, non_blocking=True)  # warm-up
    start = clock.mark()
    target.copy_(source, non_blocking=True)
    end = clock.mark()
    return nbytes / max(clock.seconds(start, end), 1e-9)


def _compiler_off() -> contextlib.AbstractContextManager:
    """torch.compile'd code runs eagerly within (``set_stance``, torch 2.6 and later; before it, a no-op)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def profile_blocks(
    run_step: Callable[[], None],
    run_forward: Callable[[], None],
    blocks: list[tuple[str, nn.Module]],
    exclude: Callable[[Tensor], bool],
    device: torch.device,
    *,
    min_offload_bytes: int,
    policies: tuple[str, ...],
    offload_dir: str | None = None,
) -> list[BlockProfile]:
    """Profile every block on one training step (``run_step``: forward and backward) and one
    forward pass without gradients (``run_forward``), and return what each policy would hold and cost.
    """
    clock = DeviceClock(device)
    # summed over the calls of a block (one called twice a step, weights shared, holds and costs twice)
    stats: dict[int, dict[str, Any]] = {i: {"saved": {}, "small": 0, "inputs": {}, "marks": []} for i in range(len(blocks))}
    originals = []
    for index, (_, block) in enumerate(blocks):
        forward = block.forward
        originals.append((block, "forward" in vars(block), forward))

        def measured(*args: Any, _forward=forward, _index=index, **kwargs: Any) -> Any:
            record = stats[_index]
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and not exclude(t)]
            record["inputs"].update(found for t in inputs if (found := local_storage(t)) is not None)  # a shared one once

            def pack(t: Tensor) -> Tensor:
                if not exclude(t) and t.layout == torch.strided:
                    key = storage_key(t)
                    if key not in record["saved"]:
                        record["saved"][key] = t.untyped_storage().nbytes()
                        # what offload/disk leave on the device: small tensors, and casts or views of a
                        # parameter (autocast's weight copies), which the hooks recognise the same way
                        if t.untyped_storage().nbytes() < min_offload_bytes or is_copy_of(t, exclude):
                            record["small"] += t.untyped_storage().nbytes()
                return t

            start = clock.mark()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = _forward(*args, **kwargs)
            record["marks"].append((start, clock.mark()))
            return out

        block.forward = measured
    # eagerly: a torch.compile'd block called under the op timer's dispatch mode is never compiled again in the process
    # (a new user's trial: the fit, and a later one in the process, then ran eagerly), and a first call would time its
    # compilation
    timers: dict[int, _OpTimer] = {}
    try:
        with _compiler_off():
            run_step()
            for index, (_, block) in enumerate(blocks):
                def timed(*args: Any, _forward=originals[index][2], _index=index, **kwargs: Any) -> Any:
                    with timers.setdefault(_index, _OpTimer(clock)):
                        return _forward(*args, **kwargs)

                block.forward = timed
            with torch.no_grad():
                run_forward()
    finally:
        for block, had_own, forward in originals:
            if had_own:
                block.forward = forward
            else:
                del block.forward
    for record in stats.values():  # read after the step: on CUDA the host waits here, once
        record["time"] = sum(clock.seconds(*marks) for marks in record["marks"])
    for timer in timers.values():
        timer.read()
    write_bw = read_bw = host_bw = None
    if "disk" in policies:
        write_bw, read_bw = disk_bandwidth(offload_dir)
    if "offload" in policies and device.type == "cuda":
        host_bw = host_bandwidth(device)
    profiles = []
    for index, (name, _) in enumerate(blocks):
        record, timer = stats[index], timers.get(index)
        keep = sum(record["saved"].values())
        inputs = sum(record["inputs"].values())
        held = {"keep": keep, "checkpoint": min(keep, inputs)}
        cost = {"keep": 0.0, "checkpoint": record["time"]}
        if timer is not None and selective_refusal(blocks[index][1]) is None:  # (a recurrent layer's: not exact)
            held["selective"] = min(keep, inputs + timer.saved_bytes)
            share = timer.other_time / max(timer.other_time + timer.saved_time, 1e-12)
            cost["selective"] = record["time"] * share
        moved = keep - record["small"]
        if write_bw is not None:
            held["disk"] = record["small"]
            cost["disk"] = moved / write_bw + moved / read_bw
        if host_bw is not None:
            held["offload"] = record["small"]
            cost["offload"] = 2 * moved / host_bw
        profiles.append(BlockProfile(name, {k: v for k, v in held.items() if k in policies or k == "keep"},
                                     {k: v for k, v in cost.items() if k in policies or k == "keep"}))
    return profiles
