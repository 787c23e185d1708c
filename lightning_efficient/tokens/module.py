"""Training and validation steps shared by LightningModules that define ``token_losses(batch)``."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_efficient.tokens.output import FusedTokenLoss, TokenLosses, masked_mean


class TokenLossSteps:
    """Mixin for a LightningModule with ``token_losses(batch)`` (returning :class:`TokenLosses` or
    :class:`FusedTokenLoss`) and ``torchmetrics.MeanMetric`` attributes ``val_loss`` and ``test_loss``:
    the training step returns the per-token output (its ``"loss"`` the plain mean without plugins);
    validation and test log the token-weighted ``val_loss``/``val_ppl`` and ``test_loss``/``test_ppl``
    over all ranks, and validation prints them once."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> TokenLosses | FusedTokenLoss:
        """Return per-token losses (or the fused head output); without plugins, their mean is the loss."""
        out = self.token_losses(batch)
        if "loss" in out:
            self.log("train_loss", out["loss"].detach(), prog_bar=True)
        return out

    def _update_loss(self, metric: MeanMetric, batch: dict[str, Tensor]) -> None:
        """Add ``batch``'s mean loss over valid tokens to ``metric``, weighted by its valid tokens."""
        out = self.token_losses(batch)
        if "loss" in out:  # the mean over valid tokens, computed once (no gradient work outside training)
            mean = out["loss"]
        else:
            mean = masked_mean(out.token_losses() if isinstance(out, FusedTokenLoss) else out.token_losses, out.mask)
        metric.update(mean, weight=out.mask.sum())

    def _log_loss(self, name: str, metric: MeanMetric) -> float:
        # compute() already reduces over ranks; sync_dist=True adds one small all-reduce of that same value
        # per validation, which tells Lightning the logged value is rank-wide (no warning under DDP)
        loss = metric.compute()
        metric.reset()
        self.log(f"{name}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{name}_ppl", torch.exp(loss.clamp(max=50.0)), sync_dist=True)
        return loss.item()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Accumulate the token-weighted validation loss."""
        self._update_loss(self.val_loss, batch)

    def on_validation_epoch_end(self) -> None:
        """Log ``val_loss`` and ``val_ppl`` (over all ranks) and print them once per validation."""
        loss = self._log_loss("val", self.val_loss)
        if not self.trainer.sanity_checking:
            rank_zero_info(
                f"validation at step {self.trainer.global_step}: loss {loss:.4f}, "
                f"perplexity {math.exp(min(loss, 50.0)):.2f}"
            )

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Accumulate the token-weighted test loss (in a ``MeanMetric`` named ``test_loss``)."""
        self._update_loss(self.test_loss, batch)

    def on_test_epoch_end(self) -> None:
        """Log ``test_loss`` and ``test_ppl`` (over all ranks)."""
        self._log_loss("test", self.test_loss)
