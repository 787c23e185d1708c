"""The batch's token mean where AutoFit splits it into micro-batches.

Lightning divides each micro-batch's loss by the accumulation, so a loss that is a mean over its micro-batch's
valid tokens makes the step a mean of micro-batch means: where the rows hold different numbers of valid tokens
(padding, ``-100`` labels), the plan's micro-batches weigh the tokens otherwise than the user's batch did (a new
user's padded GPT-2 split 1 x 8: the first gradient 40% away from the batch of 8's). For a
:class:`~lightning_efficient.TokenLosses` or :class:`~lightning_efficient.FusedTokenLoss` output the token counts
are known, and each micro-batch's token-loss sum is weighed so that the update is the one the unsplit batch gives:

- in one process and under DDP (whose gradients are each rank's own until the step's last backward),
  :class:`~lightning_efficient.tokens.normalize.RankStepTokenMean` makes each rank's gradient the mean over its
  valid tokens in the step, which DDP averages over the ranks, as a plain DDP fit on the unsplit batch does;
- where every backward reduces the gradients over the ranks (FSDP2), a rank's own mean cannot be made after the
  fact: :class:`~lightning_efficient.tokens.normalize.StepTokenNormaliser` makes the step the mean over every
  valid token of every rank (as ``SelectiveTokenLoss`` and the heterogeneous strategies do), where a plain FSDP2 fit
  averages the ranks' own means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_efficient._instance_wrappers import InstanceWrapper, put_back
from lightning_efficient._samples import token_ids
from lightning_efficient._step import step_batch_index
from lightning_efficient.tokens.normalize import RankStepTokenMean, StepTokenNormaliser, loss_weighted, optimizer_step_normalising
from lightning_efficient.tokens.output import loss_sum_and_count

_WRAPPED = ("training_step", "optimizer_step")


class BatchTokenMean:
    """Wraps a module's ``training_step`` and ``optimizer_step`` for one fit so that a token-loss output's step
    gradient is the unsplit batch's token mean, whatever the micro-batches (see the module docstring for the ranks).

    Other outputs pass as they are; the first one is named once (``batch_words``: the batch the plan splits).
    """

    def __init__(self) -> None:
        self.normaliser = StepTokenNormaliser()  # where gradients are reduced at every backward
        self.rank_mean = RankStepTokenMean()  # where they are a rank's own until the step's last backward
        self._module: LightningModule | None = None
        self._wrappers: dict[str, Any] = {}
        self._live = {"on": False}
        self._told = False
        self._who = "AutoFit"
        self._one_process = True
        self._kept: dict[str, float] = {}  # the last fit's counts, once removed

    @property
    def installed(self) -> bool:
        """Whether a module's hooks are wrapped now."""
        return self._module is not None

    def install(self, trainer: Trainer, module: LightningModule, batch_words: str, counts: Mapping[str, Any] | None = None,
                who: str = "AutoFit", sample_weight: Callable[[int], float] | None = None) -> None:
        """Wrap ``module``'s hooks for the fit ``trainer`` runs; ``counts`` are a checkpoint's running token counts
        (:meth:`saved_counts`: a resumed first step rounds as the uninterrupted run's); ``who`` names the callback in
        what it says; ``sample_weight``: the factor on the gradient of a loss that is not per token (a mean over the
        micro-batch's samples) at each batch index of the epoch (:func:`short_batch_weight`)."""
        self.remove()
        self._who = who
        self._one_process = trainer.world_size == 1
        self.normaliser.reset()
        self.rank_mean.reset()
        self._kept = {}
        self.restore_counts(counts or {})
        self._told = False
        original_step, original_optimizer_step = module.training_step, module.optimizer_step
        # cleared by remove(): a wrapper another callback set on top of ours puts ours back when it is removed, after
        # this fit's teardown (a review: left so, it weighed a later fit's steps by this fit's counts)
        self._live = live = {"on": True}

        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = original_step(*args, **kwargs)
            if not live["on"] or trainer.state.stage not in (None, RunningStage.TRAINING):  # (or a validation_step's call)
                return output
            accumulation = trainer.accumulate_grad_batches
            if accumulation == 1:  # one micro-batch a step: its own mean is the step's (under FSDP2 too, as plain)
                return output
            found = loss_sum_and_count(output)
            batch_idx = step_batch_index(trainer, args, kwargs)
            first = batch_idx % accumulation == 0
            if found is None:
                if first:  # (a later micro-batch of this step counts from nothing, not from an earlier step's)
                    self.rank_mean.forget_step()
                if output is not None:  # (None: a step skipped)
                    self._tell_once(output, batch_words, args[0] if args else kwargs.get("batch"))
                return output if sample_weight is None else loss_weighted(output, sample_weight(batch_idx))
            if _gradients_are_local_until_the_last_backward(trainer):
                loss = self.rank_mean.micro_batch_loss(*found, accumulation, first=first,
                                                       last=not trainer.fit_loop._should_accumulate(), optimizers=trainer.optimizers,
                                                       shown=output["loss"])
            else:
                loss = self.normaliser.micro_batch_loss(*found, accumulation, batch_idx=batch_idx, shown=output["loss"])
            return {**output, "loss": loss}

        def normalise(optimizer: Any) -> None:
            if live["on"]:
                self.rank_mean.close_step(trainer.optimizers)  # (a step whose last micro-batch returned no token losses)
                self.normaliser.normalise_gradients(optimizer)

        optimizer_step = optimizer_step_normalising(original_optimizer_step, normalise)
        self._wrappers = {"training_step": InstanceWrapper(training_step, original_step),
                          "optimizer_step": InstanceWrapper(optimizer_step, original_optimizer_step)}
        for name, wrapper in self._wrappers.items():
            setattr(module, name, wrapper)
        self._module = module

    def saved_counts(self) -> dict[str, float]:
        """The running token counts a checkpoint keeps (none where nothing is counted yet; after a fit, its last): the
        global token mean's (FSDP2) and, in one process, the rank mean's (under DDP each rank holds its own, which rank 0's
        checkpoint cannot: a resume there starts from its first micro-batch's, which changes nothing but rounding)."""
        if not self.installed:  # (a checkpoint saved after the fit: its last counts, a review)
            return dict(self._kept)
        counts = {}
        if self.normaliser.scale is not None:
            counts["step_token_scale"] = self.normaliser.scale
        if self._one_process and self.rank_mean.previous_count is not None:
            counts["rank_token_count"] = self.rank_mean.previous_count
        return counts

    def restore_counts(self, counts: Mapping[str, Any]) -> None:
        """Take :meth:`saved_counts`' counts for the fit in progress (or the one being installed)."""
        self.normaliser.scale = counts.get("step_token_scale")
        self.rank_mean.previous_count = counts.get("rank_token_count") if self._one_process else None

    def remove(self) -> None:
        """Put the module's hooks back as they were, where ours is still the outermost; ours under a wrapper another
        set on top of it since passes every call through from now on."""
        self._live["on"] = False
        self._kept = self.saved_counts()
        module, self._module = self._module, None
        if module is not None:
            for name in _WRAPPED:
                wrapper = self._wrappers[name]
                if vars(module).get(name) is wrapper:
                    put_back(module, name, wrapper.__wrapped__)
        self._wrappers = {}
        self.normaliser.reset()
        self.rank_mean.reset()

    def _tell_once(self, output: Any, batch_words: str, batch: Any) -> None:
        if self._told:
            return
        self._told = True
        if token_ids(batch) is None:  # features, images: no tokens whose count varies (a new user's trial: an MLP was told)
            return
        rank_zero_info(
            f"{self._who}: training_step returns {type(output).__name__}, a loss over its micro-batch: where it is a mean over "
            f"tokens whose count varies from sample to sample (padding, -100 labels), the micro-batches weigh them "
            f"otherwise than {batch_words} (Lightning divides each micro-batch's own mean by the accumulation). Return "
            "lightning_efficient.TokenLosses(per_token_losses, mask) for the batch's token mean. A mean over samples that "
            "weigh the same (a classifier's cross-entropy) is the batch's mean over micro-batches of equal size: "
            "nothing to do for it."
        )


