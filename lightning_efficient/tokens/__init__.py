"""Selective token loss: per-token loss outputs, selection rules and the callback."""

from lightning_efficient.tokens.output import TokenLosses, deferred_reduction, masked_mean

__all__ = ["TokenLosses", "deferred_reduction", "masked_mean"]
