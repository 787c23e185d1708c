"""A DataLoader that Lightning can resume mid-epoch, and a seeded per-epoch shuffle sampler.

Lightning saves ``state_dict()`` of any training DataLoader that has one and calls
``load_state_dict`` on resume; this loader records how many batches of the current epoch it has
handed out and, after a load, skips that many at the start of the next iteration. With an order
that is a function of (seed, epoch), as :class:`EpochShuffleSampler` and torch's
``DistributedSampler`` give, a resumed run sees exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(length)`` drawn from ``seed + epoch`` (Lightning calls ``set_epoch``).

    Args:
        length: number of samples.
        seed: base seed of the permutation.
        shuffle: False gives the identity order.
    """

    def __init__(self, length: int, seed: int = 0, shuffle: bool = True) -> None:
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position within the epoch is saved in Lightning checkpoints.

    The skipped batches are loaded and dropped on resume (their data loading is repeated, not
    their training), so resuming costs the loading time of the batches already seen this epoch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handed_out = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if skip >= len(self):  # saved at the end of an epoch: the next one starts from its beginning
            skip = 0
        self._handed_out = 0
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue
            self._handed_out = index + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Batches of the current epoch handed out so far."""
        return {"batches_handed_out": self._handed_out}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Skip the batches a checkpoint's run had already handed out this epoch."""
        self._skip = int(state_dict.get("batches_handed_out", 0))
