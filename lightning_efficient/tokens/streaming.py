"""Streaming selection on the fused head: select and differentiate each chunk in one pass.

When the keep rule's threshold is known *before* the head's forward pass (a running estimate from
the previous steps, see :class:`~lightning_efficient.tokens.selection.RunningThreshold`), or the
keep mask itself is (``random``, or every valid token at keep ratio 1.0), the chunked linear
cross-entropy can decide which tokens it keeps while it holds their logits: per chunk it computes
the logits once, the per-token losses and scores, keeps the valid tokens whose score is at or above
the threshold, and computes their gradients right there (``softmax - onehot``; the ``grad_hidden``
rows and the accumulated ``grad_weight``/``grad_bias``). That is ``1 + 2k`` matmul passes at keep
ratio ``k`` with nothing recomputed in backward, against ``1 + 3k`` for per-token losses followed
by a selection (:func:`~lightning_efficient.tokens.linear_cross_entropy` with ``reduction="none"``).

:func:`streaming_cross_entropy` returns the *sum* of the kept tokens' losses, whose backward pass
only scales the precomputed gradients by the incoming gradient (as the eager ``"mean"`` path of
``linear_cross_entropy`` does), together with the detached per-token losses, scores and keep mask.

Precision follows ``linear_cross_entropy``: losses, softmax and gradient accumulation in float32
(float64 for float64 inputs); under autocast the logits and the gradient matmuls run in the
autocast dtype. A token's score is compared to the threshold in float32, as
:func:`~lightning_efficient.tokens.selection.threshold_keep` compares them, so a threshold taken
from a batch's exact selection keeps exactly that selection's tokens.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lightning_efficient._validation import require, require_choice
from lightning_efficient.tokens import linear_ce
from lightning_efficient.tokens.linear_ce import (
    _accumulate_matmul,
    _chunk_buffer,
    _chunk_logits,
    _fused_logits,
    _head_matmul,
    _log_probs,
    _matmul_into,
    _minus_onehot,
    _probs,
    _probs_and_entropy,
    _token_losses,
    _Workspace,
    auto_chunk_size,
    check_head_inputs,
)

StreamScore = Literal["loss", "entropy", "excess"]
#: how the chunk step's log line names this path
_PATH = "streaming_cross_entropy"
STREAM_SCORES = ("loss", "entropy", "excess")


class StreamedLoss(NamedTuple):
    """What :func:`streaming_cross_entropy` returns.

    Attributes:
        kept_sum: the sum of the kept tokens' losses (a scalar; its backward pass scales the
            gradients computed during the forward pass).
        losses: every token's loss, detached, shaped like ``labels`` (0 where ignored).
        keep: bool mask of the kept tokens, shaped like ``labels`` (a subset of the valid ones).
        scores: the per-token scores the threshold was compared to (detached; 0 where ignored), or
            None when neither a threshold nor ``return_scores`` asked for them.
    """

    kept_sum: Tensor
    losses: Tensor
    keep: Tensor
    scores: Tensor | None


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _excess(chunk_losses: Tensor, valid: Tensor, reference: Tensor) -> Tensor:
    return torch.where(valid, chunk_losses - reference.to(chunk_losses.dtype), torch.zeros_like(chunk_losses))


def _chunk_scores(logits, lse, chunk_losses, valid, reference, score):
    """The compiled step's chunk scores, as :func:`linear_cross_entropy`'s compiled step computes its
    entropies."""
    if score == "entropy":
        probs = torch.exp(logits - lse.unsqueeze(1))
        return torch.where(valid, lse - (probs * logits).sum(1), torch.zeros_like(lse))
    if score == "excess":
        return _excess(chunk_losses, valid, reference)
    return chunk_losses


def _eager_stream_chunk(h, weight, bias, labels, valid, reference, score, need_scores, acc, work):
    """One chunk's forward, op by op, as :func:`linear_cross_entropy`'s eager step computes it (bit for
    bit: the same losses and entropies): ``(losses, scores or None, logp, probs or None)``. ``probs``
    (in ``work.logits``) is computed only for entropy scores, which overwrite ``logp``; otherwise
    ``work.logits`` is free for the kept rows' gradient."""
    logits = _chunk_logits(h, weight, bias, acc, work.logits)
    logp = _log_probs(logits, work.logp)
    losses = _token_losses(logp, labels, valid)
    scores = probs = None
    if need_scores and score == "entropy":
        probs, scores = _probs_and_entropy(logp, valid, work.logits)
    elif need_scores:
        scores = _excess(losses, valid, reference) if score == "excess" else losses
    return losses, scores, logp, probs


