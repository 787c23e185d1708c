"""Importing this package registers every benchmark case."""

from benchmarks.cases import activations, balance, demo, optim, scale, tokens, tokens_head, tokens_quality, tokens_step  # noqa: F401
