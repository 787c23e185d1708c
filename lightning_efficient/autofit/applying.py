"""AutoFit's plan put into the fit: the micro-batch with gradient accumulation keeping the global batch,
Lightning's counts of training batches counted in micro-batches, the block policies and optimizer states; and
every setting put back when the fit ends or fails."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch.utils.data import DataLoader, DistributedSampler

from lightning_efficient._batch_counts import (
    EpochEndValidation,
    SchedulerFrequencies,
    batch_settings,
    batches_trained,
    checkpoint_timing_kept,
    counted_batches,
    counts_batches,
    counts_in_micro_batches,
    epoch_ended,
    restored_batches_counted_again,
    restored_position_moved_to_the_batchs_start,
    whole_batches_in_micro_batches,
)
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.autofit.evaluation import EvaluationAtYourBatch
from lightning_efficient.autofit.fit_inputs import StreamsAtTheLastBuild, users_loader
from lightning_efficient.autofit.model import FitPlan
from lightning_efficient.autofit.token_mean import BatchTokenMean, StepTokenMean, short_batch_weight, token_mean_taken_elsewhere
from lightning_efficient.optim.callback import EightBitOptimizer
from lightning_efficient.resumable import load_pending_position


def _warn_of_batch_statistics(module: LightningModule, batch: int, micro: int) -> None:
    """Warn where ``module`` has batch-norm layers in training: they normalise over each micro-batch, so splitting the
    user's batch changes what they compute (a new user's trial: weights 0.04 apart after 8 steps at 2 x 4, silently)."""
    norms = [name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        rank_zero_warn(
            f"AutoFit: {len(norms)} batch-norm layer(s) ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) "
            f"normalise over each micro-batch: at the plan's micro-batch of {micro} they see {micro} samples where your "
            f"batch had {batch}, and their statistics and the update change with it. Give AutoFit(search_micro_batch="
            "False) to keep the batch."
        )


class _Applying:
    """The plan put into the fit and taken out again, for :class:`~lightning_efficient.autofit.callback.AutoFit` (a
    part of it: the state it reads and sets is AutoFit's, set up in its ``__init__``; its other parts' methods are
    AutoFit's too)."""

    # AutoFit's settings and state this part reads or sets
    search_micro_batch: bool
    _plan: FitPlan | None
    _micro_searched: bool
    _users_batch_size: int | None
    _users_accumulation: int | None
    _checkpoint_micro_batch: int | None
    _epoch_started_over: int | None
    _undo_settings: list[Any]
    _activations: ActivationMemory | None
    _user_activations: ActivationMemory | None
    _optimizer: EightBitOptimizer | None
    _token_mean: BatchTokenMean
    _evaluation: EvaluationAtYourBatch
    _scheduler_frequencies: SchedulerFrequencies
    _epoch_end_validation: EpochEndValidation
    _last_build: StreamsAtTheLastBuild
    _built_again: bool

    def _checkpoints_micro_batch(self, restored: dict[str, Any] | None, trainer: Trainer) -> int | None:
        """The batch size the checkpoint this fit resumes from counted its DataLoader batches in: its AutoFit plan's
        micro-batch, or, from a checkpoint without AutoFit's state, the DataLoader's batch size before this plan (the
        user's, which the checkpoint's fit drew). None where the fit does not resume, the heterogeneous strategies
        count the batches (their balancer), or it is not known."""
        if trainer.ckpt_path is None or self._heterogeneous(trainer):
            return None
        if restored is not None:
            saved = FitPlan.from_dict(restored["plan"]) if restored.get("plan") is not None else None
            return saved.micro_batches[0] if saved is not None and saved.accumulation is not None else None
        # (no checkpoint's plan: planned now, from this DataLoader; not the `batch_size` attribute, which a DataLoader
        # passed to fit() does not read)
        return self._users_batch_size

    def _what_counts_batches(self, trainer: Trainer, plan: FitPlan) -> list[str]:
        """What of this fit counts its training batches, where the plan splits them (each said as the user set it):
        AutoFit counts it in micro-batches while it fits (:meth:`_rescale_batch_counts`), which a config of fixed
        settings cannot carry (a new user's trial: `lightning-efficient plan`'s config left ``limit_train_batches: 3``
        counting micro-batches of 4 where the batch was 16, and trained 2 steps of 12 samples, not 6 of 16)."""
        if self._split(trainer, plan) is None:
            return []
        found = [f"{name}={value!r}" for name, value in batch_settings(trainer).items() if counts_batches(value)]
        found += [f"a {type(config.scheduler).__name__} stepped every {config.frequency} batches"
                  for config in trainer.lr_scheduler_configs if config.interval == "step" and config.frequency > 1]
        return found

    def _epoch_of_whole_batches(self, trainer: Trainer, plan: FitPlan) -> int | None:
        """Where the plan splits the batch of a DataLoader that drops its last incomplete batch, and drops less at the
        micro-batch: the micro-batches of the user's whole batches in an epoch (the samples plain Lightning trains, which
        AutoFit limits its epochs to as it fits); else None."""
        split = self._split(trainer, plan)
        epoch = None if split is None else self._rank_epoch(trainer)
        if epoch is None or not epoch[1]:
            return None
        kept = whole_batches_in_micro_batches(epoch[0], *split)
        return kept if kept < epoch[0] // split[1] else None

    def _short_last_batch(self, trainer: Trainer, plan: FitPlan) -> int | None:
        """Where the plan splits an epoch's short last batch of yours that AutoFit weighs as it fits
        (:meth:`_short_batch_weight`): that batch's samples (this rank's); else None."""
        split = self._split(trainer, plan)
        epoch = None if split is None or split[0] % split[1] else self._rank_epoch(trainer)
        return None if epoch is None or epoch[1] else (epoch[0] % split[0] or None)

    def _split(self, trainer: Trainer, plan: FitPlan) -> tuple[int, int] | None:
        """(the user's batch, this rank's micro-batch) where the plan splits the batch into micro-batches; else None."""
        batch, micro = self._users_batch_size, plan.ranks[trainer.global_rank].micro_batch
        return (batch, micro) if plan.accumulation is not None and isinstance(batch, int) and micro != batch else None

    def _apply(self, plan: FitPlan, trainer: Trainer, pl_module: LightningModule, token_counts: dict[str, Any] | None = None) -> None:
        mine = plan.ranks[trainer.global_rank]
        built = trainer.fit_loop._combined_loader is not None
        if self._heterogeneous(trainer):
            strategy = trainer.strategy
            self._undo_settings.append((strategy, "max_micro_batch", strategy.max_micro_batch))
            strategy.max_micro_batch = plan.micro_batches
            trainer.fit_loop._combined_loader = None  # built again under the plan's caps, as below
        elif plan.accumulation is not None and self._micro_searched and lightning_hasattr(pl_module, "batch_size"):
            current = self._draw_micro_batches_of(mine.micro_batch, trainer, pl_module)
            if current is not None:
                # (a DataLoader built already takes the same number of optimizer steps at the plan's global batch)
                self._rescale_batch_counts(trainer, current, mine.micro_batch, plan.accumulation)
                # (a StepTokenMean the user set does what this would)
                if not token_mean_taken_elsewhere(trainer) and not any(isinstance(c, StepTokenMean) for c in trainer.callbacks):
                    self._token_mean.install(trainer, pl_module, f"one batch of {current}", token_counts,
                                             sample_weight=self._short_batch_weight(trainer, current, mine.micro_batch))
                _warn_of_batch_statistics(pl_module, current, mine.micro_batch)
                if isinstance(current, int) and mine.micro_batch < current:
                    self._evaluation.install(trainer, current, mine.micro_batch)
            self._undo_settings.append((trainer, "accumulate_grad_batches", trainer.accumulate_grad_batches))
            self._users_accumulation = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = plan.accumulation
        if self._user_activations is None and ((mine.policies and any(p != "keep" for p in mine.policies)) or self._activations):
            policies = list(mine.policies) or ["keep"]
            if self._activations is None:
                self._activations = self._own_activations(policies)
            self._activations.policy = policies
            callbacks = trainer.callbacks
            if self._activations not in callbacks:  # Lightning calls its on_fit_start next, in this same loop
                callbacks.insert(callbacks.index(self) + 1, self._activations)
        if self._optimizer is not None:
            eight = plan.optimizer.startswith("8-bit")
            self._optimizer.bits = 8 if eight else 32
            self._optimizer.paged = plan.optimizer == "8-bit paged"
            self._optimizer.offload = "cpu" if plan.optimizer == "8-bit offload" else None
        self._built_again = built and trainer.fit_loop._combined_loader is None
        if self._built_again:
            self._build_training_loader_again(trainer)

    def _draw_the_checkpoints_micro_batches(self, restored: dict[str, Any] | None, trainer: Trainer,
                                            pl_module: LightningModule) -> None:
        """For a fit that trains no step, resumed from a checkpoint whose plan split the batch: the training DataLoader
        draws the plan's micro-batches, which the checkpoint's position counts and Lightning loads all the same (a
        resume of a finished run with another budget: at your batch the demo's ResumableDataLoader refused the
        position). Put back, as every setting, when the fit ends."""
        if trainer.ckpt_path is None or self._heterogeneous(trainer) or not restored or restored.get("plan") is None:
            return
        saved = FitPlan.from_dict(restored["plan"])
        if (saved.accumulation is None or len(saved.ranks) != trainer.world_size or not self.search_micro_batch
                or not lightning_hasattr(pl_module, "batch_size")):
            return
        self._draw_micro_batches_of(saved.ranks[trainer.global_rank].micro_batch, trainer, pl_module)

    def _draw_micro_batches_of(self, micro: int, trainer: Trainer, pl_module: LightningModule) -> int | None:
        """Set the module's or datamodule's ``batch_size`` to ``micro`` (put back when the fit ends), the training
        DataLoader built again at it where one is built already (reading ``trainer.estimated_stepping_batches`` in
        ``configure_optimizers`` builds it, for a OneCycleLR's total_steps); the size it replaced, or None where it was
        ``micro`` already."""
        current = lightning_getattr(pl_module, "batch_size")
        if current == micro:
            return None
        self._undo_settings.append(("batch_size", current))
        lightning_setattr(pl_module, "batch_size", micro)
        trainer.fit_loop._combined_loader = None
        return current

    def _short_batch_weight(self, trainer: Trainer, batch: Any, micro: int) -> Callable[[int], float] | None:
        """Where the plan's micro-batch divides your batch: the factor on each micro-batch's loss gradient at its index in
        the epoch (:func:`~lightning_efficient.autofit.token_mean.short_batch_weight`), so that the samples of an epoch's
        short last batch of yours weigh as in plain Lightning's step; read from the epoch the loop draws (its
        DataLoader's sampler, a reloaded one's too, this rank's share under any strategy). 1 in an epoch resumed mid-way
        from a DataLoader that starts its data over, as plain Lightning's does: its indices then are not its samples'
        positions (a review: a full micro-batch at the index of the short batch was weighed 3 times). None where the
        micro-batch does not divide your batch (nothing weighed)."""
        if not isinstance(batch, int) or batch % micro:
            return None

        def weight(batch_idx: int) -> float:
            epoch = self._epoch_keeping_its_last_batch(trainer)
            return 1.0 if epoch is None else short_batch_weight(batch_idx, samples=epoch[0], batch=batch, micro=micro)

        return weight

    def _epoch_keeping_its_last_batch(self, trainer: Trainer) -> tuple[int, int] | None:
        """(samples, micro-batches) of the epoch the loop draws on this rank, where its DataLoader is a torch one that
        keeps a short last batch and the epoch's indices are its samples' positions (not an epoch resumed mid-way from a
        DataLoader that starts its data over); else None."""
        loader = trainer.train_dataloader
        if trainer.current_epoch == self._epoch_started_over or not isinstance(loader, DataLoader) or loader.drop_last:
            return None
        try:
            return len(loader.sampler), len(loader)
        except TypeError:  # an iterable dataset: no end known
            return None

    def _run_the_sampler_to_its_end_as_yours_would(self, trainer: Trainer) -> None:
        """At the end of an epoch that drew every micro-batch of its DataLoader: where your batches end on a short one
        (your batch sampler runs the sampler to its end to fill it) and the plan's micro-batches end whole (its batch
        sampler stops before the end, and Lightning, knowing the length, asks for no more), the sampler is run to its
        end too: torch's ``RandomSampler`` draws one more permutation from a generator of its own there, which the next
        epoch's order follows (a review: a DataLoader given a generator shuffled the second epoch otherwise than plain
        Lightning's). A DataLoader iterator without a sampler iterator of torch's (the demo's resumable one) is left."""
        plan, batch = self._plan, self._users_batch_size
        if plan is None or plan.accumulation is None or not isinstance(batch, int):
            return
        micro, epoch = plan.ranks[trainer.global_rank].micro_batch, self._epoch_keeping_its_last_batch(trainer)
        if micro == batch or epoch is None:
            return
        samples, length = epoch
        if samples % batch == 0 or samples % micro:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready != length:  # (cut short: yours stopped before its end too)
            return
        iterators = getattr(getattr(trainer.fit_loop._combined_loader, "_iterator", None), "iterators", None) or [None]
        sampler_iterator = getattr(iterators[0], "_sampler_iter", None)
        if sampler_iterator is not None:
            next(sampler_iterator, None)

    def _build_training_loader_again(self, trainer: Trainer) -> None:
        """Build the training DataLoader Lightning built before the plan (``trainer.estimated_stepping_batches`` read in
        ``configure_optimizers``) again now, from the random streams as that build found them, then put the streams back
        as they are (:class:`~lightning_efficient.autofit.fit_inputs.StreamsAtTheLastBuild`): built again by the loop, it
        drew a second time, and a shuffled DataLoader trained other samples at every step than plain Lightning's (a new
        user's OneCycleLR: weights 3e-2 apart)."""
        with self._last_build.replayed():
            trainer.fit_loop.setup_data()

    def _load_the_checkpoints_data_position(self, trainer: Trainer) -> None:
        """The checkpoint's DataLoader position, which Lightning restores after ``on_fit_start``, into the DataLoader
        built again there, and the iterator made again from it (from the streams of the build: no draw plain Lightning
        does not make), as the loop's own build after the restore loaded it before AutoFit built it in ``on_fit_start``
        (a review: a mid-epoch resume trained the epoch's first batches again). Plain Lightning, whose DataLoader built
        in ``configure_optimizers`` is not built again after the restore, leaves the position unread and trains the
        epoch's first batches again; the heterogeneous strategies load it too (there the balancer does)."""
        if self._built_again and not self._heterogeneous(trainer):
            load_pending_position(trainer.fit_loop, at_an_epochs_end=False, iterator_streams=self._last_build.replayed)

    def _rescale_batch_counts(self, trainer: Trainer, batch: Any, micro: int, accumulation: int) -> None:
        """Lightning's counts of training batches (:mod:`lightning_efficient._batch_counts`) counted the user's
        DataLoader batches of ``batch``: they count the plan's micro-batches of ``micro`` while the fit runs, so the
        same samples train between the same checks (a new user's trial: ``limit_train_batches=2`` trained half the
        samples). A DataLoader that drops its last incomplete batch drops less at the micro-batch: the epoch is then
        limited to the micro-batches of the user's whole batches (a review: 10 samples in batches of 4 trained 10 in 3
        steps, where plain Lightning trains 8 in 2). Schedulers stepped every few batches step after the user's steps
        (:class:`~lightning_efficient._batch_counts.SchedulerFrequencies`, ``accumulation`` micro-batches a step)."""
        if isinstance(batch, bool) or not isinstance(batch, int):
            return
        settings = batch_settings(trainer)
        counting = dict(settings)
        epoch = None
        rank_epoch = self._rank_epoch(trainer)
        if rank_epoch is not None:  # (batches, micro-batches) of an epoch
            samples, drops_last = rank_epoch
            if drops_last:  # the micro-batches that hold the user's whole batches, the samples plain Lightning trains
                whole = samples // batch
                epoch = (whole, whole_batches_in_micro_batches(samples, batch, micro))
                limit = counting.get("limit_train_batches")
                if epoch[1] < samples // micro and isinstance(limit, float) and limit == 1.0:
                    counting["limit_train_batches"] = whole  # (the whole epoch: its micro-batches, below)
            else:
                epoch = (math.ceil(samples / batch), math.ceil(samples / micro))
        epoch_batches = None if epoch is None else epoch[0]
        counts = counted_batches(counting, epoch_batches)
        self._scheduler_frequencies.count(accumulation, trainer.accumulate_grad_batches, counts, epoch_batches)
        if not counts:
            return
        counted = counts_in_micro_batches(trainer, counts, Fraction(batch, micro), epoch=epoch, who="AutoFit",
                                          batch_words=f"batches of {batch} samples", micro_words=f"micro-batches of {micro}")
        if "val_check_interval" in counts and epoch is not None:
            self._epoch_end_validation.keep(trainer, batches_trained(counts, epoch[0]), counts["val_check_interval"])
        for name, value in counted.items():
            self._undo_settings.append((trainer, name, settings[name]))
            setattr(trainer, name, value)
        self._undo_settings += checkpoint_timing_kept(trainer, settings, counted)

    @staticmethod
    def _rank_epoch(trainer: Trainer) -> tuple[int, bool] | None:
        """This rank's samples in an epoch and whether the training DataLoader drops its last incomplete batch (None
        where the dataset has no length): what the DataLoader's sampler draws, split over the ranks where Lightning puts
        a ``DistributedSampler`` in its place (a review: with ``use_distributed_sampler=False`` every rank draws the whole
        dataset, and an epoch counted as half of it stepped a scheduler after every step of its second half)."""
        try:
            loader = users_loader(trainer)
            samples = len(loader.sampler)
        except Exception:  # noqa: BLE001 - no loader or an iterable dataset: nothing to count by
            return None
        # (the ranks the data is split over: under tensor parallelism fewer than the processes, a review)
        replicas = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", trainer.world_size)
        distributed = replicas > 1 and trainer._accelerator_connector.use_distributed_sampler
        if distributed and not isinstance(loader.sampler, DistributedSampler):
            samples = math.ceil(samples / replicas)
        return samples, bool(getattr(loader, "drop_last", False))

    def _undo(self, pl_module: LightningModule) -> None:
        self._token_mean.remove()
        self._evaluation.remove()
        self._scheduler_frequencies.put_back()
        self._epoch_end_validation.put_back()
        for item in reversed(self._undo_settings):
            if item[0] == "batch_size":
                lightning_setattr(pl_module, "batch_size", item[1])
            else:
                setattr(*item)
        self._undo_settings = []

    def _count_the_checkpoints_batches_again(self, trainer: Trainer) -> None:
        """The restored loop's batch counts in this plan's micro-batches, where the checkpoint's fit drew batches of
        another size (a plain Lightning fit's, or a plan whose micro-batch no longer fits)."""
        plan, checkpoints, self._checkpoint_micro_batch = self._plan, self._checkpoint_micro_batch, None
        if plan is None or checkpoints is None or plan.accumulation is None:
            return
        micro = plan.ranks[trainer.global_rank].micro_batch
        counted = restored_batches_counted_again(trainer, Fraction(checkpoints, micro))
        users = self._users_accumulation
        if users and plan.accumulation % users == 0:  # (each batch of the user's: this many of the plan's micro-batches)
            moved = restored_position_moved_to_the_batchs_start(trainer, plan.accumulation // users)
            if moved is not None:
                rank_zero_info(f"AutoFit: the checkpoint was saved {moved[0]} micro-batch(es) into one of your batches "
                               f"(split in {moved[1]}), whose gradients are in no checkpoint: that batch trains from its "
                               "first micro-batch again, as plain Lightning trains it again.")
        if counted is None or epoch_ended(trainer.fit_loop.epoch_loop.batch_progress):  # (the next epoch starts afresh)
            return
        before, after, inside = counted
        said = (f"AutoFit: the checkpoint counted {before} batch(es) of {checkpoints} samples into its epoch: {after} "
                f"micro-batch(es) of {micro} now, so the epoch ends, steps and validates where it would have")
        if inside:
            rank_zero_warn(f"{said}, but for the position, {before * checkpoints} samples in, which falls inside a "
                           f"micro-batch of {micro}: counted down to {after}, the epoch trains up to one micro-batch more "
                           "than the checkpoint left.")
        else:
            rank_zero_info(f"{said}.")