def _eager_kept_grad(logp, probs, index, labels, work):
    """``softmax - onehot`` of the kept rows ``index`` (every row when None), in a workspace buffer: the
    kept rows of ``probs`` when the entropy computed them, else ``exp`` of the kept log-probabilities."""
    if index is None:
        grad = probs if probs is not None else _probs(logp, work.logits)
        return _minus_onehot(grad, labels)
    if probs is not None:  # logp was overwritten by the entropy: its buffer is free
        grad = torch.index_select(probs, 0, index, out=work.logp[: len(index)])
    else:
        grad = torch.index_select(logp, 0, index, out=work.logits[: len(index)]).exp_()
    return _minus_onehot(grad, labels.index_select(0, index))


# --- the compiled step: the same arithmetic, out of place, for torch.compile (see linear_ce) ---


def _fused_stream_scores(mm, bias, labels, valid, keep_given, threshold, reference, acc, score, want_scores):
    """One chunk's elementwise forward on its matmul ``mm``: ``(losses, lse, scores or None, keep)``.
    ``keep`` is ``keep_given & valid`` or, with ``threshold`` (a float32 0-dim tensor), the valid
    tokens whose float32 score is at or above it."""
    logits = _fused_logits(mm, bias, acc)
    lse = torch.logsumexp(logits, dim=1)
    target = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    losses = torch.where(valid, lse - target, torch.zeros_like(lse))
    scores = None
    if want_scores or keep_given is None:
        scores = _chunk_scores(logits, lse, losses, valid, reference, score)
    keep = valid & keep_given if keep_given is not None else valid & (scores.float() >= threshold)
    return losses, lse, scores, keep


def _fused_stream_grad(mm, bias, index, lse, labels, acc, grad_dtype, out):
    """``softmax - onehot`` of the rows ``index`` of the chunk's matmul ``mm`` (all rows, written over
    ``mm``, when ``index`` is None), written into ``out`` (``[len(index), vocab]``, reused) where the
    dtypes agree: the row gather, softmax and one-hot fused in one pass over the kept rows."""
    if index is not None:
        mm = mm.index_select(0, index)
        lse = lse.index_select(0, index)
        labels = labels.index_select(0, index)
    logits = _fused_logits(mm, bias, acc)
    probs = torch.exp(logits - lse.unsqueeze(1))
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == labels.unsqueeze(1)
    grad = torch.where(onehot, probs - 1.0, probs).to(grad_dtype)
    return out.copy_(grad) if out is not None and out.dtype == grad.dtype else grad


def _row_args(args: tuple, positions: tuple[int, ...]) -> tuple[int, ...]:
    """The positions among ``positions`` that hold a tensor (whose first dimension is the chunk's rows)."""
    return tuple(i for i in positions if args[i] is not None)


