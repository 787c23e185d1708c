"""Importing the package stays light: bitsandbytes is imported when an 8-bit feature is used, quietly."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


_SCRIPT = """
import sys

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "bitsandbytes")

import lightning_efficient
print("after import:", loaded())
from lightning_efficient import EightBitOptimizer
callback = EightBitOptimizer(min_8bit_size=1024, offload="cpu")  # validated without bitsandbytes
print("after construction:", loaded())
from tests.optim.helpers import Regression, trainer
t = trainer(1, [callback])
t.fit(Regression())
print("after fit:", "bitsandbytes" in loaded(), type(t.optimizers[0]).__name__)
"""


@pytest.fixture(scope="module")
def fresh_process() -> subprocess.CompletedProcess:
    """One fresh interpreter: import the package, build the callback, fit one step."""
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=600, check=False,
    )


def test_import_lightning_efficient_does_not_import_bitsandbytes(fresh_process):
    assert fresh_process.returncode == 0, (fresh_process.stdout + fresh_process.stderr)[-3000:]
    assert "after import: []" in fresh_process.stdout.splitlines(), fresh_process.stdout
    assert "after construction: []" in fresh_process.stdout.splitlines(), fresh_process.stdout


def test_eight_bit_optimizer_imports_bitsandbytes_at_fit_start_without_the_kernels_note(fresh_process):
    output = fresh_process.stdout + fresh_process.stderr
    assert fresh_process.returncode == 0, output[-3000:]
    assert "after fit: True AdamW8bit" in fresh_process.stdout.splitlines()
    assert "kernels-community" not in output, output[-3000:]


def test_only_the_kernels_community_note_is_dropped():
    from lightning_efficient.optim._bnb import (
        _KERNELS_LOGGER,
        _DropKernelsCommunityNote,
        bitsandbytes,
    )

    def record(msg, *args):
        return logging.LogRecord(_KERNELS_LOGGER, logging.WARNING, __file__, 1, msg, args, None)

    note = record(
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install kernels` "
        "and the kernels >= 0.11.1", ModuleNotFoundError("No module named 'kernels'"),
    )
    keep = _DropKernelsCommunityNote()
    assert not keep.filter(note)
    assert keep.filter(record("Failed to load the CPU library: %s", "libbitsandbytes_cpu.so"))
    assert keep.filter(record("some other bitsandbytes warning"))
    bitsandbytes()
    assert logging.getLogger(_KERNELS_LOGGER).filters == []  # only around our import, not left on bitsandbytes' logger
