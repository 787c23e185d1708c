"""Lightning's counts of training batches, kept to the same samples where a plugin splits the user's batches.

``limit_train_batches`` (which the training half of ``overfit_batches`` sets) and ``val_check_interval`` count
DataLoader batches: as integers, or as fractions of an epoch's batches that Lightning rounds down to whole batches.
AutoFit (a smaller micro-batch with more accumulation) and the heterogeneous strategies (more micro-batches a step
where a rank's cap holds its share) hand Lightning more, smaller batches than the user's: unchanged, those counts
would train other samples and validate at other steps than the same fit without the plugin."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_efficient._instance_wrappers import InstanceWrapper, put_back

COUNTED_SETTINGS = ("limit_train_batches", "val_check_interval")


def batch_settings(trainer: Any) -> dict[str, Any]:
    """The user's settings of ``trainer`` that count training batches, as they are (a time-based validation interval
    leaves ``val_check_interval`` unset: it is left out)."""
    return {name: getattr(trainer, name) for name in COUNTED_SETTINGS if hasattr(trainer, name)}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_fraction(value: Any) -> bool:
    return isinstance(value, float) and 0.0 < value < 1.0


def counts_batches(value: Any) -> bool:
    """Whether a value of :data:`COUNTED_SETTINGS` counts training batches: an integer, or a fraction of an epoch's."""
    return _is_count(value) or _is_fraction(value)


def counted_batches(settings: dict[str, Any], epoch_batches: int | None) -> dict[str, int]:
    """The user's batches each of ``settings`` counts: an integer as it is; a fraction below 1 as Lightning counts it
    over an epoch of ``epoch_batches`` of the user's batches (the validation interval's over the epoch's batches
    trained), where that is known; 0, 1.0 (the whole epoch) and times are left out. A fraction of no whole batch is
    refused as Lightning refuses it, in the user's batches."""
    counts = {name: value for name, value in settings.items() if _is_count(value)}
    if epoch_batches is None:
        return counts
    limit = settings.get("limit_train_batches")
    trained = epoch_batches
    if _is_count(limit):
        trained = min(epoch_batches, limit)
    elif _is_fraction(limit) and epoch_batches > 0:
        if int(epoch_batches * limit) == 0:  # Lightning's own refusal, in the user's batches (it counted micro-batches)
            raise MisconfigurationException(
                f"You requested to check {limit} of the `train_dataloader` but {limit} * {epoch_batches} < 1. Please increase"
                f" the `limit_train_batches` argument. Try at least `limit_train_batches={1.0 / epoch_batches}`")
        trained = counts["limit_train_batches"] = int(epoch_batches * limit)
    interval = settings.get("val_check_interval")
    if _is_fraction(interval):
        counts["val_check_interval"] = max(1, int(trained * interval))
    return counts


def batches_trained(counts: dict[str, int], epoch_batches: int | None) -> int | None:
    """The user's batches an epoch of ``epoch_batches`` of them (None: unknown) trains under the ``counts`` of
    :func:`counted_batches`."""
    return None if epoch_batches is None else min(epoch_batches, counts.get("limit_train_batches", epoch_batches))


def counts_in_micro_batches(trainer: Any, counts: dict[str, int], micro_per_batch: Fraction, *, epoch: tuple[int, int] | None,
                            who: str, batch_words: str, micro_words: str) -> dict[str, int]:
    """``counts`` of the user's batches as counts of micro-batches, ``micro_per_batch`` of them a batch: rounded up
    (and said, with ``batch_words``/``micro_words`` naming the two units) where it is no whole number.

    ``epoch`` is ``(the user's batches, the micro-batches)`` in an epoch, None where unknown: a count of a whole epoch
    or more (a validation interval counted per epoch) is the epoch's micro-batches, which need not be the user's
    batches times ``micro_per_batch`` (a short last batch splits into fewer, an epoch's last step has its own)."""
    counted_counts = {}
    trained = batches_trained(counts, None if epoch is None else epoch[0])
    for name, value in counts.items():
        scaled = value * micro_per_batch
        counted = math.ceil(scaled)
        per_epoch = name == "limit_train_batches" or trainer.check_val_every_n_epoch is not None
        if name == "val_check_interval" and per_epoch and trained is not None and value > trained and trainer.limit_val_batches > 0:
            # Lightning's own refusal, in the user's batches (in micro-batches, it named numbers the user never set)
            raise ValueError(
                f" `val_check_interval` ({value}) must be less than or equal to the number of the training batches ({trained})."
                " If you want to disable validation set `limit_val_batches` to 0.0 instead."
                " If you want to validate based on the total training batches, set `check_val_every_n_epoch=None`.")
        if per_epoch and epoch is not None and value >= epoch[0]:
            counted = scaled = max(1, epoch[1]) if name == "limit_train_batches" or value == epoch[0] else counted
        if name == "val_check_interval" and not per_epoch and epoch is not None and epoch[1] != epoch[0] * micro_per_batch:
            # counted across epochs, an interval is one number of micro-batches; an epoch of another number than the
            # user's batches x micro_per_batch (a short last batch splits into fewer) moves each later validation
            rank_zero_warn(f"{who}: val_check_interval={value} is counted across epochs (check_val_every_n_epoch=None), and"
                           f" an epoch of {epoch[0]} {batch_words} holds {epoch[1]} {micro_words}, not"
                           f" {float(epoch[0] * micro_per_batch):g}: validations after the first epoch fall at other samples"
                           " than the same fit's without it")
        if scaled != counted:
            rank_zero_warn(f"{who}: {name}={value} {batch_words} is {float(scaled):g} {micro_words}; counting {counted} "
                           "while the fit runs")
        counted_counts[name] = counted
    return counted_counts


