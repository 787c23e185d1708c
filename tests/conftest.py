"""Shared fixtures: a small on-disk text corpus and a tiny demo configuration; the ``serial`` marks."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

# Tests that must not share the CPU with another test: their assertions rest on measured wall-clock
# speed (shares from speeds, plans from timings, sleeps that slow a rank), or they launch 2-process DDP
# (two gloo ranks on the 2 cores). ``make test`` runs everything else on 2 pytest-xdist workers first,
# then these alone (``-m serial``). A file alone marks all its tests; ``file::name`` one test (all its
# parameters). A listed test that no longer exists is an error, so a rename cannot drop its mark.
SERIAL = (
    "activations/test_profile_timing.py",
    "activations/test_callback.py::test_two_process_ddp_with_checkpoint_matches_one_process",
    "activations/test_callback.py::test_auto_under_hetero_ddp_plans_each_rank_for_its_own_micro_batch",
    "activations/test_callback.py::test_auto_budget_infeasible_on_one_rank_fails_on_every_rank_with_the_numbers",
    "autofit/test_callback.py",
    "autofit/test_distributed.py",
    "autofit/test_short_batch.py::test_on_two_processes_under_ddp_and_fsdp2_the_short_batch_trains_as_in_plain_lightning",
    "autofit/test_unfreeze.py",
    "balance/test_fsdp.py",
    "balance/test_identical_ranks.py",
    "balance/test_probe.py",
    "balance/test_resume.py",
    "balance/test_strategy.py",
    "conformance/test_matrix.py",
    "fsdp/test_fsdp_plugins.py",
    "optim/test_fsdp.py",
    "test_composition.py",
    "test_configs_and_examples.py::test_every_config_parses_and_runs_two_steps",
    "test_device_clock.py",
    "test_report.py::test_ddp_report_counts_every_rank_and_gives_each_rank_memory",
    "tokens/test_accumulation.py::test_ddp_with_accumulation_equals_one_batch_over_its_tokens",
    "tokens/test_callback_fixes.py::test_non_finite_losses_on_one_rank_stop_every_rank_together",
    "tokens/test_ddp.py",
    "tokens/test_streaming.py::test_two_processes_under_global_scope_stream_at_one_threshold",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def _machine() -> str:
    return f"cpu: {_cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}"


def pytest_report_header(config):
    # memory readings on CPU (peak RSS) depend on the kernels torch and MKL pick for this CPU: say which
    return _machine()


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.stats.get("failed"):  # also under -q, where the header is not shown
        terminalreporter.write_line(_machine())


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # two workers on two cores: a second intra-op thread per worker would only contend
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    found = set()
    for item in items:
        path = Path(item.path).resolve().relative_to(here).as_posix()
        name = item.originalname if hasattr(item, "originalname") else item.name
        for entry in (path, f"{path}::{name}"):
            if entry in SERIAL:
                item.add_marker(pytest.mark.serial)
                found.add(entry)
    collected = {Path(item.path).resolve().relative_to(here).as_posix() for item in items}
    # only a whole file collected can tell that a listed test is gone (not a run of chosen node ids)
    lost = [e for e in SERIAL if e not in found and e.split("::")[0] in collected and "::" not in " ".join(config.args)]
    if lost:
        raise pytest.UsageError(f"tests/conftest.py SERIAL names tests that were not collected: {lost}")


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
