"""Collectives that keep the ranks together when one of them fails."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
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


# torch.distributed's functions that wait for other ranks, called directly by a user's step (torchmetrics' sync of a
# metric with dist_sync_on_step=True, SyncBatchNorm's gather of the batch statistics, a plain dist.all_reduce)
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object",
    "all_gather_single", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv",
)
_marking_thread: int | None = None  # the thread whose collectives run as waits (None: no one's; ANY_THREAD: every one's)
ANY_THREAD = -1
_wrappers: dict[Callable[..., Any], Callable[..., Any]] = {}  # each collective's wrapper, made once


def _marked_as_wait(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective``, run as :func:`waiting_for_other_ranks` when called from the marking thread. Traced by
    ``torch.compile`` it is the collective itself: a clock read there would break the graph (and fail ``fullgraph``)."""
    if collective not in _wrappers:

        @functools.wraps(collective)
        def run_as_wait(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or _marking_thread not in (ANY_THREAD, threading.get_ident()):
                return collective(*args, **kwargs)
            with waiting_for_other_ranks():
                return collective(*args, **kwargs)

        run_as_wait.__wrapped_collective__ = collective  # type: ignore[attr-defined]
        _wrappers[collective] = run_as_wait
    return _wrappers[collective]


@contextlib.contextmanager
def collectives_marked_as_waits(any_thread: bool = False) -> Iterator[None]:
    """Within the block, each of ``torch.distributed``'s collectives that this thread calls through the module runs as
    :func:`waiting_for_other_ranks`: a balanced strategy times the user's ``training_step`` and backward in it, and a
    collective there waits for the slowest rank (a metric synced on each step kept every rank at the slowest one's
    speed). Not marked: the ``wait()`` of one issued with ``async_op=True`` (its call is), functional collectives
    (DTensor's), code that bound a function before (``from torch.distributed import all_reduce``), other threads, and a
    block another thread holds. With ``any_thread``, every thread's (a backward: on CUDA, autograd runs an
    ``autograd.Function``'s backward, SyncBatchNorm's all-reduce, on a worker thread of its own while this one waits)."""
    global _marking_thread
    if _marking_thread is not None:  # nested in this thread's block (already marking), or another thread's
        widened = any_thread and _marking_thread == threading.get_ident()  # (a manual backward within the step)
        if widened:
            _marking_thread = ANY_THREAD
        try:
            yield
        finally:
            if widened:
                _marking_thread = threading.get_ident()
        return
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    _marking_thread = ANY_THREAD if any_thread else threading.get_ident()
    for name, collective in originals.items():
        setattr(dist, name, _marked_as_wait(collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
        _marking_thread = None


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


def _add_note(error: BaseException, note: str) -> None:
    """PEP 678's ``add_note`` (Python 3.11), or on 3.10 the ``__notes__`` list it keeps (not shown by 3.10's tracebacks)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def gather_or_raise_together(value: Any, error: BaseException | None, what: str, context: str = "") -> list[Any]:
    """Every rank's ``value``; when any rank's ``error`` is set, every rank raises.

    A rank that raised alone would leave the others waiting in their next collective (on NCCL, a
    hang). Each rank passes what it computed, or the error it caught; the message names each failed
    rank (with its ``context``, e.g. ``"micro-batch 6"``) and its error. A rank that failed raises its
    own error, with that message as a note (so a user's ``except`` catches their own exception, as
    without the plugin; a new user's trial); the others raise the failed ranks' class with the message
    where they all failed with one class of ValueError (a setting that cannot work: a ``BudgetTooSmall``
    is then one on every rank, which the command line says in one line), a ValueError where every failure
    was some ValueError, else a RuntimeError.

    Args:
        value: this rank's result (None when it failed).
        error: the exception this rank caught, or None.
        what: the start of the message, e.g. ``"ActivationMemory(policy='auto') could not plan"``.
        context: this rank's detail shown beside its rank number.
    """
    outcome = {"value": value, "context": context, "error": None if error is None else (_class_path(type(error)), str(error))}
    outcomes = gather_objects(outcome)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o["error"] is not None]
    if failed:
        lines = [f"rank {rank}" + (f" ({o['context']})" if o["context"] else "") + f": {o['error'][1]}" for rank, o in failed]
        message = f"{what}: " + "; ".join(lines)
        if error is not None:
            _add_note(error, message)
            raise error
        raise _raised_on_the_other_ranks({o["error"][0] for _, o in failed}, message)
    return [o["value"] for o in outcomes]


def _class_path(kind: type) -> str:
    """``module:qualname`` of an exception class, for another rank to find it by."""
    return f"{kind.__module__}:{kind.__qualname__}"


def _value_error_class(path: str) -> type[ValueError] | None:
    """The ValueError class at ``path`` (:func:`_class_path`), or None where it is not one or cannot be found."""
    module, _, qualname = path.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) and issubclass(found, ValueError) else None


def _raised_on_the_other_ranks(paths: set[str], message: str) -> Exception:
    """What a rank that did not fail raises beside the failed ones (see :func:`gather_or_raise_together`)."""
    classes = [_value_error_class(path) for path in paths]
    if len(classes) == 1 and classes[0] is not None:
        try:
            return classes[0](message)
        except Exception:  # noqa: BLE001 - a class whose constructor takes more than a message
            return ValueError(message)
    return ValueError(message) if all(kind is not None for kind in classes) else RuntimeError(message)