def _apply_grad(grad: Tensor, kept_h: Tensor, rows: slice | Tensor, weight: Tensor, grads: tuple) -> None:
    """Add the logits' gradient ``grad`` of the token ``rows`` (hidden ``kept_h``) to ``grads``
    (``grad_hidden``, ``grad_weight``, ``grad_bias``; None entries are skipped)."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        if isinstance(rows, slice):
            _matmul_into(grad_hidden[rows], grad, weight)
        else:
            grad_hidden.index_copy_(0, rows, (grad @ weight).to(grad_hidden.dtype))
    if grad_weight is not None:
        _accumulate_matmul(grad_weight, grad.t(), kept_h)
    if grad_bias is not None:
        grad_bias += grad.sum(0).to(grad_bias.dtype)


def _flush(buffer: Tensor, filled: int, pending: list[Tensor], hidden: Tensor, weight: Tensor, grads: tuple) -> int:
    """Apply the ``filled`` gradient rows waiting in ``buffer`` (token rows ``pending``, emptied); returns 0."""
    rows = torch.cat(pending)
    pending.clear()
    _apply_grad(buffer[:filled], hidden.index_select(0, rows), rows, weight, grads)
    return 0


def _streamed_forward(hidden, weight, bias, labels, keep_given, threshold, reference, ignore_index, chunk_size, score,
                      want_scores, needs_grad, compiled=False):
    """The one chunked pass. Returns ``(kept_sum, losses, keep, scores, grads)``; ``grads`` is
    ``(grad_hidden, grad_weight, grad_bias)`` of the kept sum (None entries where not needed).
    ``compiled`` runs each chunk's elementwise work as the compiled step (see linear_ce)."""
    acc = _accumulation_dtype(hidden.dtype)
    n_tokens = hidden.shape[0]
    device = hidden.device
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    losses = torch.zeros(n_tokens, dtype=acc, device=device)
    keep = torch.zeros(n_tokens, dtype=torch.bool, device=device)
    need_scores = threshold is not None or want_scores
    scores = torch.zeros(n_tokens, dtype=acc, device=device) if need_scores else None
    kept_sum = torch.zeros((), dtype=acc, device=device)
    need_hidden, need_weight, need_bias = needs_grad
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
    grad_bias = torch.zeros_like(bias, dtype=acc) if need_bias and bias is not None else None
    grads = (grad_hidden, grad_weight, grad_bias)
    any_grad = any(g is not None for g in grads)
    threshold_value = None if threshold is None else torch.as_tensor(threshold, dtype=torch.float32, device=device)
    rows_max = min(chunk_size, n_tokens)
    buffer = _chunk_buffer(compiled, hidden, weight, rows_max)  # the chunk's matmul, reused
    grad_buffer = _chunk_buffer(compiled and any_grad, hidden, weight, rows_max)  # the kept rows' gradients
    work = None if compiled else _Workspace(rows_max, weight.shape[0], acc, device)  # the eager step's buffers
    pending: list[Tensor] = []  # the token rows of the gradients waiting in grad_buffer[:filled]
    filled = 0
    for start in range(0, n_tokens, chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        chunk_valid, chunk_labels = valid[rows], safe_labels[rows]
        chunk_given = None if keep_given is None else keep_given[rows]
        chunk_reference = None if reference is None else reference[rows]
        if compiled:
            mm = _head_matmul(h, weight, buffer)
            args = (mm, bias, chunk_labels, chunk_valid, chunk_given, threshold_value, chunk_reference, acc, score,
                    need_scores)
            chunk_losses, chunk_lse, chunk_scores, chunk_keep = linear_ce._CHUNK_STEP.run(
                "stream_scores", _fused_stream_scores, args, _row_args(args, (0, 2, 3, 4, 6)),
                functools.partial(_fused_stream_scores, *args), path=_PATH)
        else:  # losses and entropies as linear_cross_entropy computes them, bit for bit
            chunk_losses, chunk_scores, logp, probs = _eager_stream_chunk(
                h, weight, bias, chunk_labels, chunk_valid, chunk_reference, score, need_scores, acc, work)
            if chunk_given is not None:
                chunk_keep = chunk_given & chunk_valid
            else:
                chunk_keep = chunk_valid & (chunk_scores.float() >= threshold_value)
        losses[rows] = chunk_losses
        if need_scores:
            scores[rows] = chunk_scores
        keep[rows] = chunk_keep
        index = torch.nonzero(chunk_keep).squeeze(1)
        n_kept = index.numel()
        if n_kept == 0:
            continue
        everything = n_kept == chunk_keep.numel()
        kept_sum = kept_sum + (chunk_losses.sum() if everything else chunk_losses.index_select(0, index).sum())
        if not any_grad:
            continue
        if everything:
            index = None
        # the kept rows' softmax - onehot (unscaled: the backward pass scales by the incoming gradient)
        if compiled and index is not None and grad_buffer is not None:
            # gathered into the gradient buffer across chunks: the gradient matmuls run on full
            # buffers (fewer, longer passes over weight and grad_weight)
            if filled + n_kept > len(grad_buffer):
                filled = _flush(grad_buffer, filled, pending, hidden, weight, grads)
            args = (mm, bias, index, chunk_lse, chunk_labels, acc, hidden.dtype, grad_buffer[filled : filled + n_kept])
            linear_ce._CHUNK_STEP.run("stream_grad", _fused_stream_grad, args, _row_args(args, (0, 2, 3, 4, 7)),
                                      functools.partial(_fused_stream_grad, *args), path=_PATH)
            pending.append(index + start)
            filled += n_kept
            continue
        kept_h = h if everything else h.index_select(0, index)
        if compiled:  # every row kept: the gradient overwrites the chunk's matmul
            args = (mm, bias, index, chunk_lse, chunk_labels, acc, hidden.dtype,
                    mm if everything and mm.dtype == hidden.dtype else None)
            grad = linear_ce._CHUNK_STEP.run("stream_grad", _fused_stream_grad, args, _row_args(args, (0, 2, 3, 4, 7)),
                                             functools.partial(_fused_stream_grad, *args), path=_PATH)
        else:
            grad = _eager_kept_grad(logp, probs, index, chunk_labels, work).to(hidden.dtype)
        _apply_grad(grad, kept_h, rows if everything else index + start, weight, grads)
    if filled:
        _flush(grad_buffer, filled, pending, hidden, weight, grads)
    return kept_sum, losses, keep, scores, grads


class _StreamingCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, keep_given, threshold, reference, ignore_index, chunk_size, score,
                want_scores, compiled):
        kept_sum, losses, keep, scores, grads = _streamed_forward(
            hidden, weight, bias, labels, keep_given, threshold, reference, ignore_index, chunk_size, score, want_scores,
            ctx.needs_input_grad[:3], compiled,
        )
        ctx.has = tuple(g is not None for g in grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        if scores is None:
            scores = torch.zeros(0, dtype=losses.dtype, device=losses.device)
        ctx.mark_non_differentiable(losses, keep, scores)
        return kept_sum, losses, keep, scores

    @staticmethod
    def backward(ctx, grad_sum, *unused):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if has else None for has in ctx.has]
        out = []
        for grad, dtype in zip(grads, ctx.dtypes):
            out.append(None if grad is None else (grad * grad_sum.to(grad.dtype)).to(dtype))
        return (*out, None, None, None, None, None, None, None, None, None)


