"""Validation and test under the heterogeneous strategies' micro-batch caps.

A cap says how many samples a rank's device holds in a training micro-step; an evaluation batch larger than it can run
out of memory too (a language model's full logits). So each validation or test DataLoader batch is split into the
fewest chunks of at most the least cap of any rank, as even as they can be (:class:`ChunkedBatchSampler`): the same
samples in the same order, each rank running as many chunks (FSDP2 all-gathers in every forward). Lightning's settings
that count evaluation batches (``limit_val_batches``, ``num_sanity_val_steps``, ``limit_test_batches``) count the
chunks of the same DataLoader batches while the capped loader runs (:class:`EvaluationCounts`), and are the user's
again afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

#: Lightning's settings that count evaluation batches
COUNTED = ("limit_val_batches", "num_sanity_val_steps", "limit_test_batches")


def chunks(batch: list[Any], cap: int) -> list[list[Any]]:
    """``batch`` in the fewest consecutive chunks of at most ``cap`` items, their sizes differing by at most one."""
    count = math.ceil(len(batch) / cap)
    size, larger = divmod(len(batch), count)
    found, start = [], 0
    for index in range(count):
        end = start + size + (index < larger)
        found.append(batch[start:end])
        start = end
    return found


class ChunkedBatchSampler(Sampler[list[int]]):
    """Each batch of ``batches`` (a DataLoader's own :class:`~torch.utils.data.BatchSampler`) as its :func:`chunks` of
    at most ``cap`` samples (``cap`` None: whole). ``sampler`` is the batches' sampler, so that Lightning's
    ``set_epoch`` reaches it."""

    def __init__(self, batches: BatchSampler, cap: int | None) -> None:
        self.batches = batches
        self.cap = cap
        self.sampler = batches.sampler

    def batch_sizes(self) -> list[int]:
        """The size of each DataLoader batch, in order."""
        samples, size = len(self.batches.sampler), self.batches.batch_size
        whole, rest = divmod(samples, size)
        return [size] * whole + ([rest] if rest and not self.batches.drop_last else [])

    def chunks_in(self, batches: int) -> int:
        """The chunks of the first ``batches`` DataLoader batches."""
        return sum(1 if self.cap is None else math.ceil(size / self.cap) for size in self.batch_sizes()[:batches])

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            yield from ([list(batch)] if self.cap is None else chunks(list(batch), self.cap))

    def __len__(self) -> int:
        return self.chunks_in(len(self.batches))


def capped_evaluation_loader(dataloader: object, cap: int | None) -> tuple[DataLoader, ChunkedBatchSampler] | None:
    """``dataloader`` with its batches split into chunks of at most ``cap`` samples, and its chunking; None where nothing
    is capped, its batches are no larger than ``cap``, or it is not :func:`batched_plainly`."""
    if cap is None or not batched_plainly(dataloader) or dataloader.batch_size <= cap:
        return None
    return chunked_loader(dataloader, dataloader.batch_sampler, cap)


def evaluation_loader_at(dataloader: object, batch: int, micro: int) -> tuple[DataLoader, ChunkedBatchSampler] | None:
    """``dataloader`` (built at AutoFit's micro-batch ``micro``, reading it from ``batch_size``) batched at ``batch`` again,
    each batch split into chunks of at most ``micro`` samples, and its chunking: the batches your ``batch_size`` gives,
    so that Lightning's evaluation counts (:class:`EvaluationCounts`) count the same samples as without AutoFit, each
    chunk within the plan's memory. None where ``dataloader`` is not :func:`batched_plainly` by ``micro``."""
    if micro >= batch or not batched_plainly(dataloader) or dataloader.batch_size != micro:
        return None
    return chunked_loader(dataloader, BatchSampler(dataloader.batch_sampler.sampler, batch, dataloader.drop_last), micro)


def batched_plainly(dataloader: object) -> bool:
    """Whether ``dataloader`` is a plain DataLoader batching a map-style dataset of a known length by ``batch_size``: not
    a DataLoader subclass, whose class and arguments a rebuild would lose; an IterableDataset; a batch sampler of the
    user's own; no batching; a sampler of no length (Lightning counts its batches as infinite)."""
    if type(dataloader) is not DataLoader or dataloader.batch_size is None:
        return False
    if type(dataloader.batch_sampler) is not BatchSampler or isinstance(dataloader.dataset, IterableDataset):
        return False
    try:
        len(dataloader.batch_sampler.sampler)
    except TypeError:
        return False
    return True


def chunked_loader(dataloader: DataLoader, batches: BatchSampler, cap: int) -> tuple[DataLoader, ChunkedBatchSampler]:
    """A DataLoader as ``dataloader`` (its dataset, workers, collate function) drawing ``batches`` in chunks of at most
    ``cap`` samples, and its chunking."""
    chunked = ChunkedBatchSampler(batches, cap)
    workers = dataloader.num_workers
    with_workers = {"prefetch_factor": dataloader.prefetch_factor, "timeout": dataloader.timeout,
                    "multiprocessing_context": dataloader.multiprocessing_context,
                    "persistent_workers": dataloader.persistent_workers} if workers else {}
    loader = DataLoader(dataloader.dataset, batch_sampler=chunked, num_workers=workers, collate_fn=dataloader.collate_fn,
                        pin_memory=dataloader.pin_memory, pin_memory_device=dataloader.pin_memory_device,
                        in_order=dataloader.in_order, worker_init_fn=dataloader.worker_init_fn,
                        generator=dataloader.generator, **with_workers)
    return loader, chunked


class EvaluationCounts:
    """Lightning's evaluation batch counts (:data:`COUNTED`) in chunks while capped DataLoaders run.

    Each count is set to the chunks of the DataLoader batches your setting counts (as Lightning counts them: an integer,
    a fraction of the batches, the sanity check's steps), so the same samples are evaluated. Lightning reads one
    setting for every DataLoader of a stage: where the DataLoaders of one stage need different counts (several
    validation DataLoaders chunked otherwise, or one chunked beside one left whole, under an integer or fractional
    limit), one number cannot follow each, so they all run whole, with a warning (a review: the last one's count was
    taken for every one); the sanity check takes the most any needs (a few more batches checked on the others).
    :meth:`put_back` restores your settings."""

    def __init__(self) -> None:
        self._users: tuple[Any, dict[str, Any]] | None = None  # (the trainer, its settings before any were changed)
        self._setup: list[ChunkedBatchSampler | None] = []  # the stage's DataLoaders processed since its last run
        self._setup_stage: RunningStage | None = None
        self._next_setup = True
        self._warned = False

    def setup_ran(self) -> None:
        """The DataLoaders processed so far ran (an evaluation started): the next one starts another stage's set."""
        self._next_setup = True

    def loader_processed(self, trainer: Any, stage: RunningStage, chunked: ChunkedBatchSampler | None) -> None:
        """Record one validation (or sanity check) or test DataLoader of this set (``chunked``: its chunking; None: left
        whole) and set Lightning's counts for every one recorded."""
        counted = RunningStage.TESTING if stage == RunningStage.TESTING else RunningStage.VALIDATING
        if self._next_setup or counted != self._setup_stage:
            self._setup, self._setup_stage, self._next_setup = [], counted, False
        self._setup.append(chunked)
        if self._users is None or self._users[0] is not trainer:
            if all(c is None for c in self._setup):
                return
            self._put_back_settings()
            self._users = (trainer, {name: getattr(trainer, name) for name in COUNTED})
        users = self._users[1]
        name = f"limit_{counted.dataloader_prefix}_batches"
        limit = users[name]
        every = isinstance(limit, float) and limit == 1.0  # (1.0: every batch; the integer 1: one)
        wanted = {limit if c is None else c.chunks_in(self._batches(counted, c, limit)) for c in self._setup}
        if not every and len(wanted) > 1:
            for c in self._setup:
                if c is not None:
                    c.cap = None
            if not self._warned:
                self._warned = True
                rank_zero_warn(f"{name}={limit!r} counts the batches of each {counted.dataloader_prefix} DataLoader, which "
                               "the micro-batches (their caps, or AutoFit's plan) would split into chunks otherwise: one count "
                               "cannot follow each, so they run whole, at your batch sizes")
            wanted = {limit}
        setattr(trainer, name, limit if every else wanted.pop())
        sanity = users["num_sanity_val_steps"]  # (-1, every batch, is infinity to Lightning)
        if counted == RunningStage.VALIDATING and sanity != math.inf:
            trainer.num_sanity_val_steps = max(sanity if c is None or c.cap is None else
                                               c.chunks_in(min(sanity, self._batches(counted, c, limit))) for c in self._setup)

    @staticmethod
    def _batches(counted: RunningStage, chunked: ChunkedBatchSampler, limit: int | float) -> int:
        """The DataLoader batches Lightning counts under ``limit`` (its refusals in your numbers)."""
        return _parse_num_batches(counted, len(chunked.batches), limit)

    def put_back(self) -> None:
        """Your counts, where they were changed (at the end of a fit, validate or test, or its failure)."""
        self._put_back_settings()
        self._setup, self._next_setup = [], True

    def _put_back_settings(self) -> None:
        if self._users is not None:
            trainer, users = self._users
            for name, value in users.items():
                setattr(trainer, name, value)
            self._users = None
