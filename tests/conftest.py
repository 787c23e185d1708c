"""Shared fixtures: a small on-disk text corpus and a tiny demo configuration."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_bitsandbytes_override_left_behind():
    """bitsandbytes keys 32-bit overrides by ``id(param)`` process-wide: one left by a test would
    silently change a later test's optimizer whose parameter reuses the id."""
    yield
    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        manager = bnb.optim.GlobalOptimManager.get_instance()
        assert not manager.pid2config and not manager.index2config, "a bitsandbytes override was left behind"


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A directory of 40 standard-library modules (about 1 MB of text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p for p in root.glob("*.py"))[:40]
    target = tmp_path_factory.mktemp("corpus")
    for path in names:
        (target / path.name).write_text(path.read_text(encoding="utf-8", errors="replace"))
    return target


@pytest.fixture(scope="session")
def small_datamodule_kwargs(small_corpus, tmp_path_factory) -> dict:
    """Arguments for a CorpusDataModule over ``small_corpus`` with its own cache."""
    cache = tmp_path_factory.mktemp("cache")
    return {"data_path": str(small_corpus), "vocab_size": 512, "seq_len": 32, "batch_size": 4, "cache_dir": str(cache)}


def tiny_gpt_kwargs() -> dict:
    """A demo GPT small enough for a few CPU steps in a test."""
    return {"vocab_size": 512, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32}


@pytest.fixture
def lightning_caplog(caplog):
    """``caplog`` that also sees Lightning's ``rank_zero_info`` lines: Lightning stops its loggers from
    propagating to the root logger when the root had no handler at import time, so whether plain
    ``caplog`` sees them depends on which test imported Lightning first."""
    import logging

    # only where a record would stop before the root logger (else caplog would see it twice)
    loggers = [logger for logger in map(logging.getLogger, ("lightning.fabric", "lightning.pytorch")) if not logger.propagate]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(caplog.handler)
        logger.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(caplog.handler)
            logger.setLevel(level)
