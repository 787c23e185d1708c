"""``max_micro_batch="auto"``: the largest micro-batch that trains on this rank without running out of memory.

A size fits when a real training micro-step on real samples — forward, backward and an optimizer
step — completes while everything a training step holds is held: the gradients and the optimizer's
state (created by the probe's own optimizer step when the run has none yet). Module parameters,
buffers, optimizer state and random-number streams are restored afterwards, so probing changes
nothing in the run. Out of memory is what the allocator says: CUDA's out-of-memory error on a GPU,
"can't allocate memory" on CPU (where the limit is the process's, e.g. ``ulimit -v``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities.memory import is_oom_error
from torch.utils.data import DataLoader

from lightning_efficient._step import restored_run_state, step_loss
from lightning_efficient.balance.planner import largest_fitting_batch

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocator's out-of-memory error (CUDA, cuDNN or the CPU allocator)."""
    return isinstance(error, torch.OutOfMemoryError) or is_oom_error(error)


def _micro_step(strategy: DDPStrategy, dataloader: DataLoader, size: int, to_step: list[torch.optim.Optimizer]) -> None:
    """One training micro-step of ``size`` samples with DDP's gradient sync off, stepping the
    optimizers ``to_step`` (raises when out of memory)."""
    module, dataset = strategy.lightning_module, dataloader.dataset
    batch = strategy.batch_to_device(dataloader.collate_fn([dataset[i % len(dataset)] for i in range(size)]))
    with strategy.model.no_sync():
        loss = step_loss(strategy, batch)
    loss.backward()
    del loss
    for optimizer in to_step:
        optimizer.step()
    module.zero_grad(set_to_none=False)  # keep the gradients held, as they are during the next forward


def probe_micro_batch(strategy: DDPStrategy, dataloader: DataLoader, upper: int) -> int:
    """This rank's largest micro-batch in ``[1, upper]`` that trains without running out of memory.

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
        return largest_fitting_batch(fits, upper)