def streaming_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    *,
    threshold: float | Tensor | None = None,
    keep: Tensor | None = None,
    score: StreamScore = "loss",
    reference_losses: Tensor | None = None,
    return_scores: bool = False,
    compile: bool | None = None,
) -> StreamedLoss:
    """The kept tokens' cross-entropy sum of ``hidden @ weight.T + bias``, selected while streaming.

    Exactly one of ``threshold`` and ``keep`` chooses the kept tokens: with ``threshold``, a valid
    token is kept when its score (compared in float32) is at or above it; with ``keep``, the valid
    tokens where ``keep`` is true are. Each chunk's logits are computed once; the kept tokens'
    gradients are computed in the same pass and only scaled in backward.

    Args:
        hidden: ``[..., d]`` hidden states.
        weight: ``[vocab, d]`` output-head weight.
        labels: ``[...]`` target ids; ``ignore_index`` marks positions that do not count.
        bias: optional ``[vocab]`` head bias.
        ignore_index: the label of ignored positions (never kept).
        chunk_size: tokens per chunk; None picks the size ``linear_cross_entropy`` picks.
        threshold: the score at or above which a valid token is kept (a float or a 0-dim tensor).
        keep: a bool mask shaped like ``labels``, decided before the pass (``random``, keep-all).
        score: what the threshold is compared to: ``"loss"`` (the token's loss), ``"entropy"`` (its
            predictive entropy) or ``"excess"`` (its loss minus ``reference_losses``).
        reference_losses: a reference model's per-token losses shaped like ``labels`` (``"excess"``).
        return_scores: also return the scores when ``keep`` is given (the threshold's next estimate).
        compile: run each chunk's elementwise work (log-sum-exp, target, scores, keep test, the kept
            rows' gather and ``softmax - onehot``) as ``torch.compile``-d steps (True) or op by op
            (False, the reference), exactly as :func:`~lightning_efficient.tokens.linear_cross_entropy`'s
            ``compile``: None follows :func:`~lightning_efficient.tokens.linear_ce.set_compile`
            (initially: compiled when ``tokens * vocab`` is at least ``2**25``); the choice, and a
            failure to compile (the eager step from then on), are said once per process, in lines
            that name ``streaming_cross_entropy``.

    Returns:
        A :class:`StreamedLoss`: the differentiable kept sum, and the detached losses, keep mask
        and scores (shaped like ``labels``).

    Raises:
        ValueError: for both or neither of ``threshold`` and ``keep``, an unknown score, ``"excess"``
            without reference losses, a ``keep`` or reference of the wrong shape, a chunk_size < 1, a
            compile other than True, False or None, or mismatched head shapes.
    """
    require((threshold is None) != (keep is None), "threshold", threshold, "exactly one of threshold and keep")
    require_choice("score", score, STREAM_SCORES)
    require(score != "excess" or reference_losses is not None, "reference_losses", reference_losses,
            "a tensor shaped like labels for score='excess'")
    if chunk_size is not None:
        require(isinstance(chunk_size, int) and chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1 or None")
    require(compile is None or isinstance(compile, bool), "compile", compile, "True, False or None")
    check_head_inputs(hidden, weight, labels, bias)
    if keep is not None:
        require(keep.shape == labels.shape, "keep", tuple(keep.shape), f"a bool mask of the labels' shape {tuple(labels.shape)}")
        keep = keep.reshape(-1).to(device=labels.device, dtype=torch.bool)
    reference = None
    if score == "excess":
        require(reference_losses.shape == labels.shape, "reference_losses", tuple(reference_losses.shape),
                f"a tensor of the labels' shape {tuple(labels.shape)}")
        reference = reference_losses.detach().reshape(-1).to(labels.device)
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    compiled = linear_ce._CHUNK_STEP.use_compiled(compile, flat_hidden.shape[0] * weight.shape[0], path=_PATH)
    chunk = chunk_size or auto_chunk_size(weight.shape[0], fused=compiled, hidden_size=weight.shape[1], device=weight.device)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        kept_sum, losses, kept, scores = _StreamingCrossEntropy.apply(
            flat_hidden, weight, bias, flat_labels, keep, threshold, reference, ignore_index, chunk, score, return_scores,
            compiled,
        )
        if scores.numel() == 0:
            scores = None
    else:  # no gradient wanted: the losses, scores and keep mask only
        kept_sum, losses, kept, scores, _ = _streamed_forward(
            flat_hidden, weight, bias, flat_labels, keep, threshold, reference, ignore_index, chunk, score, return_scores,
            (False, False, False), compiled,
        )
    shape = labels.shape
    return StreamedLoss(kept_sum, losses.view(shape), kept.view(shape), None if scores is None else scores.view(shape))
