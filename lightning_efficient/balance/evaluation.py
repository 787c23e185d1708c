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
    at most ``cap`` samples. ``sampler`` is the batches' sampler, so that Lightning's ``set_epoch`` reaches it."""

    def __init__(self, batches: BatchSampler, cap: int) -> None:
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
        return sum(math.ceil(size / self.cap) for size in self.batch_sizes()[:batches])

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            yield from chunks(list(batch), self.cap)

    def __len__(self) -> int:
        return self.chunks_in(len(self.batches))


def capped_evaluation_loader(dataloader: object, cap: int | None) -> tuple[DataLoader, ChunkedBatchSampler] | None:
    """``dataloader`` with its batches split into chunks of at most ``cap`` samples, and its chunking; None where nothing
    is capped, its batches are no larger than ``cap``, or it is not a DataLoader batching a map-style dataset by
    ``batch_size`` (an IterableDataset, a batch sampler of the user's own, no batching: left as they are)."""
    if cap is None or not isinstance(dataloader, DataLoader) or dataloader.batch_size is None or dataloader.batch_size <= cap:
        return None
    if type(dataloader.batch_sampler) is not BatchSampler or isinstance(dataloader.dataset, IterableDataset):
        return None
    chunked = ChunkedBatchSampler(dataloader.batch_sampler, cap)
    workers = dataloader.num_workers
    with_workers = {"prefetch_factor": dataloader.prefetch_factor, "timeout": dataloader.timeout,
                    "multiprocessing_context": dataloader.multiprocessing_context,
                    "persistent_workers": dataloader.persistent_workers} if workers else {}
    loader = DataLoader(dataloader.dataset, batch_sampler=chunked, num_workers=workers, collate_fn=dataloader.collate_fn,
                        pin_memory=dataloader.pin_memory, worker_init_fn=dataloader.worker_init_fn,
                        generator=dataloader.generator, **with_workers)
    return loader, chunked


class EvaluationCounts:
    """Lightning's evaluation batch counts (:data:`COUNTED`) in chunks while a capped DataLoader runs: each counts the
    chunks of the DataLoader batches the user's setting counts (as Lightning counts them: an integer, a fraction of the
    batches, the sanity check's steps), so the same samples are validated; :meth:`put_back` restores the user's."""

    def __init__(self) -> None:
        self._users: tuple[Any, dict[str, Any]] | None = None  # (the trainer, its settings before any were changed)

    def count_in_chunks(self, trainer: Any, stage: RunningStage, chunked: ChunkedBatchSampler) -> None:
        """Set the counts of ``stage``'s DataLoader (validation, its sanity check, or test) in ``chunked``'s chunks."""
        if self._users is None or self._users[0] is not trainer:
            self.put_back()
            self._users = (trainer, {name: getattr(trainer, name) for name in COUNTED})
        users = self._users[1]
        counted = RunningStage.TESTING if stage == RunningStage.TESTING else RunningStage.VALIDATING
        name = f"limit_{counted.dataloader_prefix}_batches"
        batches = _parse_num_batches(counted, len(chunked.batches), users[name])  # (its refusals in the user's numbers)
        if not (isinstance(users[name], float) and users[name] == 1.0):  # (1.0: every batch; the integer 1: one)
            setattr(trainer, name, chunked.chunks_in(batches))
        sanity = users["num_sanity_val_steps"]  # (-1, every batch, is infinity to Lightning)
        if counted == RunningStage.VALIDATING and sanity != math.inf:
            trainer.num_sanity_val_steps = chunked.chunks_in(min(sanity, batches))

    def put_back(self) -> None:
        """The user's counts, where they were changed."""
        if self._users is not None:
            trainer, users = self._users
            for name, value in users.items():
                setattr(trainer, name, value)
            self._users = None
