"""Chunked linear cross-entropy: per-token losses of ``hidden @ weight.T + bias`` without the full logits.

The forward pass walks the tokens in chunks, holding one chunk's logits at a time, and keeps
only each token's log-sum-exp. For ``reduction="none"`` the backward pass recomputes a chunk's
logits *only for the tokens whose incoming gradient is nonzero*, so a loss that keeps a subset of
tokens (selection) pays the head's backward in proportion to the kept tokens: 1 + 3k matmul
passes at keep ratio k against 3 for full logits. For ``"mean"``/``"sum"`` every token's gradient is
known up to a scalar during the forward pass, so it is computed there (3 passes, as Liger-Kernel
does) and the backward pass only scales it.

Inputs may be float32, bfloat16, float16 or float64; softmax, losses and gradient accumulation
run in float32 (float64 for float64 inputs). Under autocast the logits come from the autocast
dtype's matmul, and the backward pass recomputes them under the same autocast state, so the
gradient is exactly that of the loss the forward pass returned. With gradients disabled
(``no_grad``, ``inference_mode``) or no input requiring one, only the losses are computed.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from lightning_efficient._validation import require, require_choice

_CHUNK_LOGITS_BYTES = 32 * 2**20


def auto_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so one chunk's float32 logits take about 32 MiB."""
    return max(16, _CHUNK_LOGITS_BYTES // (4 * vocab_size))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype) -> Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.to(acc)


def _softmax_grad(logits: Tensor, lse: Tensor, labels: Tensor, scale: Tensor) -> Tensor:
    """``scale * (softmax(logits) - onehot(labels))`` in place of ``logits``."""
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    return grad.mul_(scale.unsqueeze(1))


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The autocast state on ``device_type`` now, to re-enter around the backward's recomputation."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast_as(state: tuple[str, bool, torch.dtype]) -> contextlib.AbstractContextManager:
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _forward(hidden, weight, bias, labels, ignore_index, chunk_size, reduction, with_entropy, needs_grad):
    """The chunked forward pass. Returns ``(out, entropy, saved)``: the (reduced) losses, the
    entropies (or None) and the tensors the backward pass needs (None when ``needs_grad``, which
    of hidden, weight and bias need a gradient, is all false: then no gradient work is done)."""
    acc = _accumulation_dtype(hidden.dtype)
    n_tokens = hidden.shape[0]
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    any_grad = any(needs_grad)
    losses = torch.zeros(n_tokens, dtype=acc, device=hidden.device)
    lse = torch.zeros(n_tokens, dtype=acc, device=hidden.device) if any_grad else None
    entropy = torch.zeros(n_tokens, dtype=acc, device=hidden.device) if with_entropy else None
    n_valid = valid.sum()
    eager = reduction != "none" and any_grad
    if eager:
        scale = valid.to(acc) / (n_valid.clamp_min(1).to(acc) if reduction == "mean" else 1.0)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=acc) if needs_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and needs_grad[2] else None
    for start in range(0, n_tokens, chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        logits = _chunk_logits(h, weight, bias, acc)
        chunk_lse = torch.logsumexp(logits, dim=1)
        target = logits.gather(1, safe_labels[rows].unsqueeze(1)).squeeze(1)
        losses[rows] = torch.where(valid[rows], chunk_lse - target, torch.zeros_like(chunk_lse))
        if lse is not None:
            lse[rows] = chunk_lse
        if with_entropy:
            probs = torch.softmax(logits, dim=1)
            entropy[rows] = torch.where(valid[rows], chunk_lse - (probs * logits).sum(1), torch.zeros_like(chunk_lse))
        if eager:
            grad = _softmax_grad(logits, chunk_lse, safe_labels[rows], scale[rows]).to(hidden.dtype)
            grad_hidden[rows] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).to(acc)
            if grad_bias is not None:
                grad_bias += grad.sum(0).to(acc)
    if not any_grad:
        saved = None
    elif eager:
        saved = (grad_hidden, grad_weight, grad_bias)
    else:
        saved = (hidden, weight, bias, safe_labels, valid, lse)
    if reduction == "mean":
        out = losses.sum() / n_valid.clamp_min(1).to(acc)
    elif reduction == "sum":
        out = losses.sum()
    else:
        out = losses
    return out, entropy, saved


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_size, reduction, with_entropy):
        # the autocast state the logits are computed under: the backward recomputes them under it
        ctx.autocast = _autocast_state(hidden.device.type)
        out, entropy, saved = _forward(
            hidden, weight, bias, labels, ignore_index, chunk_size, reduction, with_entropy, ctx.needs_input_grad[:3]
        )
        ctx.reduction = reduction
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(*saved)
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
            return out, entropy
        return out

    @staticmethod
    def backward(ctx, grad_out, *grad_entropy):
        if ctx.reduction != "none":
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            scale = grad_out
            return (
                grad_hidden * scale.to(grad_hidden.dtype),
                None if grad_weight is None else grad_weight * scale,
                None if grad_bias is None else grad_bias * scale,
                None, None, None, None, None,
            )
        hidden, weight, bias, labels, valid, lse = ctx.saved_tensors
        acc = lse.dtype
        grad_out = grad_out.to(acc)
        kept = torch.nonzero(valid & (grad_out != 0)).squeeze(1)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if need_bias and bias is not None else None
        with _autocast_as(ctx.autocast):  # the forward's logits, bit for bit
            for start in range(0, len(kept), ctx.chunk_size):
                index = kept[start : start + ctx.chunk_size]
                h = hidden.index_select(0, index)
                logits = _chunk_logits(h, weight, bias, acc)
                grad = _softmax_grad(logits, lse[index], labels[index], grad_out[index]).to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden.index_copy_(0, index, (grad @ weight).to(grad_hidden.dtype))
                if grad_weight is not None:
                    grad_weight += (grad.t() @ h).to(acc)
                if grad_bias is not None:
                    grad_bias += grad.sum(0).to(acc)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None,
        )


