"""What AutoFit reads from a fit without changing it: its training DataLoader's batch size (the samplers and random
streams a draw moves put back), the checkpoint the fit resumes from and the callbacks' states in it, and the AutoFit
state the ranks agree to go on from."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_efficient._distributed import gather_objects
from lightning_efficient._generators import held_generators_restored
from lightning_efficient._torch import random_streams_restored


@contextlib.contextmanager
def samplers_left_as_they_were(loader: Any) -> Iterator[None]:
    """The random states a draw from ``loader`` moves put back afterwards: the global streams, and the generators the
    loader, its samplers, its dataset and its collate function hold (a shuffling sampler with a generator of its own
    draws from it, a DataLoader's iterator draws its base seed, a dataset's augmentation and a collate function draw
    from theirs: :func:`~lightning_efficient._generators.held_generators`)."""
    roots = (loader, getattr(loader, "dataset", None), getattr(loader, "collate_fn", None))
    with random_streams_restored(torch.device("cpu")), held_generators_restored(*roots):
        yield


def loader_batch_size(loader: Any) -> int:
    """Samples in one batch of ``loader``: its ``batch_size``, or (a ``batch_sampler`` of its own) the length of the
    first batch a copy of it gives (a sampler that keeps its position is not moved; nor are the random states)."""
    size = getattr(loader, "batch_size", None)
    if size:
        return int(size)
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None)
    if size:
        return int(size)
    if sampler is None:
        return 1
    with samplers_left_as_they_were(loader):
        try:
            sampler = copy.deepcopy(sampler)
        except Exception:  # noqa: BLE001 - a sampler that cannot be copied is drawn from, its random states put back
            pass
        first = next(iter(sampler), None)
    return max(1, len(first)) if first is not None else 1


def fit_checkpoint_path(trainer: Trainer) -> tuple[Any, bool | None]:
    """The checkpoint this ``fit`` restores (None: none) and the ``weights_only`` it is loaded with, from ``setup`` on.

    Lightning sets ``trainer.ckpt_path`` only when it loads the checkpoint: after ``setup`` always, and after
    ``on_fit_start`` where the strategy restores after setup (``ModelParallelStrategy``, ``hetero_fsdp``); until
    then (and after a fit, where it keeps the last fit's) the path lives only in ``Trainer._run``'s arguments,
    read here from its frame (a Lightning that names them otherwise gives None: the resume measures again)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
                return frame.f_locals.get("ckpt_path"), frame.f_locals.get("weights_only")
            frame = frame.f_back
    finally:
        del frame
    return None, None


@dataclass(frozen=True)
class CheckpointContents:
    """What AutoFit reads from the checkpoint a fit resumes from, before Lightning loads it."""

    callback_states: dict[str, Any]  # the callbacks' states, by state key
    eight_bit_states: bool  # whether an optimizer's states are in bitsandbytes' blockwise (8-bit) layout
    read: bool = True  # False: a checkpoint that could not be read early (remote, or a format this read does not know)


def checkpoint_contents(path: Any, weights_only: bool | None) -> CheckpointContents:
    """The callbacks' states a local checkpoint (a file or a distributed-checkpoint directory) holds and whether its
    optimizer states are 8-bit, read without loading its tensors, with the fit's ``weights_only``; nothing (and
    ``read`` False) for a remote path (Lightning loads those itself, later) and for one that cannot be read this way
    (said once; Lightning's own load decides); nothing for no checkpoint."""
    if path is None:
        return CheckpointContents({}, False)
    if not os.path.exists(path):
        return CheckpointContents({}, False, read=False)
    from lightning_efficient.optim.sharded import checkpoint_layouts
    from lightning_efficient.optim.state import BNB_BLOCKWISE

    try:
        layouts, _, callbacks = checkpoint_layouts(path, weights_only=weights_only)
    except Exception as error:  # noqa: BLE001 - a format this read does not know: Lightning loads it later
        rank_zero_info(f"AutoFit: the checkpoint's callback states could not be read before Lightning loads it "
                       f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); a plan in it is reused only where "
                       "Lightning restores before AutoFit plans (not under the sharded strategies)")
        return CheckpointContents({}, False, read=False)
    return CheckpointContents(dict(callbacks or {}), any(BNB_BLOCKWISE in found for found in layouts))


def agreed_restored_state(restored: dict[str, Any] | None) -> dict[str, Any] | None:
    """The AutoFit state every rank goes on from, the same on all of them. A collective: call it on every rank.

    Ranks that decided apart (one reusing the checkpoint's plan while another measures) would wait on each other's
    collectives. A rank can read none where the checkpoint's callback states could not be read on its node: the state
    the other ranks read is then used on it too. Only where ranks read different states does every rank plan afresh.

    Args:
        restored: the AutoFit state this rank read from the checkpoint, or None.

    Returns:
        The state all ranks read (or the one the ranks that read one agree on), else None on every rank.
    """
    gathered = gather_objects(restored)
    read = [g for g in gathered if g is not None]
    if not read or all(g == read[0] for g in read[1:]):
        missing = [rank for rank, g in enumerate(gathered) if g is None]
        if read and missing:
            rank_zero_info(f"AutoFit: rank(s) {missing} read no AutoFit state from the checkpoint; the state the other "
                           "ranks read is used on every rank.")
        return read[0] if read else None
    rank_zero_info("AutoFit: the ranks read different AutoFit states from the checkpoint; planning again on every rank.")
    return None


class StreamsAtTheLastBuild:
    """torch's CPU, Python's and NumPy's global random streams as they were when Lightning last built a fit's training
    DataLoader before the fit's start (``trainer.estimated_stepping_batches`` read in ``configure_optimizers`` builds it;
    a ``LearningRateFinder`` or ``BatchSizeFinder`` builds it again): building it again from there draws what that
    build drew, in ``train_dataloader()`` and in making its iterator (a seed, and with workers, which read ahead at once,
    the shuffled order). Built again from the streams as they stood later, a new user's first epoch trained plain
    Lightning's second epoch's order. Watched from ``setup`` to ``on_fit_start`` through the loop's ``setup_data``."""

    def __init__(self) -> None:
        self.state: tuple[Tensor, Any, Any] | None = None
        self._loop: Any = None

    def watch(self, fit_loop: Any) -> None:
        """Read the streams at each of ``fit_loop``'s builds from now on."""
        self.stop()
        self.state = None
        original = fit_loop.setup_data

        def setup_data() -> None:
            if fit_loop._combined_loader is None or fit_loop._should_reload_train_dl:  # (it builds: not an early return)
                self.state = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
            return original()

        fit_loop.setup_data = setup_data
        self._loop = fit_loop

    def stop(self) -> None:
        """Give the loop its own ``setup_data`` back (the state read stays)."""
        if self._loop is not None and "setup_data" in vars(self._loop):
            del self._loop.setup_data
        self._loop = None

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Within: the streams as the last build found them (as they are where none was read); after: as they were."""
        with random_streams_restored(torch.device("cpu")):
            if self.state is not None:
                torch_state, python_state, numpy_state = self.state
                torch.random.set_rng_state(torch_state)
                random.setstate(python_state)
                np.random.set_state(numpy_state)
            yield


def users_loader(trainer: Trainer) -> Any:
    """The training DataLoader the fit's ``train_dataloader()`` returns, for AutoFit to read, with the random streams
    a draw in it moves put back (a review: a split drawn there moved Python's and NumPy's streams on)."""
    with random_streams_restored(trainer.strategy.root_device):
        return trainer.fit_loop._data_source.dataloader()
