"""Importing this package registers every benchmark case."""

from benchmarks.cases import activations, autofit, balance, demo, optim, scale, tokens, tokens_head, tokens_quality  # noqa: F401
