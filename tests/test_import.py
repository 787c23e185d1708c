"""Importing the package stays light: bitsandbytes is imported when an 8-bit feature is used, quietly."""

import logging
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
    )


def test_import_lightning_efficient_does_not_import_bitsandbytes():
    done = _run("import sys, lightning_efficient; print(sorted(m for m in sys.modules if m.split('.')[0] == 'bitsandbytes'))")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
    assert "kernels-community" not in done.stdout + done.stderr


def test_eight_bit_optimizer_imports_bitsandbytes_at_fit_start_without_the_kernels_note():
    code = """
import sys
from lightning_efficient import EightBitOptimizer
callback = EightBitOptimizer(min_8bit_size=1024, offload="cpu")  # validated without bitsandbytes
assert "bitsandbytes" not in sys.modules, "constructing EightBitOptimizer imported bitsandbytes"
from tests.optim.helpers import Regression, trainer
t = trainer(1, [callback])
t.fit(Regression())
assert "bitsandbytes" in sys.modules
print("stepped with", type(t.optimizers[0]).__name__)
"""
    done = _run(code)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "stepped with AdamW8bit" in done.stdout
    assert "kernels-community" not in output, output[-3000:]


def test_only_the_kernels_community_note_is_dropped():
    from lightning_efficient.optim._bnb import _KERNELS_LOGGER, _DropKernelsCommunityNote, bitsandbytes

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
