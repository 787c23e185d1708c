"""``SelectiveTokenLoss``: the step loss over a selected subset of tokens."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_efficient._instance_wrappers import InstanceWrapper, put_back
from lightning_efficient._step import step_batch_index
from lightning_efficient._validation import require, require_choice, require_int
from lightning_efficient.tokens.normalize import (
    StepTokenNormaliser,
    all_gather_variable,
    distributed_world_size,
    kept_loss_sum,
    optimizer_step_normalising,
)
from lightning_efficient.tokens.output import FusedTokenLoss, NormalisedTokenLoss, TokenLosses, deferred_reduction
from lightning_efficient.tokens.selection import (
    METHODS,
    SCORES,
    KeepRatioSchedule,
    RunningThreshold,
    Selection,
    select_tokens,
    summarise_selection,
)

_SCALAR_HELP = (
    "SelectiveTokenLoss needs per-token losses, but {who} returned {what}. Return "
    "lightning_efficient.TokenLosses(per_token_losses, mask) with losses of shape [batch, seq] "
    "(reduction='none'), lightning_efficient.FusedTokenLoss(hidden, head_weight, labels) for the fused "
    "path, or a float tensor [batch, seq] of per-token losses."
)


Method = Literal["eslm", "rho1", "topk", "random", "none"]
Score = Literal["loss", "entropy"]
Scope = Literal["batch", "global"]
Threshold = Literal["streaming", "exact"]

#: the rules whose threshold the streaming path estimates from the previous steps
_ESTIMATED = ("eslm", "rho1", "topk")

_WRAPPER_MARK = "_selective_token_loss_wrapper"


def _own_vocab_size(module: nn.Module) -> int | None:
    """The vocabulary ``module`` itself declares: its ``vocab_size`` attribute (HFCausalLM, Lightning's demo
    Transformer), its config's or, for a Hugging Face model, its output embedding's rows (None when unknown)."""
    own = getattr(module, "vocab_size", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    config = getattr(module, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    embeddings = getattr(module, "get_output_embeddings", None)
    head = embeddings() if callable(embeddings) else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def _vocab_size(module: nn.Module) -> int | None:
    """The vocabulary a module scores: its own (:func:`_own_vocab_size`), its ``vocab_size`` hyperparameter, or the one
    its submodules declare (a LightningModule wrapping a Hugging Face model or Lightning's demo Transformer as
    ``self.model``); None when unknown or when submodules declare several (an encoder of a source vocabulary beside
    the decoder: which one scores is not known here)."""
    own = _own_vocab_size(module)
    if own is not None:
        return own
    hparams = getattr(module, "hparams", None)
    if hparams is not None and isinstance(hparams.get("vocab_size"), int):
        return hparams["vocab_size"]
    found = {size for sub in module.modules() if sub is not module and (size := _own_vocab_size(sub)) is not None}
    return found.pop() if len(found) == 1 else None


_WRAPPED_HOOKS = ("training_step", "optimizer_step")


def _refuse_manual_optimization(module: LightningModule) -> None:
    """Refuse a module under manual optimization: the selection is made from what ``training_step`` returns, after
    the module's own ``manual_backward`` ran in it."""
    if not module.automatic_optimization:
        raise ValueError(
            "SelectiveTokenLoss is refused under manual optimization (automatic_optimization=False): it selects "
            "tokens from what training_step returns, after it has run, while under manual optimization your "
            "training_step has already called manual_backward on its own loss, so no selection would reach the "
            "gradients. Use automatic optimization, or select inside training_step yourself: "
            "lightning_efficient.tokens.select_tokens, then globally_normalised_loss(losses, selection.keep)."
        )