class SchedulerFrequencies:
    """The steps a learning-rate scheduler of ``interval="step"`` steps after, kept to the user's where a plugin splits
    each step's batches into more micro-batches.

    Lightning steps such a scheduler after the optimizer step that ends at the epoch's batch ``batch_idx`` where its
    ``frequency`` divides ``batch_idx + 1``: the frequency counts the user's DataLoader batches (a new user's trial: a
    ``StepLR`` of frequency 2 halved the rate every step, not every second one, where AutoFit or the caps split each batch
    in two). Before each batch, each such frequency (above 1; 1 steps after every step) is set to what makes Lightning's
    test give the same fit's answer without the plugin: whether the frequency divides the user's batches trained in the
    epoch by the end of this step. Put back when the fit ends (while the fit runs, ``config.frequency`` reads
    ``batch_idx + 1`` or ``+ 2``)."""

    def __init__(self) -> None:
        self._counting: tuple[int, int, int | None] | None = None
        self._frequencies: list[tuple[Any, int]] | None = None  # (scheduler config, the user's frequency)

    def count(self, micro_per_step: int, user_per_step: int, counts: dict[str, int], epoch_batches: int | None) -> None:
        """From now on a step runs ``micro_per_step`` micro-batches where the user's runs ``user_per_step`` batches, and
        an epoch holds ``epoch_batches`` of the user's batches (None: unknown, an iterable dataset's), of which it trains
        those the ``counts`` of :func:`counted_batches` limit it to."""
        self.put_back()
        if micro_per_step != user_per_step:
            self._counting = (micro_per_step, user_per_step, batches_trained(counts, epoch_batches))

    def before_batch(self, trainer: Any, batch_idx: int) -> None:
        """Set the frequencies Lightning tests after the batch ``batch_idx`` of the epoch (an index of micro-batches)."""
        if self._counting is None:
            return
        if self._frequencies is None:  # (the schedulers are configured after the plugin counted)
            self._frequencies = [(config, config.frequency) for config in trainer.lr_scheduler_configs
                                 if config.interval == "step" and config.frequency > 1]
        micro_per_step, user_per_step, user_epoch_batches = self._counting
        user_batches = (batch_idx // micro_per_step + 1) * user_per_step  # by the end of this batch's step
        if user_epoch_batches is not None:
            user_batches = min(user_batches, user_epoch_batches)  # (an epoch's short last step)
        for config, frequency in self._frequencies:
            config.frequency = batch_idx + 1 if user_batches % frequency == 0 else batch_idx + 2

    def put_back(self) -> None:
        """The user's frequencies again; nothing counted until :meth:`count`."""
        for config, frequency in self._frequencies or []:
            config.frequency = frequency
        self._counting, self._frequencies = None, None


class EpochEndValidation:
    """Whether validation runs at an epoch's last batch decided in the user's batches, for one fit. Lightning validates
    there where the batches trained in the epoch are a multiple of the validation interval; counted in micro-batches,
    an epoch whose short last batch splits into fewer (60 samples: 8 batches of 8, 30 micro-batches of 2) is a
    multiple of another number: the epoch-end validation of ``val_check_interval=0.5`` (every 4 batches, 16
    micro-batches) was skipped (a new user's trial: validations at steps 4, 12, where plain Lightning's are at 4, 8,
    12, 16), or one was added where plain Lightning has none."""

    def __init__(self) -> None:
        self._loop: Any = None

    def keep(self, trainer: Any, epoch_batches: int, interval: int) -> None:
        """From now until :meth:`put_back`, ``trainer`` validates at an epoch's last batch (validation counted per
        epoch) where its ``epoch_batches`` trained (in the user's batches) are a multiple of ``interval`` (theirs)."""
        self.put_back()
        loop = trainer.fit_loop.epoch_loop
        original = loop._should_check_val_fx
        at_the_end = epoch_batches % interval == 0

        def should_check(*args: Any, **kwargs: Any) -> bool:
            decided = original(*args, **kwargs)
            progress = loop.batch_progress
            # (the epoch's last batch as it is trained: not a restored mark of one a restart trains again, nor a
            # fetcher of `dataloader_iter` steps, nor a stop, which Lightning validates at itself)
            if (not progress.is_last_batch or progress.current.ready < trainer.num_training_batches
                    or trainer.check_val_every_n_epoch is None or trainer.val_check_batch == float("inf")
                    or any(isinstance(a, _DataLoaderIterDataFetcher) for a in args)
                    or (trainer.should_stop and trainer.fit_loop._can_stop_early) or not loop._should_check_val_epoch()):
                return decided
            return at_the_end

        loop._should_check_val_fx = InstanceWrapper(should_check, original)
        self._loop, self._original = loop, original

    def put_back(self) -> None:
        """Lightning's own decision again."""
        if self._loop is not None:
            put_back(self._loop, "_should_check_val_fx", self._original)
            self._loop = None


_COUNTS = ("ready", "started", "processed", "completed")


def whole_batches_in_micro_batches(samples: int, batch: int, micro: int) -> int:
    """The micro-batches of ``micro`` samples that hold an epoch's whole batches of ``batch`` (of ``samples``): what a
    DataLoader dropping its last incomplete batch trains in plain Lightning, which drops less at the micro-batch."""
    return min(samples // micro, math.ceil(Fraction(samples // batch * batch, micro)))


def _restart_position(loop: Any) -> int:
    """The batch of the epoch Lightning's restored loop restarts from: the batches completed, one more where the
    checkpoint was saved in ``on_train_batch_end`` (whose batch it completes on the restart; an exception's checkpoint
    counts its batch ready, not completed)."""
    return loop.batch_progress.current.completed + int(loop.restarted_on_train_batch_end)


def restored_batches_counted_again(trainer: Any, batches_per_micro_batch: Fraction) -> tuple[int, int, bool] | None:
    """The training loop's batch counts, restored from a checkpoint whose fit drew other batch sizes (a plain fit's
    batches, or another plan's micro-batches), counted in this fit's micro-batches: ``batches_per_micro_batch`` of them
    make one of the checkpoint's batches (``Fraction(8, 2)``: 4 micro-batches of 2 samples a batch of 8). The counts
    decide where the epoch ends, when an accumulation window steps and when validation runs: counted in the
    checkpoint's batches, a plain fit's 16 batches of 8 resumed at micro-batch 2 trained the epoch's other 64
    micro-batches where 16 were left (a new user's trial: 8 optimizer steps in an epoch of 5).

    Lightning restarts from the batches completed (one more where the checkpoint was saved in ``on_train_batch_end``,
    whose batch it completes on the restart; an exception's checkpoint counts its batch ready, not completed): that
    position is counted again, each count kept at its distance from it; at an epoch's end it is this fit's epoch, its
    micro-batches (a short last batch, or a ratio that is not whole, gives them otherwise than the checkpoint's times
    the ratio), and the epochs before are counted again by the ratio. Call once the checkpoint's loops are restored,
    before the epoch starts (``on_train_start``). Returns (the epoch's batches counted before, after, whether the
    position falls inside one of this fit's micro-batches), or None where nothing was counted."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress
    current, total = progress.current, progress.total
    if batches_per_micro_batch == 1 or (current.ready == 0 and total.ready == 0):
        return None
    at = _restart_position(loop)
    total_at = total.completed + (at - current.completed)
    exact = at * batches_per_micro_batch
    epoch = trainer.num_training_batches
    now = epoch if epoch_ended(progress) and math.isfinite(epoch) else math.floor(exact)
    total_now = math.floor((total_at - at) * batches_per_micro_batch) + now
    for counts, before, after in ((current, at, now), (total, total_at, total_now)):
        for name in _COUNTS:
            count = getattr(counts, name)
            setattr(counts, name, after - (before - count) if count <= before
                    else after + math.floor((count - before) * batches_per_micro_batch))
    return at, now, not epoch_ended(progress) and exact != now


def restored_position_moved_to_the_batchs_start(trainer: Any, micro_batches_per_batch: int) -> tuple[int, int] | None:
    """Where a checkpoint was saved between the micro-batches a plugin split one of the user's batches into (an
    exception inside it, or a time-based save there) and the training DataLoader keeps no position (Lightning starts
    the epoch's data again): the restored batch counts moved back to the batch's first micro-batch, so the batch
    trains whole again, as plain Lightning trains a batch that raised again (a new user's trial: an exception in a
    step's third micro-batch of 4 resumed with a step of the last 2, and the epoch trained 8 samples fewer; under the
    user's own accumulation of 2, the micro-batch before the one that raised was never trained). The step's earlier
    batches (the user's own accumulation) are not trained again, as in plain Lightning. Call once the checkpoint's
    loops are restored, before the epoch starts (``on_train_start``), with the micro-batches a batch of the user's
    is split into. Returns (the micro-batches moved back, ``micro_batches_per_batch``), or None where nothing moved."""
    from lightning.fabric.utilities.types import _Stateful

    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress
    loader = trainer.fit_loop._combined_loader
    if micro_batches_per_batch <= 1 or not loop.restarting or epoch_ended(progress) or loader is None:
        return None
    if any(isinstance(each, _Stateful) for each in loader.flattened):  # (a position restored: the data goes on from it)
        return None
    at = _restart_position(loop)
    back = at % micro_batches_per_batch
    if back == 0:
        return None
    for counts in (progress.current, progress.total):
        for name in _COUNTS:
            setattr(counts, name, getattr(counts, name) - back)
    if loop.restarted_on_train_batch_end and (at - back) % trainer.accumulate_grad_batches == 0:
        # Lightning counts a step for the logger where a checkpoint saved in on_train_batch_end ends one, which it now
        # seems to (a review: the logger's step ran one ahead of global_step for the rest of the fit)
        loop._batches_that_stepped -= 1
    return back, micro_batches_per_batch


def epoch_ended(progress: Any) -> bool:
    """Whether a restored (or saved) ``batch_progress`` is at its epoch's end: the last batch fetched and trained.
    Lightning marks the last batch as it fetches it, so the checkpoint of an exception inside it is mid-epoch (a
    review: its batch was skipped on a resume that counted it as the epoch's end)."""
    return bool(progress.is_last_batch) and progress.current.processed == progress.current.ready


def checkpoint_timing_kept(trainer: Any, settings: dict[str, Any], counted: dict[str, int]) -> list[tuple[Any, str, Any]]:
    """Where ``val_check_interval=1`` (every batch) counts more micro-batches, each ``ModelCheckpoint`` that decides
    when to save from the trainer's settings is told what it decides with the user's: Lightning's saves at the
    epoch's end, not after every validation, wherever ``trainer.val_check_interval == 1.0`` (which the integer 1
    meets) and validation runs every epoch. Returns ``(callback, attribute, value before)`` to put back."""
    interval = settings.get("val_check_interval")
    if not (_is_count(interval) and interval == 1) or counted.get("val_check_interval", 1) == 1:
        return []
    undo = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback._save_on_train_epoch_end is None:
            undo.append((callback, "_save_on_train_epoch_end", None))
            callback._save_on_train_epoch_end = trainer.check_val_every_n_epoch == 1
    return undo


class ResumedStepSaved:
    """Tell each ``ModelCheckpoint`` that the step a fit resumed at is saved, before the fit's first training batch.
    Lightning does not restore the step it last saved at, so where micro-batches split a step (a plugin's, or
    ``accumulate_grad_batches``) one saving every few steps saved again after the next step's first micro-batch, still
    at the resumed step, over the checkpoint the fit resumed from: a mid-step state, which a later resume from it
    trained otherwise (a new user's trial under hetero_fsdp: weights 6.1e-3 apart). Not sooner: a fit resumed inside a
    validation finishes it at the resumed step first, and its checkpoints are saved as they would have been (a review)."""

    def __init__(self) -> None:
        self._pending = False

    def fit_started(self) -> None:
        """A fit's training starts: mark before its first batch."""
        self._pending = True

    def before_batch(self, trainer: Any) -> None:
        """Mark the resumed step as saved, once, where the fit resumed from a checkpoint."""
        if not self._pending:
            return
        self._pending = False
        if trainer.ckpt_path is None or trainer.global_step == 0:
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback._last_global_step_saved < trainer.global_step:
                callback._last_global_step_saved = trainer.global_step
