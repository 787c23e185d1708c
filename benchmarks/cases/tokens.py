"""Cases ``tokens`` (the loss path), ``tokens_head`` (head backward by keep ratio) and
``tokens_quality`` (validation loss of selection methods on the demo, clean and noisy corpus)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import time
import types

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, register
from lightning_efficient.memory import SavedTensorCounter, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from lightning_efficient.tokens import linear_cross_entropy


def _head_inputs(quick: bool):
    n, d, v = (1024, 256, 8000) if quick else (8192, 512, 32000)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


def _measure(loss_fn, hidden, weight, repeats: int) -> dict[str, float]:
    """Forward+backward time, saved bytes and the peak RSS above the inputs (after a warm-up)."""
    loss_fn(hidden, weight).backward()
    hidden.grad = weight.grad = None
    baseline_rss = current_rss_bytes()
    reset_peak_rss()
    with SavedTensorCounter(exclude=[hidden, weight]) as counter:
        loss = loss_fn(hidden, weight)
    loss.backward()
    saved = counter.bytes
    hidden.grad = weight.grad = None
    peak = peak_rss_bytes() - baseline_rss
    start = time.perf_counter()
    for _ in range(repeats):
        loss_fn(hidden, weight).backward()
        hidden.grad = weight.grad = None
    return {"fwd_bwd_time_s": (time.perf_counter() - start) / repeats, "saved_bytes": saved, "peak_rss_above_inputs_bytes": peak}


def full_logits(quick: bool) -> dict[str, float]:
    """Full logits then ``F.cross_entropy`` (mean), as a plain model does."""
    hidden, weight, labels = _head_inputs(quick)
    return _measure(lambda h, w: F.cross_entropy(h @ w.t(), labels), hidden, weight, 2 if quick else 3)


def chunked_mean(quick: bool) -> dict[str, float]:
    """``linear_cross_entropy(reduction="mean")``: gradients computed chunk by chunk in the forward,
    the chunk step compiled (the default at the full size; asked for, so that quick runs measure the
    same; the warm-up call compiles it)."""
    hidden, weight, labels = _head_inputs(quick)
    return _measure(lambda h, w: linear_cross_entropy(h, w, labels, reduction="mean", compile=True), hidden, weight, 2 if quick else 3)


def chunked_mean_eager(quick: bool) -> dict[str, float]:
    """``linear_cross_entropy(reduction="mean", compile=False)``: the eager chunk step, op by op."""
    hidden, weight, labels = _head_inputs(quick)
    return _measure(lambda h, w: linear_cross_entropy(h, w, labels, reduction="mean", compile=False), hidden, weight, 2 if quick else 3)


def _cce_torch_compile():
    """Cut Cross-Entropy's ``torch_compile`` implementation (``pip install --no-deps cut-cross-entropy``).

    The package's ``__init__`` imports its Triton kernels, which need triton (a GPU compiler); its
    ``torch_compile`` module needs only torch, so it is loaded without running that ``__init__``.
    """
    spec = importlib.util.find_spec("cut_cross_entropy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("cut-cross-entropy is not installed: `make bench` installs it (pip install --no-deps cut-cross-entropy)")
    if "cut_cross_entropy" not in sys.modules:
        package = types.ModuleType("cut_cross_entropy")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["cut_cross_entropy"] = package
    return importlib.import_module("cut_cross_entropy.torch_compile").torch_compile_linear_cross_entropy


def cce_torch_compile(quick: bool) -> dict[str, float]:
    """Peer: Cut Cross-Entropy's ``torch_compile`` implementation (mean), the one that runs without a
    GPU: full logits and ``F.cross_entropy`` under ``torch.compile`` (the warm-up call compiles it)."""
    cce = _cce_torch_compile()
    hidden, weight, labels = _head_inputs(quick)
    return _measure(lambda h, w: cce(h, w, labels, reduction="mean"), hidden, weight, 2 if quick else 3)


def chunked_per_token(quick: bool) -> dict[str, float]:
    """``linear_cross_entropy(reduction="none")`` then the mean: the path selection uses, keep 1.0."""
    hidden, weight, labels = _head_inputs(quick)
    return _measure(lambda h, w: linear_cross_entropy(h, w, labels).mean(), hidden, weight, 2 if quick else 3)


register(
    Case(
        name="tokens",
        description=(
            "The output head's loss path at vocabulary 32,000, hidden 512, 8,192 tokens (quick: 8,000, "
            "256, 1,024): full logits + F.cross_entropy against the chunked linear cross-entropy (chunk "
            "step compiled, and eager) and Cut Cross-Entropy's torch_compile implementation; "
            "forward+backward time, bytes saved for backward and peak RSS above the inputs (CPU)."
        ),
        baseline="full_logits",
        variants={
            "full_logits": full_logits,
            "chunked_mean": chunked_mean,
            "chunked_mean_eager": chunked_mean_eager,
            "cce_torch_compile": cce_torch_compile,
            "chunked_per_token": chunked_per_token,
        },
    )
)


def head_backward(keep_ratio: float, quick: bool) -> dict[str, float]:
    """Head forward and backward with the loss over a random ``keep_ratio`` of the tokens."""
    hidden, weight, labels = _head_inputs(quick)
    keep = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) < keep_ratio
    repeats = 2 if quick else 3
    forward = backward = 0.0
    for i in range(repeats + 1):
        start = time.perf_counter()
        losses = linear_cross_entropy(hidden, weight, labels)
        loss = (losses * keep).sum() / keep.sum()
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        hidden.grad = weight.grad = None
        if i:  # the first is a warm-up
            forward += middle - start
            backward += end - middle
    return {"forward_time_s": forward / repeats, "backward_time_s": backward / repeats, "fwd_bwd_time_s": (forward + backward) / repeats}


def torch_head_backward(quick: bool) -> dict[str, float]:
    """For scale: full logits and ``F.cross_entropy`` masked to every token, split forward/backward."""
    hidden, weight, labels = _head_inputs(quick)
    repeats = 2 if quick else 3
    forward = backward = 0.0
    for i in range(repeats + 1):
        start = time.perf_counter()
        loss = F.cross_entropy(hidden @ weight.t(), labels)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        hidden.grad = weight.grad = None
        if i:
            forward += middle - start
            backward += end - middle
    return {"forward_time_s": forward / repeats, "backward_time_s": backward / repeats, "fwd_bwd_time_s": (forward + backward) / repeats}


register(
    Case(
        name="tokens_head",
        description=(
            "Head backward time when the loss keeps a fraction of the tokens (chunked linear "
            "cross-entropy, reduction='none'; dropped tokens skip the backward), against keep 1.0, "
            "with full-logits torch for scale. Same sizes as `tokens`."
        ),
        baseline="keep_1.0",
        variants={
            **{f"keep_{r}": functools.partial(head_backward, r) for r in (1.0, 0.7, 0.5, 0.3)},
            "torch_full_logits": torch_head_backward,
        },
    )
)