def _restore_hooks(module: LightningModule) -> None:
    """Take every SelectiveTokenLoss wrapper off ``module.training_step`` and ``optimizer_step`` (one
    left by a fit that raised included), keeping an instance-level method the user set below them."""
    for name in _WRAPPED_HOOKS:
        method = vars(module).get(name)
        if method is None or not getattr(method, _WRAPPER_MARK, False):
            continue
        while getattr(method, _WRAPPER_MARK, False):
            method = method.__wrapped__
        put_back(module, name, method)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _stack_ranks(local: Tensor) -> Tensor:
    """``[ranks, size]``: a fixed-size 1-D tensor from every rank (one all-gather)."""
    import torch.distributed as dist

    gathered = [torch.zeros_like(local) for _ in range(distributed_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered)


def _writes_logs(trainer: Trainer) -> bool:
    """Whether Lightning writes step metrics to its loggers at this step: every ``log_every_n_steps``-th
    optimizer step (every step under ``fast_dev_run``). The selection figures are computed and logged only then; on the other
    steps they would cost Lightning's ``log_dict`` (about 0.5 ms a figure on CPU) and a device sync each,
    for values no logger receives."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True)) or bool(trainer.fast_dev_run)


class SelectiveTokenLoss(Callback):
    """Turns a module's per-token losses into a step loss over a selected subset of tokens.

    The module's ``training_step`` returns :class:`TokenLosses`, :class:`FusedTokenLoss` or a float
    ``[batch, seq]`` tensor; this callback picks the tokens to keep (see
    :mod:`lightning_efficient.tokens.selection`) and returns as the step loss the sum of the kept
    losses over the *global* kept count (all-reduced under DDP, scaled so that DDP's gradient
    average is the global mean). With the fused path, the output head's backward runs only for
    the kept tokens. Logs ``selection/mean_loss`` (over all valid tokens), ``selection/kept_fraction``, ``selection/keep_ratio``,
    ``selection/threshold``, ``selection/kept_mean_score`` and ``selection/dropped_mean_score``; with
    ``threshold="streaming"`` also ``selection/streamed`` (1 when the step took the streaming path) and
    ``selection/threshold_correction`` (the running estimate's feedback correction of the keep ratio).
    They are computed and logged on the steps Lightning writes to its loggers (``Trainer(log_every_n_steps=...)``,
    50 by default), so ``trainer.callback_metrics`` holds the last such step's figures; the steps between
    pay for neither the logging nor the figures' device syncs. ``log_every_n_steps=1`` logs every step; a fit with
    a callback that monitors one of them (``ModelCheckpoint``/``EarlyStopping(monitor="selection/...")``) computes and
    logs them every step, so ``callback_metrics`` is current (the loggers still write every ``log_every_n_steps``).

    **Streaming threshold** (``threshold="streaming"``, the default): with the fused head
    (:class:`FusedTokenLoss`), the rule's threshold is taken before the forward pass from a running
    estimate (:class:`~lightning_efficient.tokens.selection.RunningThreshold`: the previous steps'
    score quantiles, every rank's under ``scope="global"``, corrected by the realised keep ratio), and
    the head keeps each chunk's tokens at or above it and computes their gradients while it holds
    their logits (:func:`~lightning_efficient.tokens.streaming.streaming_cross_entropy`): ``1 + 2k``
    head matmul passes at keep ratio ``k``, against ``1 + 3k`` for the exact threshold, which can only
    be known once every token's loss is (and 3 for the plain mean: at k = 0.7 the exact path costs
    more than not selecting). It is the default because selection exists to save step time and only
    this path does; the price is that a step keeps the target fraction up to sampling noise and the
    shift of its scores from the previous steps' (the mean over steps is held at the target; see
    ``RunningThreshold`` for the tolerance) instead of exactly. ``random`` draws its
    mask before the pass (the mask the exact path draws), a keep ratio of 1.0 keeps every valid token,
    and a step without an estimate yet (the first step that selects, after a warm-up for ``rho1``)
    takes the exact path. ``threshold="exact"``, and any output other than ``FusedTokenLoss``, use
    the batch's exact order statistic.

    The step's gradient is the mean over every kept token of all its micro-batches and ranks, as one
    big batch would give, whatever the gradient accumulation and the strategy (single device,
    ``ddp``, ``hetero_ddp``): each micro-batch contributes its kept-loss sum and the gradients are
    divided by the step's global kept count right after the step's last backward, before AMP
    unscaling, any ``on_before_optimizer_step`` hook, gradient clipping and the optimizer see them
    (the callback wraps the optimizer closure in the module's ``optimizer_step``; see
    :class:`~lightning_efficient.tokens.normalize.StepTokenNormaliser`). The ``"loss"`` Lightning
    hands on per micro-batch shows the micro-batch's mean over its kept tokens on the rank (divided by the accumulation,
    as Lightning divides any loss); only its gradient is weighed for the step.
    Manual optimization is refused: the selection, made after ``training_step``, would not reach its backward.
    Extra keys of the module's output (``TokenLosses(..., accuracy=acc)``) reach
    ``on_train_batch_end``'s ``outputs`` alongside ``"loss"``, ``"mask"`` and ``"keep"``.

    Args:
        method: ``"eslm"``, ``"rho1"``, ``"topk"``, ``"random"`` or ``"none"``.
        keep_ratio: fraction of valid tokens kept after warm-up and ramp, in (0, 1]
            (for ``eslm``, 1 - alpha).
        score: ``"loss"`` or ``"entropy"`` (``eslm`` only; entropy needs the fused path or an
            ``"entropy"`` entry in the TokenLosses output).
        scope: ``"batch"`` (each rank's own tokens) or ``"global"`` (one exact threshold from every
            rank's scores, at the cost of all-gathering them each step).
        warmup_steps: optimizer steps trained on the full loss first (>= 0).
        ramp_steps: steps over which the keep ratio goes linearly from ``start_keep_ratio`` to
            ``keep_ratio`` after warm-up (>= 0).
        start_keep_ratio: the ratio the ramp starts from, in (0, 1].
        reference: ``rho1``'s reference model: a Lightning checkpoint path of the same module class,
            or an ``nn.Module`` whose ``training_step`` returns per-token losses; run in eval mode
            under ``no_grad`` on the same batch and device. Its vocabulary must be the model's.
        reference_key: instead of a reference model, the batch key holding reference losses
            ``[batch, seq]``.
        seed: seed of ``random``: the draw of each rank, step and batch comes from a generator seeded
            by ``(seed, rank, step, batch index)``, so it is reproducible and resumes exactly on every
            rank without saving generator state.
        threshold: ``"streaming"`` (default: with the fused head, select while streaming the head at
            a threshold estimated from the previous steps; see above) or ``"exact"`` (each batch's exact
            order statistic, exact kept counts, the head's kept tokens recomputed in backward). The
            running estimate is saved in checkpoints and resumes exactly.

    Raises:
        ValueError: naming the argument for an unknown method or score, a ratio outside (0, 1], or
            ``rho1`` without a reference, an unknown threshold; at setup (before the first step), for a
            reference checkpoint of another class or a reference with another vocabulary.
    """

    def __init__(
        self,
        method: Method = "eslm",
        keep_ratio: float = 0.7,
        score: Score = "loss",
        scope: Scope = "batch",
        warmup_steps: int = 0,
        ramp_steps: int = 0,
        start_keep_ratio: float = 1.0,
        reference: str | nn.Module | None = None,
        reference_key: str | None = None,
        seed: int = 0,
        threshold: Threshold = "streaming",
    ) -> None:
        require_choice("method", method, METHODS)
        for name, ratio in (("keep_ratio", keep_ratio), ("start_keep_ratio", start_keep_ratio)):
            ratio_ok = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 < ratio <= 1.0
            require(ratio_ok, name, ratio, "a fraction in (0, 1]")
        require_choice("score", score, SCORES)
        require(score == "loss" or method == "eslm", "score", score, "'loss' unless method='eslm'")
        require_choice("scope", scope, ("batch", "global"))
        require_int("warmup_steps", warmup_steps, 0)
        require_int("ramp_steps", ramp_steps, 0)
        require_int("seed", seed, 0)
        require_choice("threshold", threshold, ("streaming", "exact"))
        if method == "rho1":
            require(reference is not None or reference_key is not None, "reference", reference,
                    "a checkpoint path or nn.Module (or set reference_key) for method='rho1'")
        else:  # only rho1 scores against a reference: one given to another method would be ignored
            require(reference is None, "reference", reference if not isinstance(reference, nn.Module) else f"<{type(reference).__name__}>",
                    f"None unless method='rho1' (method={method!r} scores without a reference)")
            require(reference_key is None, "reference_key", reference_key, f"None unless method='rho1' (method={method!r})")
        require(reference is None or isinstance(reference, (str, nn.Module)), "reference", reference,
                "None, a checkpoint path or an nn.Module with a training_step returning per-token losses")
        require(not isinstance(reference, nn.Module) or callable(getattr(reference, "training_step", None)), "reference",
                type(reference).__name__, "an nn.Module with a training_step returning per-token losses (such as a "
                "LightningModule of the model's kind)")
        if isinstance(reference, str):
            require(Path(reference).expanduser().exists(), "reference", reference, "an existing checkpoint path")
        self.method = method
        self.score = score
        self.scope = scope
        self.schedule = KeepRatioSchedule(keep_ratio, start_keep_ratio, warmup_steps, ramp_steps)
        self.reference = reference
        self.reference_key = reference_key
        self.seed = seed
        self.threshold = threshold
        self.running = RunningThreshold()
        self._observed_step: int | None = None
        self.generator = torch.Generator()  # seeded before each draw; made anew when unpickled (see __getstate__)
        self._rank = 0
        self._reference_module: nn.Module | None = None
        self._reference_as_it_was: tuple[list[bool], list[bool], dict[str, Any], torch.device] | None = None  # a user's reference
        self._wrapped: LightningModule | None = None
        self.normaliser = StepTokenNormaliser()
        self._log_every_step = False  # set in setup: a callback monitors a selection figure

    def __getstate__(self) -> dict[str, Any]:
        # a torch.Generator's state went to ddp_spawn's processes through torch's shared memory, which failed in a
        # new user's trial; it is seeded before every draw, so a fresh one there draws the same
        state = dict(self.__dict__)
        state["generator"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.generator = torch.Generator()

    # -- wiring ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_manual_optimization(pl_module)
        mesh = getattr(trainer.strategy, "device_mesh", None)  # ModelParallelStrategy's (data, tensor) mesh
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"SelectiveTokenLoss is refused with tensor_parallel_size={mesh['tensor_parallel'].size()}: the "
                "ranks of a tensor-parallel group share one batch, but the token selection treats every rank as a "
                "data-parallel rank with a batch of its own: method='random' draws its mask from a generator seeded "
                "by the global rank, so tensor-parallel peers would keep different tokens of the same batch (their "
                "shards of one computation would disagree), and scope='global' gathers each batch's scores once per "
                "tensor-parallel rank. (The normalisation itself is not the problem: the global count and the "
                "world size both include the tensor-parallel factor, which cancels.) Use tensor_parallel_size=1 "
                "(FSDP2 over data_parallel_size ranks)."
            )
        self._rank = trainer.global_rank
        # a callback that monitors a selection figure (ModelCheckpoint, EarlyStopping) reads callback_metrics whenever it
        # checks, not on the logging steps only: then every step logs them
        self._log_every_step = any(str(getattr(c, "monitor", None) or "").startswith("selection/") for c in trainer.callbacks)
        self.normaliser.reset()
        self.running.reset()
        if self.method == "rho1" and self.reference is not None:
            self._reference_module = self._load_reference(pl_module)
        _restore_hooks(pl_module)  # wrappers left by an earlier fit that raised
        original = pl_module.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> NormalisedTokenLoss | None:
            if trainer.state.stage not in (None, RunningStage.TRAINING):  # a validation_step calling training_step
                return original(*args, **kwargs)
            with deferred_reduction():
                output = original(*args, **kwargs)
            if output is None:  # a batch skipped on purpose, which Lightning passes over (a new user's trial: refused)
                return None
            return self._step_loss(trainer, pl_module, output, args, kwargs)

        original_optimizer_step = pl_module.optimizer_step

        def normalise(optimizer: Any) -> None:
            self.normaliser.normalise_gradients(optimizer)
            self._end_step()  # the next step's threshold, before any checkpoint of this step

        optimizer_step = optimizer_step_normalising(original_optimizer_step, normalise)

        # (a copy of the module made while the fit runs, e.g. an EMA callback's, gets its own methods, unwrapped)
        pl_module.training_step = InstanceWrapper(training_step, original)
        pl_module.optimizer_step = InstanceWrapper(optimizer_step, original_optimizer_step)
        for name in _WRAPPED_HOOKS:
            setattr(getattr(pl_module, name), _WRAPPER_MARK, True)
        self._wrapped = pl_module

    def _load_reference(self, pl_module: LightningModule) -> nn.Module:
        cls = type(pl_module)
        if isinstance(self.reference, str):
            self._check_reference_checkpoint(pl_module)
            try:
                reference = cls.load_from_checkpoint(self.reference, map_location="cpu")
            except (RuntimeError, TypeError, KeyError, ValueError, AttributeError) as error:
                raise ValueError(
                    f"reference={self.reference!r} is not allowed: it does not load as a {cls.__name__} "
                    f"checkpoint ({type(error).__name__}: {str(error).splitlines()[0][:300]}); expected a "
                    f"Lightning checkpoint of the model's class {cls.__name__}, or pass the reference as an "
                    "nn.Module whose training_step returns per-token losses."
                ) from error
            shown = self.reference
        else:
            reference = self.reference
            shown = f"<{type(reference).__name__}>"
        ours, theirs = _vocab_size(pl_module), _vocab_size(reference)
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(
                f"reference={shown!r} is not allowed: its vocab_size={theirs} differs from the model's "
                f"vocab_size={ours} (a {type(reference).__name__} reference for a {cls.__name__} model); expected a "
                "reference with the model's vocabulary, scoring the same tokens."
            )
        if not isinstance(self.reference, str):  # the user's own module: put back as it was when the fit ends or raises
            device = next(iter(reference.parameters()), torch.empty(0)).device  # on_fit_start moves it to the model's
            self._reference_as_it_was = ([m.training for m in reference.modules()], [p.requires_grad for p in reference.parameters()],
                                         {k: vars(reference)[k] for k in ("log", "log_dict") if k in vars(reference)}, device)
        reference.eval().requires_grad_(False)
        reference.log = _noop  # the reference is not attached to the Trainer: its logging is dropped
        reference.log_dict = _noop
        return reference

    def _restore_reference(self) -> None:
        """The user's reference module back on its device, in its mode, with its parameters' ``requires_grad`` and its own
        ``log``; a reference this callback loaded from a checkpoint dropped (``setup`` loads it again)."""
        reference, saved, self._reference_as_it_was = self._reference_module, self._reference_as_it_was, None
        self._reference_module = None
        if reference is None or saved is None:
            return
        training, requires_grad, logging, device = saved
        reference.to(device)
        for module, flag in zip(reference.modules(), training):  # each submodule's own mode (a frozen part in eval)
            module.training = flag
        for param, flag in zip(reference.parameters(), requires_grad):
            param.requires_grad_(flag)
        for name in ("log", "log_dict"):
            vars(reference).pop(name, None)
        vars(reference).update(logging)

    def _check_reference_checkpoint(self, pl_module: LightningModule) -> None:
        """Refuse a checkpoint whose weights are not the model class's, before building anything from
        it (``load_from_checkpoint`` drops hyperparameters the class does not take, so another
        class's checkpoint would build a default-sized model first)."""
        checkpoint = torch.load(self.reference, map_location="cpu", mmap=True, weights_only=False)
        theirs = set(checkpoint.get("state_dict", {}) if isinstance(checkpoint, dict) else {})
        ours = set(pl_module.state_dict())
        if ours and ours != theirs:  # (a model built in configure_model has no weights yet: no check)
            cls = type(pl_module).__name__
            missing, unexpected = sorted(ours - theirs), sorted(theirs - ours)
            raise ValueError(
                f"reference={self.reference!r} is not allowed: it is not a checkpoint of the model's class {cls} "
                f"({len(missing)} of its {len(ours)} weights missing, e.g. {missing[:3]}; {len(unexpected)} "
                f"unexpected, e.g. {unexpected[:3]}); expected a Lightning checkpoint of {cls}, or pass the "
                "reference as an nn.Module whose training_step returns per-token losses."
            )
        del checkpoint

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # again: the module's own setup and configure_model run after this callback's setup, and may turn it off
        _refuse_manual_optimization(pl_module)
        if self._reference_module is not None:
            self._reference_module.to(pl_module.device)
        if self.method == "none":  # its keep_ratio and schedule are never applied
            rank_zero_info("SelectiveTokenLoss: method=none, every valid token kept (the step loss is their mean over its micro-batches and ranks)")
        else:
            rank_zero_info(
                f"SelectiveTokenLoss: method={self.method}, score={self.score}, scope={self.scope}, "
                f"keep_ratio={self.schedule.end_ratio} after {self.schedule.warmup_steps} full-loss steps "
                f"and a {self.schedule.ramp_steps}-step ramp from {self.schedule.start_ratio}"
            )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning skips teardown when fit raises: the module must not keep the wrapper
        self._unwrap()

    def _unwrap(self) -> None:
        if self._wrapped is not None:
            _restore_hooks(self._wrapped)
        self._wrapped = None
        self._restore_reference()
        self.normaliser.reset()
        self.running.discard_step()
        self._observed_step = None

    # -- the step loss -----------------------------------------------------------------------
    def _per_token(self, output: Any, want_entropy: bool, who: str = "training_step") -> tuple[Tensor, Tensor, Tensor | None]:
        if isinstance(output, FusedTokenLoss):
            if want_entropy:
                losses, entropy = output.token_losses(return_entropy=True)
                return losses, output.mask, entropy
            return output.token_losses(), output.mask, None
        if isinstance(output, TokenLosses):
            return output.token_losses, output.mask, output.get("entropy")
        if isinstance(output, Tensor) and output.is_floating_point() and output.dim() >= 1:
            return output, torch.ones_like(output, dtype=torch.bool), None
        what = f"a scalar tensor {tuple(output.shape)}" if isinstance(output, Tensor) else type(output).__name__
        raise TypeError(_SCALAR_HELP.format(who=who, what=what))

    def _reference_losses(self, batch: Any, args: tuple, kwargs: dict) -> Tensor:
        if self.reference_key is not None:
            return batch[self.reference_key]
        assert self._reference_module is not None
        with torch.no_grad(), deferred_reduction():
            output = self._reference_module.training_step(*args, **kwargs)
        # named as the reference's: a new user's reference returned its .loss, and the message sent them to their module
        who = f"the reference's training_step ({type(self._reference_module).__name__})"
        return self._per_token(output, want_entropy=False, who=who)[0]

    def _step_loss(
        self, trainer: Trainer, pl_module: LightningModule, output: Any, args: tuple, kwargs: dict
    ) -> NormalisedTokenLoss:
        step = trainer.global_step
        batch_idx = step_batch_index(trainer, args, kwargs)
        if self._observed_step is not None and self._observed_step != step:
            self._end_step()  # a safeguard: a step whose optimizer closure did not fold its scores
        elif int(batch_idx) % trainer.accumulate_grad_batches == 0:
            # a step's first micro-batch: forget scores observed by a call outside the loop (a profile)
            self.running.discard_step()
            self._observed_step = None
        keep_ratio = self.schedule(step)
        batch = args[0] if args else kwargs.get("batch")
        self.generator.manual_seed(self.draw_seed(step, int(batch_idx)))
        streaming = self.threshold == "streaming" and isinstance(output, FusedTokenLoss)
        # this step's scores feed the running estimate when this step or the next one selects by threshold
        observe = streaming and self.method in _ESTIMATED and (keep_ratio < 1 or self.schedule(step + 1) < 1)
        streamed = self._streamed(output, keep_ratio, batch, args, kwargs, observe) if streaming else None
        if streamed is not None:
            losses, valid, selection, kept_sum, scores, estimated = streamed
            non_finite = self._check_finite(trainer, pl_module, losses, valid)
        else:
            losses, valid, entropy = self._per_token(output, want_entropy=self.score == "entropy")
            non_finite = self._check_finite(trainer, pl_module, losses, valid)
            reference = self._reference_losses(batch, args, kwargs) if self.method == "rho1" and keep_ratio < 1 else None
            selection = select_tokens(
                self.method, losses, valid, keep_ratio, entropy=entropy, reference_losses=reference, score=self.score,
                generator=self.generator,
                gather=all_gather_variable if self.scope == "global" and distributed_world_size() > 1 else None,
            )
            kept_sum = kept_loss_sum(losses, selection.keep)
            if observe:
                scores = entropy if self.score == "entropy" else losses if reference is None else losses - reference
            estimated = False
        if observe:
            self.running.observe(scores.detach(), valid, selection.keep if estimated else None,
                                 keep_ratio if estimated else None)
            self._observed_step = step
        loss = self._loss(trainer, kept_sum, selection.keep, int(batch_idx), non_finite)
        if self._log_every_step or _writes_logs(trainer):
            pl_module.log_dict(self._stats(losses, valid, keep_ratio, selection, streamed is not None),
                               on_step=True, on_epoch=False, batch_size=int(valid.shape[0]))
        extra = output.extra() if isinstance(output, (TokenLosses, FusedTokenLoss)) else {}
        return NormalisedTokenLoss(extra, loss=loss, mask=valid.detach(), keep=selection.keep)

    def _stats(self, losses: Tensor, valid: Tensor, keep_ratio: float, selection: Selection, streamed: bool) -> dict[str, float]:
        """The ``selection/`` figures of one micro-batch (see the class docstring)."""
        valid_count = valid.sum().clamp_min(1)
        stats = {
            "selection/mean_loss": float(kept_loss_sum(losses.detach(), valid) / valid_count),
            "selection/keep_ratio": keep_ratio,
            "selection/kept_fraction": selection.kept_fraction,
            "selection/threshold": math.nan if selection.threshold is None else selection.threshold,
            "selection/kept_mean_score": selection.kept_mean_score,
            "selection/dropped_mean_score": selection.dropped_mean_score,
        }
        if self.threshold == "streaming":
            stats["selection/streamed"] = float(streamed)
            stats["selection/threshold_correction"] = self.running.correction
        return stats

    def _check_finite(self, trainer: Trainer, pl_module: LightningModule, losses: Tensor, valid: Tensor) -> Tensor:
        """This micro-batch's count of non-finite valid losses; raises here unless it is deferred."""
        non_finite = (valid & ~torch.isfinite(losses)).sum()
        # under data parallelism the count travels with the step's token count and every rank raises
        # together after the backward; one rank raising alone would leave the others waiting in a collective
        deferred = distributed_world_size() > 1
        if not deferred and int(non_finite):
            raise FloatingPointError(
                f"{int(non_finite)} of {int(valid.sum())} per-token losses are not finite at step "
                f"{trainer.global_step}; SelectiveTokenLoss does not drop them silently."
            )
        return non_finite

    def _streamed(
        self, output: FusedTokenLoss, keep_ratio: float, batch: Any, args: tuple, kwargs: dict, observe: bool
    ) -> tuple[Tensor, Tensor, Selection, Tensor, Tensor | None, bool] | None:
        """The streaming path: ``(losses, valid, selection, kept sum, scores, estimated)``, or None when
        the threshold is not known before the pass (no estimate yet: the caller takes the exact path)."""
        valid = output.mask
        score = "entropy" if self.score == "entropy" else "excess" if self.method == "rho1" else "loss"
        threshold: float | None = None
        keep: Tensor | None = None
        given: Selection | None = None
        if self.method == "none" or keep_ratio == 1.0:
            keep = valid  # every valid token, no threshold
        elif self.method == "random":  # the exact path's draw, made before the pass
            given = select_tokens(
                "random", torch.zeros(valid.shape, device=valid.device), valid, keep_ratio, generator=self.generator,
                gather=all_gather_variable if self.scope == "global" and distributed_world_size() > 1 else None,
            )
            keep = given.keep
        else:
            threshold = self.running.threshold(keep_ratio)
            if threshold is None:
                return None
        reference = self._reference_losses(batch, args, kwargs) if score == "excess" and (observe or keep is None) else None
        if reference is None and score == "excess":
            score = "loss"  # keep-all without an estimate to feed: the reference is not run
        out = output.streamed_losses(threshold=threshold, keep=keep, score=score, reference_losses=reference,
                                     return_scores=observe)
        selection = given if given is not None else summarise_selection(
            out.scores if out.scores is not None else out.losses, valid, out.keep, threshold
        )
        return out.losses, valid, selection, out.kept_sum, out.scores, threshold is not None

    def _end_step(self) -> None:
        """Fold the step's scores into the running threshold (every rank together, under DDP)."""
        if self._observed_step is None:
            return
        self._observed_step = None
        gather = _stack_ranks if distributed_world_size() > 1 else None
        self.running.end_step(gather, self.scope)

    def _loss(self, trainer: Trainer, kept_sum: Tensor, keep: Tensor, batch_idx: int, non_finite: Tensor) -> Tensor:
        """The micro-batch's loss from its kept-loss sum, weighted for the step (manual optimization is refused)."""
        return self.normaliser.micro_batch_loss(kept_sum, keep.sum(), trainer.accumulate_grad_batches, non_finite,
                                                batch_idx=batch_idx)

    def draw_seed(self, step: int, batch_idx: int) -> int:
        """The seed of ``random``'s draw on this rank at ``step`` for batch ``batch_idx``."""
        return hash((self.seed, self._rank, step, batch_idx)) & 0x7FFF_FFFF_FFFF

    # -- checkpoints -------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # the schedule position is the trainer's global_step (restored by Lightning) and the random
        # draws are seeded by (seed, rank, step, batch): the settings are kept to check a resume against
        # the step normaliser's K (the last step's global kept count), so that a resumed run scales its
        # first step as the uninterrupted run does, to the last bit
        # the running threshold (every rank's under scope="batch") lets a resumed run stream its first
        # step at the threshold the uninterrupted run would have used
        return {"schedule": vars(self.schedule).copy(), "method": self.method, "seed": self.seed,
                "step_token_scale": self.normaliser.scale, "threshold": self.threshold,
                "running_threshold": self.running.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.normaliser.scale = state_dict.get("step_token_scale")
        if "running_threshold" in state_dict:
            self.running.load_state_dict(state_dict["running_threshold"], rank=self._rank)
        if state_dict.get("method", self.method) != self.method:
            rank_zero_info(
                f"SelectiveTokenLoss: the checkpoint was trained with method={state_dict['method']!r}; "
                f"continuing with method={self.method!r}"
            )
