"""Training and validation steps shared by LightningModules that define ``token_losses(batch)``."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_efficient.tokens.output import FusedTokenLoss, TokenLosses, masked_mean


class TokenLossSteps:
    """Mixin for a LightningModule with ``token_losses(batch)`` (returning :class:`TokenLosses` or
    :class:`FusedTokenLoss`) and a ``torchmetrics.MeanMetric`` named ``val_loss``: the training step
    returns the per-token output (its ``"loss"`` the plain mean without plugins); validation logs
    the token-weighted ``val_loss`` and ``val_ppl`` and prints them once per validation."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> TokenLosses | FusedTokenLoss:
        """Return per-token losses (or the fused head output); without plugins, their mean is the loss."""
        out = self.token_losses(batch)
        if "loss" in out:
            self.log("train_loss", out["loss"].detach(), prog_bar=True)
        return out

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Accumulate the token-weighted validation loss."""
        out = self.token_losses(batch)
        if "loss" in out:  # the mean over valid tokens, computed once (no gradient work in validation)
            mean = out["loss"]
        else:
            mean = masked_mean(out.token_losses() if isinstance(out, FusedTokenLoss) else out.token_losses, out.mask)
        self.val_loss.update(mean, weight=out.mask.sum())

    def on_validation_epoch_end(self) -> None:
        """Log ``val_loss`` and ``val_ppl`` and print them once per validation."""
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", torch.exp(loss.clamp(max=50.0)))
        if not self.trainer.sanity_checking:
            rank_zero_info(
                f"validation at step {self.trainer.global_step}: loss {loss.item():.4f}, "
                f"perplexity {math.exp(min(loss.item(), 50.0)):.2f}"
            )
