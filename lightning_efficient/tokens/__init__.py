"""Selective token loss: per-token loss outputs, selection rules, chunked linear CE, the callback."""

from lightning_efficient.tokens.callback import SelectiveTokenLoss
from lightning_efficient.tokens.linear_ce import linear_cross_entropy, set_compile
from lightning_efficient.tokens.normalize import StepTokenNormaliser, globally_normalised_loss
from lightning_efficient.tokens.output import (
    FusedTokenLoss,
    NormalisedTokenLoss,
    TokenLosses,
    deferred_reduction,
    masked_mean,
)
from lightning_efficient.tokens.selection import KeepRatioSchedule, RunningThreshold, Selection, select_tokens
from lightning_efficient.tokens.streaming import StreamedLoss, streaming_cross_entropy

__all__ = [
    "FusedTokenLoss",
    "KeepRatioSchedule",
    "NormalisedTokenLoss",
    "RunningThreshold",
    "Selection",
    "SelectiveTokenLoss",
    "StepTokenNormaliser",
    "StreamedLoss",
    "TokenLosses",
    "deferred_reduction",
    "globally_normalised_loss",
    "linear_cross_entropy",
    "masked_mean",
    "select_tokens",
    "set_compile",
    "streaming_cross_entropy",
]
