"""``max_micro_batch="auto"``: the largest micro-batch that trains on this rank without running out of memory, less a margin.

A size fits when a real training micro-step on real samples — forward, backward and an optimizer
step — completes while everything a training step holds is held: the gradients and the optimizer's
state (created by the probe's own optimizer step when the run has none yet). Module parameters,
buffers, optimizer state and random-number streams are restored afterwards, so probing changes
nothing in the run. Out of memory is what the allocator says: CUDA's out-of-memory error, cuDNN's,
cuBLAS failing to allocate its workspace or handle (``CUBLAS_STATUS_ALLOC_FAILED``, and
``CUBLAS_STATUS_NOT_INITIALIZED``, which is what ``cublasCreate`` reports when the device is full) on
a GPU, "can't allocate memory" on CPU (where the limit is the process's, e.g. ``ulimit -v``).

Safety margin: the cap is :data:`PROBE_MARGIN` (10%) below the largest size that trained —
``floor(largest x 0.9)``, at least 1 — so that what a probe cannot see (fragmentation later in the
run, longer batches, the allocator's cache) has room. The search runs up to ``ceil(upper / 0.9)``, so a
rank that fits the whole global batch *with* the margin is still capped at the global batch.

Paged optimizer states (bitsandbytes ``paged=True``) are created as ordinary device buffers during
the probe (a page-able buffer holds no device memory the allocator counts, so this is the stricter
test) and any paged buffer that a probe step did create is also taken out of bitsandbytes' page
manager when the probe's optimizer state is dropped: ``optimizer.state.clear()`` alone would leave
it listed there, prefetched on every later ``prefetch_all``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.memory import is_oom_error
from torch.utils.data import DataLoader

from lightning_efficient._step import first_samples_batch, restored_run_state, step_loss
from lightning_efficient.balance.planner import largest_fitting_batch

PROBE_MARGIN = 0.10
"""Fraction by which the probed cap stays below the largest micro-batch that trained."""

_CUBLAS_OUT_OF_MEMORY = ("CUBLAS_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED")


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocator's out-of-memory error (CUDA, cuDNN, cuBLAS or the CPU allocator)."""
    if isinstance(error, torch.OutOfMemoryError) or is_oom_error(error):
        return True
    return isinstance(error, RuntimeError) and len(error.args) == 1 and any(
        code in str(error.args[0]) for code in _CUBLAS_OUT_OF_MEMORY
    )


def largest_with_margin(fits: Callable[[int], bool], upper: int, margin: float = PROBE_MARGIN) -> int:
    """The micro-batch cap in ``[1, upper]``: the largest size that fits, searched up to
    ``ceil(upper / (1 - margin))``, reduced by ``margin`` (``floor(largest x (1 - margin))``, at least 1).

    Raises:
        ValueError: when not even one sample fits.
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin!r} is not allowed: expected a fraction in [0, 1).")
    largest = largest_fitting_batch(fits, math.ceil(upper / (1.0 - margin)))
    return min(upper, max(1, math.floor(largest * (1.0 - margin) + 1e-9)))


def release_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop ``optimizer``'s state, taking its paged buffers out of bitsandbytes' page manager too
    (``optimizer.state.clear()`` alone leaves them listed there, and ``prefetch_all`` keeps moving them)."""
    paged = {id(value) for state in optimizer.state.values() if isinstance(state, dict)
             for value in state.values() if isinstance(value, torch.Tensor) and getattr(value, "is_paged", False)}
    bnb = sys.modules.get("bitsandbytes")
    if paged and bnb is not None:
        manager = bnb.functional.GlobalPageManager.get_instance()
        manager.paged_tensors[:] = [t for t in manager.paged_tensors if id(t) not in paged]
    optimizer.state.clear()


@contextlib.contextmanager
def _unpaged(optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """bitsandbytes optimizers create ordinary buffers instead of paged ones inside."""
    paged = [optimizer for optimizer in optimizers if getattr(optimizer, "is_paged", False)]
    for optimizer in paged:
        optimizer.is_paged = False
    try:
        yield
    finally:
        for optimizer in paged:
            optimizer.is_paged = True


def _micro_step(strategy: Any, dataloader: DataLoader, size: int, to_step: list[torch.optim.Optimizer]) -> None:
    """One training micro-step of ``size`` samples with the gradient sync off, stepping the
    optimizers ``to_step`` (raises when out of memory)."""
    module = strategy.lightning_module
    batch = first_samples_batch(strategy, dataloader, size)
    with strategy.gradient_sync_off():
        loss = step_loss(strategy, batch)
        loss.backward()
    del loss
    for optimizer in to_step:
        optimizer.step()
    module.zero_grad(set_to_none=False)  # keep the gradients held, as they are during the next forward


def probe_micro_batch(strategy: Any, dataloader: DataLoader, upper: int) -> int:
    """This rank's micro-batch cap in ``[1, upper]``: the largest size that trains without running
    out of memory, less :data:`PROBE_MARGIN` (see :func:`largest_with_margin`).

    Args:
        strategy: a balanced strategy (it provides ``gradient_sync_off()``).
        dataloader: the training DataLoader (its samples are what the probe trains on).
        upper: the global batch: no rank's micro-batch is ever larger.

    Raises:
        ValueError: when not even one sample fits.
    """
    # only optimizers with no state yet are stepped: their state is what the probe must hold, and
    # it is dropped afterwards; a state loaded from a checkpoint is already held and is not touched
    stateless = [optimizer for optimizer in strategy.optimizers if len(optimizer.state) == 0]

    def fits(size: int) -> bool:
        try:
            _micro_step(strategy, dataloader, size, stateless)
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            return False
        finally:
            if strategy.root_device.type == "cuda":
                torch.cuda.empty_cache()
        return True

    with restored_run_state(strategy):
        try:
            with _unpaged(stateless):
                return largest_with_margin(fits, upper)
        finally:
            for optimizer in stateless:
                release_optimizer_state(optimizer)
