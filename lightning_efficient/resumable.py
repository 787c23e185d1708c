"""A DataLoader that Lightning can resume mid-epoch, and a seeded per-epoch shuffle sampler.

Lightning saves ``state_dict()`` of any training DataLoader that has one and calls
``load_state_dict`` on resume; this loader records how many batches of the current epoch it has
handed out — with its batch size and the number of ranks, i.e. the position in samples of the
epoch's order — and, after a load, skips the batches already trained at the start of the next
iteration. With an order that is a function of (seed, epoch), as :class:`EpochShuffleSampler` and
torch's ``DistributedSampler`` give, a resumed run sees exactly the batches the uninterrupted one
would; resumed on another number of ranks (or batch size), it continues from the same sample.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_efficient._torch import seeded_permutation


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
        return iter(seeded_permutation(self.length, self.seed + self.epoch, self.shuffle))

    def __len__(self) -> int:
        return self.length


def _world_size() -> int:
    """Processes reading their own part of each step (a per-rank sampler of the user's under DDP)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position within the epoch is saved in Lightning checkpoints.

    The skipped batches are loaded and dropped on resume (their data loading is repeated, not
    their training), so resuming costs the loading time of the batches already seen this epoch.

    Under DDP (Lightning's ``DistributedSampler``, rank ``r`` of ``W`` takes positions ``r, r + W, ...``
    of the epoch's order), ``b`` batches of ``B`` handed out on every rank are the first ``b * B * W``
    samples of that order. A run resumed with another number of ranks ``W'`` and batch size ``B'``
    with ``B' * W' == B * W`` (half the ranks, twice the batch) skips the same ``b`` batches and
    continues from the same sample. Any other mid-epoch change is refused with the numbers: Lightning
    restores its own batch counter in the checkpoint's units, so a loader that skipped another number
    of batches would hide the epoch's last batch from it (no validation, no last optimizer step); so
    is a change of order (e.g. from DDP to a single-device strategy). A checkpoint taken at an epoch's
    end resumes anywhere.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handed_out = 0
        self._skip = 0

    def _layout(self) -> dict[str, Any]:
        """Batch size, number of ranks and which order the samples come in."""
        sampler = self.sampler
        distributed = isinstance(sampler, DistributedSampler)
        order = type(sampler).__name__
        if distributed:
            order += f"(shuffle={sampler.shuffle}, seed={sampler.seed})"
        return {"batch_size": self.batch_size, "world_size": sampler.num_replicas if distributed else _world_size(), "order": order}

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

    def state_dict(self) -> dict[str, Any]:
        """Batches of the current epoch handed out so far, the epoch's length in batches, the batch
        size, the number of ranks and the order's kind (to resume elsewhere from the same sample)."""
        return {"batches_handed_out": self._handed_out, "batches_per_epoch": len(self), **self._layout()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Skip the samples a checkpoint's run had already handed out this epoch.

        Raises:
            ValueError: for a mid-epoch state whose position is not a whole number of this loader's
                batches over its ranks, or that was taken with another order of samples.
        """
        handed_out = int(state_dict.get("batches_handed_out", 0))
        mine = self._layout()
        saved = {key: state_dict.get(key, value) for key, value in mine.items()}
        at_boundary = handed_out == 0 or handed_out >= int(state_dict.get("batches_per_epoch", len(self)))
        if saved == mine or at_boundary:
            self._skip = handed_out if saved == mine else 0
            return
        if saved["batch_size"] is None or mine["batch_size"] is None:
            raise ValueError(f"ResumableDataLoader: the checkpoint was taken mid-epoch after {handed_out} batches with "
                             f"batch_size={saved['batch_size']} on {saved['world_size']} rank(s); this run has "
                             f"batch_size={mine['batch_size']} on {mine['world_size']}: without a batch size on both "
                             "sides the position in samples is unknown; resume from an end-of-epoch checkpoint")
        trained = handed_out * saved["batch_size"] * saved["world_size"]
        step = mine["batch_size"] * mine["world_size"]
        where = (f"the checkpoint was taken mid-epoch after {handed_out} batches of {saved['batch_size']} on "
                 f"{saved['world_size']} rank(s) ({trained} samples of the epoch, order {saved['order']})")
        if saved["order"] != mine["order"]:
            raise ValueError(f"ResumableDataLoader: {where}; this run draws its samples in another order "
                             f"({mine['order']}), so the rest of the epoch is unknown: resume with the same "
                             "strategy kind, or from an end-of-epoch checkpoint")
        if trained != handed_out * step:
            # Lightning restores its own batch counter in the checkpoint's units: the loader must skip
            # exactly that many batches, or Lightning never sees the epoch's last batch (no validation,
            # no last optimizer step)
            raise ValueError(f"ResumableDataLoader: {where}; this run takes {mine['batch_size']} per batch on "
                             f"{mine['world_size']} rank(s) ({step} samples a step, not "
                             f"{saved['batch_size'] * saved['world_size']}): mid-epoch, keep batch size x ranks the "
                             "same (e.g. double the batch size on half the ranks), or resume from an end-of-epoch "
                             "checkpoint")
        self._skip = handed_out


def load_pending_position(fit_loop: Any, *, at_an_epochs_end: bool,
                          iterator_streams: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """The training DataLoader position of the checkpoint a fit resumes from, into a DataLoader built before Lightning
    restored it (``trainer.estimated_stepping_batches`` in ``configure_optimizers`` builds one; Lightning, which loads
    the position only as it builds, then never does, and a mid-epoch resume trains the epoch's first batches again),
    then Lightning's training iterator made again from it (within ``iterator_streams()``).

    Args:
        fit_loop: the trainer's ``fit_loop``, once Lightning restored the checkpoint (``on_train_start``).
        at_an_epochs_end: load it also where Lightning does not restart the loop (a checkpoint at an epoch's end), as a
            sampler that learns the epoch trained needs; else only where Lightning's own build would.
        iterator_streams: the random streams the iterator is made in (it draws a seed).
    """
    states = fit_loop._combined_loader_states_to_load
    if not states or fit_loop._combined_loader is None or not (at_an_epochs_end or fit_loop.restarting):
        return
    fit_loop._combined_loader._load_state_dicts(states)
    fit_loop._combined_loader_states_to_load = []
    if fit_loop._data_fetcher is not None:
        with iterator_streams():
            iter(fit_loop._data_fetcher)
