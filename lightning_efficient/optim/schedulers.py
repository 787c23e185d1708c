"""Moving learning-rate schedulers from an optimizer to its replacement.

A scheduler holds its optimizer in ``.optimizer`` and writes every scheduled hyperparameter (``lr``,
and ``momentum`` or ``betas`` for ``OneCycleLR``/``CyclicLR``) into ``optimizer.param_groups`` when it
steps. Composite schedulers (``SequentialLR``, ``ChainedScheduler``, and compositions of them) keep
their children in ``_schedulers``; each child steps its own ``.optimizer``. Re-binding therefore walks
every scheduler reachable from the ones Lightning holds. The replacement also gets torch's step-tracking
patch, which ``LRScheduler.__init__`` puts on the optimizer it is built on: without it, a scheduler's
first step warns that "``optimizer.step()`` has been overridden after learning rate scheduler
initialization".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau


def _is_scheduler(value: Any) -> bool:
    return isinstance(value, (LRScheduler, ReduceLROnPlateau))  # ReduceLROnPlateau is an LRScheduler from torch 2.2


def schedulers_within(scheduler: Any) -> Iterator[Any]:
    """``scheduler`` and every scheduler it holds, at any depth, each once.

    Children are found in any attribute that is a scheduler or a list/tuple of schedulers (torch's
    ``SequentialLR`` and ``ChainedScheduler`` keep them in ``_schedulers``).
    """
    seen: set[int] = set()
    pending = [scheduler]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for value in getattr(current, "__dict__", {}).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            pending.extend(item for item in items if _is_scheduler(item))


class _TrackStepCalls(LRScheduler):
    """A scheduler that leaves every learning rate as it is: building one applies torch's own patch."""

    def get_lr(self) -> list[Any]:
        return [group["lr"] for group in self.optimizer.param_groups]


def track_step_calls(optimizer: torch.optim.Optimizer, like: torch.optim.Optimizer | None = None) -> None:
    """Give ``optimizer`` the ``step`` wrapper torch's schedulers put on the optimizer they are built on.

    torch checks for it on a scheduler's first step. It is applied by torch's own code (building a
    scheduler that changes no learning rate), so it matches the installed torch's version of the patch.
    ``optimizer``'s param groups must already hold ``initial_lr`` (they do when copied from an optimizer a
    scheduler was built on). Whether ``like`` has stepped is carried over.
    """
    lacking = [group for group in optimizer.param_groups if "initial_lr" not in group]
    _TrackStepCalls(optimizer)
    for group in lacking:  # (torch's scheduler gives every group one: a group BaseFinetuning added has none in plain torch)
        del group["initial_lr"]
    if like is not None and getattr(like, "_opt_called", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]


def rebind_schedulers(schedulers: Iterable[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> int:
    """Point every scheduler within ``schedulers`` that steps ``old`` at ``new``; returns how many.

    When any is re-bound, ``new`` gets torch's step-tracking patch (:func:`track_step_calls`).
    """
    count = 0
    for top in schedulers:
        for scheduler in schedulers_within(top):
            if getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new
                count += 1
    if count:
        track_step_calls(new, like=old)
    return count
