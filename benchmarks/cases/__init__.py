"""Importing this package registers every benchmark case."""

from benchmarks.cases import (  # noqa: F401
    activations,
    autofit,
    balance,
    demo,
    finetune,
    optim,
    scale,
    token_mean,
    tokens,
    tokens_head,
    tokens_quality,
    tokens_step,
)
