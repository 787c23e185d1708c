"""Collectives that keep the ranks together when one of them fails."""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

_wait_marks: list[tuple[Callable[[], None], Callable[[], None]]] = []  # (start, end) a step timer marks a wait with


@contextlib.contextmanager
def waiting_for_other_ranks() -> Iterator[None]:
    """Run a collective that waits for the other ranks (a gather of the step's token scores): a balanced strategy
    timing this rank's compute leaves the interval out, as a faster rank's wait there is a slower one's compute (a
    new user's trial: with SelectiveTokenLoss's ``scope="global"``, every rank read the slowest one's speed, and the
    shares never moved)."""
    for start, _ in list(_wait_marks):
        start()
    try:
        yield
    finally:
        for _, end in list(_wait_marks):
            end()


class WaitMarks:
    """``start``/``end`` called around every :func:`waiting_for_other_ranks` until :meth:`remove` (a hook handle)."""

    def __init__(self, start: Callable[[], None], end: Callable[[], None]) -> None:
        self.marks = (start, end)
        _wait_marks.append(self.marks)

    def remove(self) -> None:
        """Stop being called."""
        if self.marks in _wait_marks:
            _wait_marks.remove(self.marks)


_destroy_registered = False  # destroy_process_group_at_exit's handler registered


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, while it is whole (registered once). A process
    whose gloo group is still alive at finalisation can abort there ("terminate called without an active exception"),
    after a run that did all it had to (exit status -6 in a hetero_ddp run of this suite); Lightning registers the same
    for NCCL only."""
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_process_group)
        _destroy_registered = True


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_or_raise_together(value: Any, error: BaseException | None, what: str, context: str = "") -> list[Any]:
    """Every rank's ``value``; when any rank's ``error`` is set, every rank raises the same error.

    A rank that raised alone would leave the others waiting in their next collective (on NCCL, a
    hang). Each rank passes what it computed, or the error it caught; the message names each failed
    rank (with its ``context``, e.g. ``"micro-batch 6"``) and its error. The error is a ValueError
    when every failure was one (a setting that cannot work), else a RuntimeError.

    Args:
        value: this rank's result (None when it failed).
        error: the exception this rank caught, or None.
        what: the start of the message, e.g. ``"ActivationMemory(policy='auto') could not plan"``.
        context: this rank's detail shown beside its rank number.
    """
    outcome = {"value": value, "context": context, "error": None if error is None else (type(error).__name__, str(error))}
    outcomes = gather_objects(outcome)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o["error"] is not None]
    if failed:
        lines = [f"rank {rank}" + (f" ({o['context']})" if o["context"] else "") + f": {o['error'][1]}" for rank, o in failed]
        kind = ValueError if all(o["error"][0] == "ValueError" for _, o in failed) else RuntimeError
        raise kind(f"{what}: " + "; ".join(lines)) from error
    return [o["value"] for o in outcomes]
