"""``SelectiveTokenLoss``: the step loss over a selected subset of tokens."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_efficient._validation import require, require_choice, require_int
from lightning_efficient.tokens.normalize import (
    all_gather_variable,
    distributed_world_size,
    global_kept_count,
    globally_normalised_loss,
)
from lightning_efficient.tokens.output import FusedTokenLoss, TokenLosses, deferred_reduction
from lightning_efficient.tokens.selection import METHODS, SCORES, KeepRatioSchedule, select_tokens

_SCALAR_HELP = (
    "SelectiveTokenLoss needs per-token losses, but training_step returned {what}. Return "
    "lightning_efficient.TokenLosses(per_token_losses, mask) with losses of shape [batch, seq] "
    "(reduction='none'), lightning_efficient.FusedTokenLoss(hidden, head_weight, labels) for the fused "
    "path, or a float tensor [batch, seq] of per-token losses."
)


def _vocab_size(module: nn.Module) -> int | None:
    hparams = getattr(module, "hparams", None)
    if hparams is not None and isinstance(hparams.get("vocab_size"), int):
        return hparams["vocab_size"]
    config = getattr(module, "config", None)
    return getattr(config, "vocab_size", None)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class SelectiveTokenLoss(Callback):
    """Turns a module's per-token losses into a step loss over a selected subset of tokens.

    The module's ``training_step`` returns :class:`TokenLosses`, :class:`FusedTokenLoss` or a float
    ``[batch, seq]`` tensor; this callback picks the tokens to keep (see
    :mod:`lightning_efficient.tokens.selection`) and returns as the step loss the sum of the kept
    losses over the *global* kept count (all-reduced under DDP, scaled so that DDP's gradient
    average is the global mean). With the fused path, the output head's backward runs only for
    the kept tokens. Logs ``selection/mean_loss`` (over all valid tokens), ``selection/kept_fraction``, ``selection/keep_ratio``,
    ``selection/threshold``, ``selection/kept_mean_score`` and ``selection/dropped_mean_score``.

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
            under ``no_grad`` on the same batch and device.
        reference_key: instead of a reference model, the batch key holding reference losses
            ``[batch, seq]``.
        seed: seed of ``random``: the draw of each rank, step and batch comes from a generator seeded
            by ``(seed, rank, step, batch index)``, so it is reproducible and resumes exactly on every
            rank without saving generator state.

    Raises:
        ValueError: naming the argument for an unknown method or score, a ratio outside (0, 1], or
            ``rho1`` without a reference.
    """

    def __init__(
        self,
        method: str = "eslm",
        keep_ratio: float = 0.7,
        score: str = "loss",
        scope: str = "batch",
        warmup_steps: int = 0,
        ramp_steps: int = 0,
        start_keep_ratio: float = 1.0,
        reference: str | nn.Module | None = None,
        reference_key: str | None = None,
        seed: int = 0,
    ) -> None:
        require_choice("method", method, METHODS)
        require(isinstance(keep_ratio, (int, float)) and 0.0 < keep_ratio <= 1.0, "keep_ratio", keep_ratio, "a fraction in (0, 1]")
        require(0.0 < start_keep_ratio <= 1.0, "start_keep_ratio", start_keep_ratio, "a fraction in (0, 1]")
        require_choice("score", score, SCORES)
        require(score == "loss" or method == "eslm", "score", score, "'loss' unless method='eslm'")
        require_choice("scope", scope, ("batch", "global"))
        require_int("warmup_steps", warmup_steps, 0)
        require_int("ramp_steps", ramp_steps, 0)
        require_int("seed", seed, 0)
        if method == "rho1":
            require(reference is not None or reference_key is not None, "reference", reference,
                    "a checkpoint path or nn.Module (or set reference_key) for method='rho1'")
        if isinstance(reference, str):
            require(Path(reference).expanduser().exists(), "reference", reference, "an existing checkpoint path")
        self.method = method
        self.score = score
        self.scope = scope
        self.schedule = KeepRatioSchedule(keep_ratio, start_keep_ratio, warmup_steps, ramp_steps)
        self.reference = reference
        self.reference_key = reference_key
        self.seed = seed
        self.generator = torch.Generator()
        self._rank = 0
        self._reference_module: nn.Module | None = None
        self._wrapped: LightningModule | None = None

    # -- wiring ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._rank = trainer.global_rank
        if self.method == "rho1" and self.reference is not None:
            self._reference_module = self._load_reference(pl_module)
        original = pl_module.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> dict[str, Tensor]:
            with deferred_reduction():
                output = original(*args, **kwargs)
            return self._step_loss(trainer, pl_module, output, args, kwargs)

        pl_module.training_step = training_step
        self._wrapped = pl_module

    def _load_reference(self, pl_module: LightningModule) -> nn.Module:
        if isinstance(self.reference, str):
            reference = type(pl_module).load_from_checkpoint(self.reference, map_location="cpu")
        else:
            reference = self.reference
        ours, theirs = _vocab_size(pl_module), _vocab_size(reference)
        if ours is not None and theirs is not None and ours != theirs:
            shown = self.reference if isinstance(self.reference, str) else f"<{type(reference).__name__}>"
            raise ValueError(
                f"reference={shown!r} is not allowed: its vocab_size={theirs} differs from the "
                f"model's vocab_size={ours}; the reference must score the same tokens."
            )
        reference.eval().requires_grad_(False)
        reference.log = _noop  # the reference is not attached to the Trainer: its logging is dropped
        reference.log_dict = _noop
        return reference

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._reference_module is not None:
            self._reference_module.to(pl_module.device)
        rank_zero_info(
            f"SelectiveTokenLoss: method={self.method}, score={self.score}, scope={self.scope}, "
            f"keep_ratio={self.schedule.end_ratio} after {self.schedule.warmup_steps} full-loss steps "
            f"and a {self.schedule.ramp_steps}-step ramp from {self.schedule.start_ratio}"
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._wrapped is not None and "training_step" in vars(self._wrapped):
            del self._wrapped.training_step
        self._wrapped = None

    # -- the step loss -----------------------------------------------------------------------
    def _per_token(self, output: Any, want_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
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
        raise TypeError(_SCALAR_HELP.format(what=what))

    def _reference_losses(self, batch: Any, args: tuple, kwargs: dict) -> Tensor:
        if self.reference_key is not None:
            return batch[self.reference_key]
        assert self._reference_module is not None
        with torch.no_grad(), deferred_reduction():
            output = self._reference_module.training_step(*args, **kwargs)
        return self._per_token(output, want_entropy=False)[0]

    def _step_loss(
        self, trainer: Trainer, pl_module: LightningModule, output: Any, args: tuple, kwargs: dict
    ) -> dict[str, Any]:
        losses, valid, entropy = self._per_token(output, want_entropy=self.score == "entropy")
        non_finite = int((valid & ~torch.isfinite(losses)).sum())
        if non_finite:
            raise FloatingPointError(
                f"{non_finite} of {int(valid.sum())} per-token losses are not finite at step "
                f"{trainer.global_step}; SelectiveTokenLoss does not drop them silently."
            )
        keep_ratio = self.schedule(trainer.global_step)
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.generator.manual_seed(self.draw_seed(trainer.global_step, int(batch_idx)))
        reference = self._reference_losses(batch, args, kwargs) if self.method == "rho1" and keep_ratio < 1 else None
        selection = select_tokens(
            self.method, losses, valid, keep_ratio, entropy=entropy, reference_losses=reference, score=self.score,
            generator=self.generator,
            gather=all_gather_variable if self.scope == "global" and distributed_world_size() > 1 else None,
        )
        global_count = global_kept_count(selection.keep, losses.dtype)
        loss = globally_normalised_loss(losses, selection.keep, global_count)
        valid_count = valid.sum().clamp_min(1)
        stats = {
            "selection/mean_loss": float(torch.where(valid, losses.detach(), 0.0).sum() / valid_count),
            "selection/keep_ratio": keep_ratio,
            "selection/kept_fraction": selection.kept_fraction,
            "selection/threshold": math.nan if selection.threshold is None else selection.threshold,
            "selection/kept_mean_score": selection.kept_mean_score,
            "selection/dropped_mean_score": selection.dropped_mean_score,
        }
        pl_module.log_dict(stats, on_step=True, on_epoch=False, batch_size=int(valid.shape[0]))
        return {
            "loss": loss, "mask": valid.detach(), "keep": selection.keep,
            "normalised": "global_tokens", "global_count": global_count.detach(),
        }

    def draw_seed(self, step: int, batch_idx: int) -> int:
        """The seed of ``random``'s draw on this rank at ``step`` for batch ``batch_idx``."""
        return hash((self.seed, self._rank, step, batch_idx)) & 0x7FFF_FFFF_FFFF

    # -- checkpoints -------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # the schedule position is the trainer's global_step (restored by Lightning) and the random
        # draws are seeded by (seed, rank, step, batch): the settings are kept to check a resume against
        return {"schedule": vars(self.schedule).copy(), "method": self.method, "seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("method", self.method) != self.method:
            rank_zero_info(
                f"SelectiveTokenLoss: the checkpoint was trained with method={state_dict['method']!r}; "
                f"continuing with method={self.method!r}"
            )
