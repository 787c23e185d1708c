"""The streaming variants of case ``tokens_head`` (registered in ``benchmarks/cases/tokens.py``).

Head forward + backward when the loss keeps a fraction of the tokens on the streaming path
(:func:`~lightning_efficient.tokens.streaming.streaming_cross_entropy`: each chunk's logits once,
the kept tokens' gradients in the same pass, 1 + 2k matmul passes), beside
``linear_cross_entropy(reduction="mean")`` (3 passes), the figure the issue's goal is a ratio to
(streaming at keep 0.5 <= 0.70x of it). The threshold is the inputs' exact top-k threshold for the
keep ratio, computed before the timed runs (in training it comes from the previous steps).
"""

from __future__ import annotations

import functools
import time

import torch

from benchmarks.cases.tokens import _head_inputs  # importing tokens also registers the case these variants join
from benchmarks.harness import CASES
from lightning_efficient.tokens import linear_cross_entropy
from lightning_efficient.tokens.selection import select_tokens
from lightning_efficient.tokens.streaming import streaming_cross_entropy


def _timed(step, hidden, weight, repeats: int) -> dict[str, float]:
    """Forward and backward seconds of ``step(hidden, weight) -> loss``, after one warm-up run."""
    forward = backward = 0.0
    for i in range(repeats + 1):
        start = time.perf_counter()
        loss = step(hidden, weight)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        hidden.grad = weight.grad = None
        if i:
            forward += middle - start
            backward += end - middle
    return {"forward_time_s": forward / repeats, "backward_time_s": backward / repeats,
            "fwd_bwd_time_s": (forward + backward) / repeats}


def chunked_mean(quick: bool) -> dict[str, float]:
    """``linear_cross_entropy(reduction="mean")``: every token, gradients computed in the forward pass."""
    hidden, weight, labels = _head_inputs(quick)
    return _timed(lambda h, w: linear_cross_entropy(h, w, labels, reduction="mean"), hidden, weight, 2 if quick else 3)


def streaming(keep_ratio: float, quick: bool) -> dict[str, float]:
    """The streaming path keeping ``keep_ratio`` of the tokens (the kept mean, as selection trains on)."""
    hidden, weight, labels = _head_inputs(quick)
    valid = torch.ones_like(labels, dtype=torch.bool)
    if keep_ratio < 1.0:
        with torch.no_grad():
            losses = linear_cross_entropy(hidden, weight, labels)
        threshold, keep = select_tokens("topk", losses, valid, keep_ratio).threshold, None
    else:
        threshold, keep = None, valid

    def step(h, w):
        out = streaming_cross_entropy(h, w, labels, threshold=threshold, keep=keep)
        return out.kept_sum / out.keep.sum()

    metrics = _timed(step, hidden, weight, 2 if quick else 3)
    metrics["kept_fraction"] = float(streaming_cross_entropy(hidden.detach(), weight.detach(), labels, threshold=threshold,
                                                             keep=keep).keep.float().mean())
    return metrics


CASES["tokens_head"].variants.update({
    "chunked_mean": chunked_mean,
    **{f"streaming_keep_{r}": functools.partial(streaming, r) for r in (1.0, 0.7, 0.5, 0.3)},
})
