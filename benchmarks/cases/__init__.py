"""Importing this package registers every benchmark case."""

from benchmarks.cases import demo  # noqa: F401