class StepTokenMean(Callback):
    """Makes a step's gradient the mean over its valid tokens where the step runs several micro-batches
    (``accumulate_grad_batches``), for a ``training_step`` returning :class:`~lightning_efficient.TokenLosses` or
    :class:`~lightning_efficient.FusedTokenLoss`: the update the step's samples give as one batch. Lightning divides
    each micro-batch's own token mean by the accumulation, which weighs the tokens of rows of other lengths otherwise.

    What AutoFit does where its plan splits the batch, as a callback of its own: ``lightning-efficient plan`` puts it in
    the config it prints for a plan that splits, so that config trains as AutoFit's fit. On one device and under DDP
    each rank's gradient is its own token mean (DDP averages the ranks' as for the unsplit batch); under FSDP2 the
    step is the mean over every rank's tokens (see :mod:`~lightning_efficient.autofit.token_mean`). Under the
    heterogeneous strategies (their own global token mean) and beside a ``SelectiveTokenLoss`` (its own) it does
    nothing. Other outputs pass as they are, said once.
    """

    def __init__(self) -> None:
        self._mean = BatchTokenMean()
        self._restored: dict[str, Any] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Wrap the module's hooks for this fit (nothing under a heterogeneous strategy or beside SelectiveTokenLoss)."""
        counts, self._restored = self._restored, {}
        if is_heterogeneous(trainer.strategy) or token_mean_taken_elsewhere(trainer):
            return
        self._mean.install(trainer, pl_module, "one batch of each step's samples", counts, who="StepTokenMean")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Put the module's hooks back."""
        self._mean.remove()
        self._restored = {}

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Put the module's hooks back: Lightning skips teardown when a fit raises (a review: the wrapper left behind
        weighed the next fit's steps by this trainer's accumulation)."""
        self.teardown(trainer, pl_module, "fit")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """The running token counts (:meth:`BatchTokenMean.saved_counts`: the global token mean's under FSDP2, the
        rank mean's in one process), so a resumed first step rounds as the uninterrupted run's: at the checkpoint's top
        level, not in the callback's state, so that a resume without this callback is not asked for it (a review)."""
        counts = self._mean.saved_counts()
        if counts:
            checkpoint[_COUNTS_KEY] = counts

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Read back :meth:`on_save_checkpoint`'s counts: for this fit where they are loaded after ``on_fit_start``
        (ModelParallelStrategy), else for the next."""
        if _COUNTS_KEY in checkpoint:
            self._take(checkpoint[_COUNTS_KEY])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint's counts from before they moved to its top level (``step_token_scale``)."""
        if state_dict:
            self._take(state_dict)

    def _take(self, counts: dict[str, Any]) -> None:
        if self._mean.installed:
            self._mean.restore_counts(counts)
        else:
            self._restored = dict(counts)


_COUNTS_KEY = "step_token_mean_counts"


def short_batch_weight(batch_idx: int, *, samples: int, batch: int, micro: int) -> float:
    """The factor on the gradient of micro-batch ``batch_idx`` of an epoch of ``samples`` drawn in batches of ``batch``
    (your DataLoader's, the last one short) and split into micro-batches of ``micro`` (dividing ``batch``), for a loss
    that is the mean over the micro-batch's samples: Lightning divides each micro-batch's mean by the accumulation
    alike, which weighs the samples of the epoch's short last batch ``batch / short`` times less than plain Lightning's
    mean over that batch does (a new user's 50 samples in batches of 6 at 2 x 3: the last step's gradient a third of
    plain Lightning's, parameters 0.41 apart after 2 epochs). 1 for the micro-batches of whole batches."""
    start = batch_idx * micro
    if not 0 <= start < samples:  # (not a micro-batch of this epoch)
        return 1.0
    in_batch = min(batch, samples - start // batch * batch)  # the samples of the batch this micro-batch is a part of
    if in_batch >= batch:
        return 1.0
    return min(micro, samples - start) * (batch // micro) / in_batch


def is_heterogeneous(strategy: Any) -> bool:
    """Whether ``strategy`` is one of the heterogeneous strategies (which share each global batch by speed)."""
    return hasattr(strategy, "balancer")


def token_mean_taken_elsewhere(trainer: Trainer) -> bool:
    """Whether a ``SelectiveTokenLoss`` among the trainer's callbacks makes each step's token mean itself."""
    from lightning_efficient.tokens.callback import SelectiveTokenLoss

    return any(isinstance(c, SelectiveTokenLoss) for c in trainer.callbacks)


def _gradients_are_local_until_the_last_backward(trainer: Trainer) -> bool:
    """Whether each rank's gradients are its own until the step's last backward: a fit of one process (whatever
    process group another fit left), or Lightning's DDP (which does not synchronise the accumulating micro-batches'
    backwards). Not under the sharded strategies (FSDP2 reduces at every backward; Lightning's FSDP1, GPU only and
    untested here, keeps the global token mean too) nor where the strategy accumulates itself (DeepSpeed)."""
    strategy = trainer.strategy
    if strategy.handles_gradient_accumulation:
        return False
    return trainer.world_size == 1 or isinstance(getattr(strategy, "model", None), DistributedDataParallel)
