"""The compiled chunk step of ``linear_cross_entropy`` against the eager step (its reference) and
against full logits in float64; the fallback when compiling fails. Shapes stay tiny and shared
(one vocabulary, one hidden size) so that the whole file compiles a handful of graphs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from lightning_efficient.tokens import linear_ce
from lightning_efficient.tokens.linear_ce import linear_cross_entropy, set_compile

N, D, V, CHUNK = 45, 8, 67, 16  # 45 = 16 + 16 + 13: the last chunk is shorter


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::6] = -100
    return hidden, weight, bias, labels


def _run(compile, reduction, dtype=torch.float32, autocast=False, upstream_seed=1):
    """Losses, entropies and the gradients of hidden, weight and bias, for one chunk step."""
    hidden, weight, bias, labels = _inputs(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses, entropy = linear_cross_entropy(hidden, weight, labels, bias, chunk_size=CHUNK, reduction=reduction, return_entropy=True, compile=compile)
    upstream = None
    if reduction == "none":  # a selection-like upstream gradient: some tokens dropped
        g = torch.Generator().manual_seed(upstream_seed)
        upstream = torch.randn(losses.shape, generator=g, dtype=losses.dtype) * (torch.rand(losses.shape, generator=g) < 0.6)
    grads = torch.autograd.grad(losses, (hidden, weight, bias), upstream)
    return (losses, entropy, *grads), upstream


def _reference(reduction, upstream, dtype=torch.float32):
    """Full logits and ``F.cross_entropy`` in float64 on the inputs drawn in ``dtype``."""
    *tensors, labels = _inputs(dtype)
    hidden, weight, bias = (t.detach().double().requires_grad_() for t in tensors)
    logits = hidden @ weight.t() + bias
    losses = F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)
    logp = torch.log_softmax(logits.detach(), dim=1)
    entropy = torch.where(labels != -100, -(logp.exp() * logp).sum(1), torch.zeros(()))
    return (losses.detach(), entropy, *torch.autograd.grad(losses, (hidden, weight, bias), upstream))


def _assert_close(got, want, rtol, atol):
    names = ("losses", "entropy", "grad hidden", "grad weight", "grad bias")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_compiled_step_equals_eager_step_in_float32(reduction):
    compiled, upstream = _run(True, reduction)
    eager, _ = _run(False, reduction)
    assert linear_ce._CHUNK_STEP.failed is None, linear_ce._CHUNK_STEP.failed
    _assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    # and both are the loss of full logits
    want = _reference(reduction, None if upstream is None else upstream.double())
    _assert_close([t.double() for t in compiled], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["none"])  # "mean" adds a graph; float32 covers its fused gradient
def test_compiled_step_is_exact_in_float64(reduction):
    compiled, upstream = _run(True, reduction, dtype=torch.float64)
    eager, _ = _run(False, reduction, dtype=torch.float64)
    assert linear_ce._CHUNK_STEP.failed is None, linear_ce._CHUNK_STEP.failed
    _assert_close(compiled, eager, rtol=0, atol=1e-12)
    _assert_close(compiled, _reference(reduction, upstream, torch.float64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("reduction", ["none"])  # forward and the backward's recomputation under autocast
def test_compiled_step_equals_eager_step_under_bf16_autocast(reduction):
    compiled, _ = _run(True, reduction, autocast=True)
    eager, _ = _run(False, reduction, autocast=True)
    assert linear_ce._CHUNK_STEP.failed is None, linear_ce._CHUNK_STEP.failed
    # the same bf16 logits on both sides; float32 softmax and sums after them
    _assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_a_failing_compiler_falls_back_to_the_eager_step_and_says_so_once(monkeypatch, caplog):
    def unavailable(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())  # a fresh process's choice
    monkeypatch.setattr(torch, "compile", unavailable)
    eager, _ = _run(False, "mean")
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="compiling the chunk step failed") as record:
        first, _ = _run(True, "mean")
        second, _ = _run(True, "none")
        third, _ = _run(True, "mean")
    assert len([w for w in record if "compiling the chunk step failed" in str(w.message)]) == 1
    assert "no C++ compiler here" in linear_ce._CHUNK_STEP.failed
    for got in (first, third):
        _assert_close(got, eager, rtol=0, atol=0)  # the eager step itself, bit for bit
    _assert_close(second, _run(False, "none")[0], rtol=0, atol=0)
    said = [r.getMessage() for r in caplog.records if "the chunk step runs" in r.getMessage()]
    assert said == ["linear_cross_entropy: the chunk step runs eager (compiling failed)"]


def test_compile_false_never_compiles_and_says_eager_once(monkeypatch, caplog, recwarn):
    def must_not_run(*args, **kwargs):
        raise AssertionError("torch.compile called with compile=False")

    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())
    monkeypatch.setattr(torch, "compile", must_not_run)
    with caplog.at_level(logging.INFO):
        _run(False, "mean")
        _run(False, "none")
    assert linear_ce._CHUNK_STEP.failed is None
    assert not [w for w in recwarn if "chunk step" in str(w.message)]
    said = [r.getMessage() for r in caplog.records if "the chunk step runs" in r.getMessage()]
    assert said == ["linear_cross_entropy: the chunk step runs eager"]


def test_compile_none_follows_the_head_size_and_set_compile(monkeypatch):
    monkeypatch.setattr(linear_ce, "_CHUNK_STEP", linear_ce._ChunkStep())
    step = linear_ce._CHUNK_STEP
    assert not step.use_compiled(None, N * V)  # a tiny head: compiling would cost more than it saves
    assert not step.use_compiled(None, 2048 * 8192)  # the demo's head
    assert step.use_compiled(None, 8192 * 32000)  # the benchmark's
    try:
        set_compile(False)
        assert not step.use_compiled(None, 2**30)
        assert step.use_compiled(True, N * V)  # the keyword wins over the process default
        set_compile(True)
        assert step.use_compiled(None, N * V)
    finally:
        set_compile(None)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_compile_must_be_a_bool_or_none(value):
    hidden, weight, bias, labels = _inputs()
    with pytest.raises(ValueError, match=r"compile=.* is not allowed: expected True, False or None"):
        linear_cross_entropy(hidden, weight, labels, bias, compile=value)
    with pytest.raises(ValueError, match=r"compile=.* is not allowed"):
        set_compile(value)
