"""The chunk step's log line names the path whose step runs: ``linear_cross_entropy`` or
``streaming_cross_entropy`` (both share one compiled-or-eager choice per process), each said once."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_efficient.tokens import linear_ce
from lightning_efficient.tokens.linear_ce import linear_cross_entropy
from lightning_efficient.tokens.streaming import streaming_cross_entropy

N, D, V = 45, 8, 67


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::6] = -100
    return hidden, weight, labels


def _both(compile):
    """One call of each path, forward and backward, with the chunk step compiled or not."""
    hidden, weight, labels = _inputs()
    streaming_cross_entropy(hidden, weight, labels, chunk_size=16, threshold=4.0, compile=compile).kept_sum.backward()
    linear_cross_entropy(hidden, weight, labels, chunk_size=16, reduction="none", compile=compile).sum().backward()


def _said(caplog):
    return [r.getMessage() for r in caplog.records if "the chunk step runs" in r.getMessage()]


def test_each_path_says_which_chunk_step_it_runs_once(monkeypatch, lightning_caplog):
    caplog = lightning_caplog
    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())  # a fresh process's choice
    # the fused step, not compiled (this test is about what is said; test_linear_ce_compiled compiles)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            _both(True)
        for _ in range(2):
            _both(False)
    assert _said(caplog) == [
        "streaming_cross_entropy: the chunk step runs compiled (torch.compile)",
        "linear_cross_entropy: the chunk step runs compiled (torch.compile)",
        "streaming_cross_entropy: the chunk step runs eager",
        "linear_cross_entropy: the chunk step runs eager",
    ]


def test_a_failing_compiler_is_reported_by_the_path_that_met_it(monkeypatch, lightning_caplog):
    caplog = lightning_caplog
    def unavailable(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())
    monkeypatch.setattr(torch, "compile", unavailable)
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="compiling the chunk step failed") as record:
        for _ in range(2):
            _both(True)
    failed = [str(w.message) for w in record if "compiling the chunk step failed" in str(w.message)]
    assert len(failed) == 1 and failed[0].startswith("streaming_cross_entropy: compiling the chunk step failed (RuntimeError")
    # from then on both paths run eager, each saying so once: linear_cross_entropy's next call first
    assert _said(caplog) == [
        "linear_cross_entropy: the chunk step runs eager (compiling failed)",
        "streaming_cross_entropy: the chunk step runs eager (compiling failed)",
    ]