def check_head_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> None:
    """Raise a ValueError unless ``hidden [..., d]``, ``weight [vocab, d]``, ``labels [...]`` and
    ``bias [vocab]`` fit together."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)} but labels has {tuple(labels.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "none",
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against ``labels``, chunk by chunk.

    Equals ``F.cross_entropy(hidden @ weight.T + bias, labels, ignore_index=..., reduction=...)``
    without ever holding the ``[tokens, vocab]`` logits (at most ``chunk_size`` rows of them).

    Args:
        hidden: ``[..., d]`` hidden states.
        weight: ``[vocab, d]`` output-head weight.
        labels: ``[...]`` target ids; ``ignore_index`` marks positions that do not count.
        bias: optional ``[vocab]`` head bias.
        ignore_index: the label of ignored positions (loss 0, no gradient).
        chunk_size: tokens per chunk; None picks about 32 MiB of float32 logits per chunk.
        reduction: ``"none"`` (per-token losses, shape of ``labels``; the backward pass works only on
            tokens with a nonzero incoming gradient), ``"mean"`` (over valid tokens) or ``"sum"``.
        return_entropy: also return each token's predictive entropy (no gradient; 0 where ignored).

    Returns:
        The losses (float32, or float64 for float64 inputs), and the entropies when asked.

    Raises:
        ValueError: for an unknown reduction, a chunk_size < 1, or mismatched shapes.
    """
    require_choice("reduction", reduction, ("none", "mean", "sum"))
    if chunk_size is not None:
        require(isinstance(chunk_size, int) and chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1 or None")
    check_head_inputs(hidden, weight, labels, bias)
    chunk = chunk_size or auto_chunk_size(weight.shape[0])
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        outputs = _LinearCrossEntropy.apply(
            flat_hidden, weight, bias, flat_labels, ignore_index, chunk, reduction, return_entropy
        )
        losses, entropy = outputs if return_entropy else (outputs, None)
    else:  # validation, inference, a frozen head: the losses only, no gradient work or buffers
        losses, entropy, _ = _forward(
            flat_hidden, weight, bias, flat_labels, ignore_index, chunk, reduction, return_entropy, (False, False, False)
        )
    if reduction == "none":
        losses = losses.view(labels.shape)
    if return_entropy:
        return losses, entropy.view(labels.shape)
    return losses
