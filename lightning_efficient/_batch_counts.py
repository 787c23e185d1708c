"""Lightning's integer counts of training batches, kept to the same samples where a plugin splits the user's batches.

``limit_train_batches`` (which the training half of ``overfit_batches`` sets) and ``val_check_interval`` count
DataLoader batches when they are integers. AutoFit (a smaller micro-batch with more accumulation) and the
heterogeneous strategies (more micro-batches a step where a rank's cap holds its share) hand Lightning more, smaller
batches than the user's: unchanged, those counts would train fewer samples and validate more often than the same
fit without the plugin."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

COUNTED_SETTINGS = ("limit_train_batches", "val_check_interval")


def integer_batch_counts(trainer: Any) -> dict[str, int]:
    """The settings of ``trainer`` that count training batches as positive integers (fractions, 0, bools and a
    time-based validation interval, which leaves ``val_check_interval`` unset, are not counts)."""
    counts = {}
    for name in COUNTED_SETTINGS:
        value = getattr(trainer, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            counts[name] = value
    return counts


def counts_in_micro_batches(trainer: Any, counts: dict[str, int], micro_per_batch: Fraction, *, epoch: tuple[int, int] | None,
                            who: str, batch_words: str, micro_words: str) -> dict[str, int]:
    """``counts`` of the user's batches as counts of micro-batches, ``micro_per_batch`` of them a batch: rounded up
    (and said, with ``batch_words``/``micro_words`` naming the two units) where it is no whole number.

    ``epoch`` is ``(the user's batches, the micro-batches)`` in an epoch, None where unknown: a validation interval
    of at most an epoch's batches, counted per epoch, stays at most the epoch's micro-batches (a short last batch
    splits into fewer than a whole batch's worth, and Lightning refuses an interval beyond the epoch)."""
    counted_counts = {}
    for name, value in counts.items():
        scaled = value * micro_per_batch
        counted = math.ceil(scaled)
        per_epoch = name == "val_check_interval" and trainer.check_val_every_n_epoch is not None
        if per_epoch and epoch is not None and value <= epoch[0]:
            counted = min(counted, max(1, epoch[1]))
        if scaled != counted:
            rank_zero_warn(f"{who}: {name}={value} {batch_words} is {float(scaled):g} {micro_words}; counting {counted} "
                           "while the fit runs")
        counted_counts[name] = counted
    return counted_counts


def checkpoint_timing_kept(trainer: Any, counts: dict[str, int], counted: dict[str, int]) -> list[tuple[Any, str, Any]]:
    """Where ``val_check_interval=1`` (every batch) counts more micro-batches, each ``ModelCheckpoint`` that decides
    when to save from the trainer's settings is told what it decides with the user's: Lightning's saves at the
    epoch's end, not after every validation, wherever ``trainer.val_check_interval == 1.0`` (which the integer 1
    meets) and validation runs every epoch. Returns ``(callback, attribute, value before)`` to put back."""
    if counts.get("val_check_interval") != 1 or counted.get("val_check_interval", 1) == 1:
        return []
    undo = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback._save_on_train_epoch_end is None:
            undo.append((callback, "_save_on_train_epoch_end", None))
            callback._save_on_train_epoch_end = trainer.check_val_every_n_epoch == 1
    return undo
