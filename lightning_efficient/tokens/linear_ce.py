"""Chunked linear cross-entropy: per-token losses of ``hidden @ weight.T + bias`` without the full logits.

The forward pass walks the tokens in chunks, holding one chunk's logits at a time (the eager step:
the logits and their ``log_softmax`` in two ``[chunk, vocab]`` buffers reused by every chunk; the
compiled step keeps each token's log-sum-exp). For ``reduction="none"`` the backward pass recomputes a chunk's
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
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_efficient._validation import require, require_choice

_CHUNK_LOGITS_BYTES = 32 * 2**20
# the eager step's passes over a chunk's logits run in cache when the chunk is small: on the demo's
# head (vocabulary 8k, hidden 128, 2,048 tokens, one CPU thread) a mean's forward + backward took
# 164 ms at 256 rows (8 MiB) against 212 ms at 1,024 (32 MiB); but each chunk reads the weight (and
# reads and writes its gradient) once per matmul, so a chunk keeps at least 2 x hidden rows: at
# vocabulary 32k, hidden 512, 64 rows (8 MiB) took 1.6x the time of 256 (32 MiB)
_SMALL_CHUNK_LOGITS_BYTES = 8 * 2**20
# the compiled step streams each row through cache once, whatever the chunk's length, so its chunks
# are longer: fewer passes of the weight and its gradient through memory. Measured at vocabulary
# 32k, hidden 512, 8k tokens: 512 rows (64 MiB) at 0.05x of full logits' peak memory; 1,024 rows
# were not clearly faster and took 0.11x (before the matmul buffer was reused)
_FUSED_CHUNK_LOGITS_BYTES = 64 * 2**20


def auto_chunk_size(vocab_size: int, fused: bool = False, *, hidden_size: int | None = None,
                    device: torch.device | None = None) -> int:
    """Rows per chunk: for the compiled step, about 64 MiB of float32 logits; for the eager step on CUDA,
    32 MiB (fewer kernel launches); for the eager step elsewhere, about 8 MiB (a CPU's caches) but at least
    ``2 * hidden_size`` rows, and at most 32 MiB (at least 16 rows always)."""
    if fused:
        return max(16, _FUSED_CHUNK_LOGITS_BYTES // (4 * vocab_size))
    if device is not None and torch.device(device).type == "cuda":
        return max(16, _CHUNK_LOGITS_BYTES // (4 * vocab_size))
    rows = max(_SMALL_CHUNK_LOGITS_BYTES // (4 * vocab_size), 2 * (hidden_size or 0))
    return max(16, min(rows, _CHUNK_LOGITS_BYTES // (4 * vocab_size)))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype, out: Tensor | None = None) -> Tensor:
    """The chunk's logits in ``acc``, written into ``out`` (a reused ``[rows, vocab]`` buffer) where the
    matmul may write there (one dtype, no autocast); the same values either way."""
    if out is not None and out.dtype == acc and _plain_matmuls(out, hidden, weight):
        logits = torch.mm(hidden, weight.t(), out=out[: len(hidden)])
        return logits if bias is None else logits.add_(bias)
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.to(acc)


class _Workspace:
    """The eager chunk step's two ``[rows, vocab]`` buffers for one call, reused by every chunk: the
    logits (then the probabilities or the kept rows' gradient) and the log-probabilities.

    Fresh ``[chunk, vocab]`` tensors per chunk cost more than the arithmetic on them on CPU, where
    torch has no caching allocator: at 32 MiB each (1,024 rows at vocabulary 8k) every one was a new
    memory mapping, page-faulted in and unmapped again (about 24 ms per tensor on the shared 2-core
    machine, against 3.5 ms for an ``exp`` over it)."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = (rows, vocab), dtype, device
        self._logits: Tensor | None = None
        self._logp: Tensor | None = None

    @property
    def logits(self) -> Tensor:
        if self._logits is None:
            self._logits = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._logits

    @property
    def logp(self) -> Tensor:
        if self._logp is None:
            self._logp = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._logp


def _log_probs(logits: Tensor, out: Tensor | None) -> Tensor:
    """``log_softmax(logits)`` over the vocabulary (one fused pass per row), into ``out`` when given."""
    if out is None or out.dtype != logits.dtype:
        return torch.log_softmax(logits, dim=1)
    return torch.log_softmax(logits, dim=1, out=out[: len(logits)])


def _token_losses(logp: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """``-logp[label]`` per valid row, 0 elsewhere (``F.cross_entropy``'s arithmetic)."""
    losses = logp.gather(1, labels.unsqueeze(1)).squeeze(1).neg()
    return torch.where(valid, losses, torch.zeros_like(losses))


def _probs(logp: Tensor, out: Tensor | None) -> Tensor:
    """``exp(logp)``, into ``out`` when given (a buffer other than ``logp``'s)."""
    if out is None or out.dtype != logp.dtype:
        return torch.exp(logp)
    return torch.exp(logp, out=out[: len(logp)])


def _probs_and_entropy(logp: Tensor, valid: Tensor, out: Tensor | None) -> tuple[Tensor, Tensor]:
    """The probabilities (into ``out``) and the entropies ``-sum(p * logp)`` (0 where not valid);
    ``logp`` is overwritten."""
    probs = _probs(logp, out)
    entropy = logp.mul_(probs).sum(1).neg()
    return probs, torch.where(valid, entropy, torch.zeros_like(entropy))


def _minus_onehot(probs: Tensor, labels: Tensor, scale: Tensor | None = None) -> Tensor:
    """``scale * (probs - onehot(labels))`` in place of ``probs``: the logits' gradient."""
    probs[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    return probs if scale is None else probs.mul_(scale.unsqueeze(1))


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The autocast state on ``device_type`` now, to re-enter around the backward's recomputation."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast_as(state: tuple[str, bool, torch.dtype]) -> contextlib.AbstractContextManager:
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


# --- the chunk step: eager (the reference) and fused (the same arithmetic, for torch.compile) ---


def _eager_chunk_forward(h, weight, bias, labels, valid, scale, acc, grad_dtype, with_entropy, work=None):
    """One chunk of the forward pass, op by op: ``(losses, lse, entropy or None, grad or None)``.

    ``grad`` (when ``grad_dtype`` is given) is ``scale * (softmax - onehot(labels))`` in
    ``grad_dtype``, the chunk's logits gradient for a reduced loss (in ``work``'s buffer when the
    dtypes agree: use it before the next chunk). ``lse`` is None: the eager backward recomputes
    the log-probabilities instead. Losses are ``-log_softmax[label]`` as ``F.cross_entropy``'s.
    """
    logits = _chunk_logits(h, weight, bias, acc, None if work is None else work.logits)
    logp = _log_probs(logits, None if work is None else work.logp)
    losses = _token_losses(logp, labels, valid)
    probs = entropy = None
    if with_entropy:
        probs, entropy = _probs_and_entropy(logp, valid, None if work is None else work.logits)
    grad = None
    if grad_dtype is not None:
        if probs is None:
            probs = _probs(logp, None if work is None else work.logits)
        grad = _minus_onehot(probs, labels, scale).to(grad_dtype)
    return losses, None, entropy, grad


def _eager_chunk_grad(h, weight, bias, lse, labels, scale, acc, grad_dtype, work=None):
    """One chunk of the ``reduction="none"`` backward: ``scale * (softmax - onehot)`` in ``grad_dtype``,
    from the recomputed logits' log-probabilities (``lse``, the compiled step's, is not needed)."""
    logits = _chunk_logits(h, weight, bias, acc, None if work is None else work.logits)
    logp = _log_probs(logits, None if work is None else work.logp)
    return _minus_onehot(_probs(logp, None if work is None else work.logits), labels, scale).to(grad_dtype)


def _fused_logits(mm: Tensor, bias: Tensor | None, acc: torch.dtype) -> Tensor:
    return (mm if bias is None else mm + bias).to(acc)


def _fused_probs_grad(logits, lse, labels, scale, grad_dtype):
    # where(target, p - 1, p) * scale: the eager step's arithmetic, in one pass over the row
    probs = torch.exp(logits - lse.unsqueeze(1))
    columns = torch.arange(logits.shape[1], device=logits.device)
    onehot = columns.unsqueeze(0) == labels.unsqueeze(1)
    return (torch.where(onehot, probs - 1.0, probs) * scale.unsqueeze(1)).to(grad_dtype)


def _fused_chunk_forward(mm, bias, labels, valid, scale, acc, grad_dtype, with_entropy):
    """The compiled step's elementwise work on the chunk's matmul ``mm`` (losses as ``lse - target``; the eager
    step's are ``-log_softmax[target]``: equal within rounding), written out of place so that the compiler
    fuses it into a few passes over each row."""
    logits = _fused_logits(mm, bias, acc)
    lse = torch.logsumexp(logits, dim=1)
    zero = torch.zeros_like(lse)
    target = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    losses = torch.where(valid, lse - target, zero)
    entropy = None
    if with_entropy:
        probs = torch.exp(logits - lse.unsqueeze(1))
        entropy = torch.where(valid, lse - (probs * logits).sum(1), zero)
    grad = None if grad_dtype is None else _in_place(mm, _fused_probs_grad(logits, lse, labels, scale, grad_dtype))
    return losses, lse, entropy, grad


def _fused_chunk_grad(mm, bias, lse, labels, scale, acc, grad_dtype):
    """The elementwise part of :func:`_eager_chunk_grad` on the chunk's matmul ``mm``."""
    return _in_place(mm, _fused_probs_grad(_fused_logits(mm, bias, acc), lse, labels, scale, grad_dtype))


def _in_place(mm: Tensor, grad: Tensor) -> Tensor:
    # the gradient overwrites the chunk's matmul (a temporary) when their dtypes agree: one
    # [chunk, vocab] buffer instead of two
    return mm.copy_(grad) if mm.dtype == grad.dtype else grad


# below this many logits per call (tokens x vocab) the eager step runs under compile=None: each
# graph's first call compiles for seconds (tens on a cold cache, two cores), more than fusing saves
# on a small head in a short run; the demo (2,048 tokens x 8,192) stays below, 8k tokens x 32k above
_AUTO_COMPILE_MIN_LOGITS = 2**25
_COMPILE_DEFAULT: bool | None = None


def set_compile(compile: bool | None) -> None:
    """Set the process default for :func:`linear_cross_entropy`'s ``compile=None``.

    Args:
        compile: True compiles the chunk step (falling back to the eager step, with one warning,
            where compilation fails), False always runs the eager step, None (the initial
            setting) compiles when the head has at least ``2**25`` logits (tokens x vocabulary) per call.

    Raises:
        ValueError: when ``compile`` is not True, False or None.
    """
    global _COMPILE_DEFAULT
    require(compile is None or isinstance(compile, bool), "compile", compile, "True, False or None")
    _COMPILE_DEFAULT = compile


class _ChunkStep:
    """Which chunk step runs, chosen once per process: the compiled one is tried on first use and,
    on any failure, the eager one runs from then on. Each choice is said once per path (the
    function whose chunk step it is: ``linear_cross_entropy`` or ``streaming_cross_entropy``)."""

    def __init__(self) -> None:
        self.failed: str | None = None  # why compiling failed, once it has
        self._compiled: dict[str, object] = {}
        self._said: set[tuple[str, str]] = set()

    def _say(self, what: str, path: str) -> None:
        if (path, what) not in self._said:
            self._said.add((path, what))
            rank_zero_info(f"{path}: the chunk step runs {what}")

    def use_compiled(self, compile: bool | None, n_logits: int, path: str = "linear_cross_entropy") -> bool:
        """Whether this call of ``path`` runs the compiled step (False once compiling has failed)."""
        if compile is None:
            compile = _COMPILE_DEFAULT
        if compile is None:
            compile = n_logits >= _AUTO_COMPILE_MIN_LOGITS
        if compile and self.failed is None:
            return True
        self._say("eager" + (" (compiling failed)" if compile else ""), path)
        return False

    def run(self, name: str, fused, args: tuple, rows: tuple[int, ...], fallback, path: str = "linear_cross_entropy"):
        """``fused(*args)`` compiled or, once compiling has failed, ``fallback()`` (the eager step).
        ``rows`` are the positions of the tensors in ``args`` whose first dimension is the chunk's
        rows: it is marked dynamic, so one graph serves every chunk length. ``path`` is the function
        the step belongs to, as the log line names it."""
        if self.failed is None:
            try:
                for index in rows:
                    torch._dynamo.maybe_mark_dynamic(args[index], 0)
                if name not in self._compiled:
                    self._compiled[name] = torch.compile(fused, fullgraph=True)
                out = self._compiled[name](*args)
                self._say("compiled (torch.compile)", path)
                return out
            except Exception as error:  # noqa: BLE001 - whatever the compiler raises, the eager step runs
                message = str(error).strip().splitlines()
                self.failed = type(error).__name__ + (f": {message[0]}" if message else "")
                rank_zero_warn(
                    f"{path}: compiling the chunk step failed ({self.failed}); "
                    "the eager step runs from now on in this process."
                )
        return fallback()


_CHUNK_STEP = _ChunkStep()


def _head_matmul(h: Tensor, weight: Tensor, buffer: Tensor | None) -> Tensor:
    """``h @ weight.T``, written into ``buffer`` (one per call, reused by every chunk: no fresh
    ``[chunk, vocab]`` allocation per chunk) where the dtypes allow it."""
    if buffer is not None and _plain_matmuls(buffer, h, weight):
        return torch.mm(h, weight.t(), out=buffer[: len(h)])
    return h @ weight.t()


def _chunk_buffer(compiled: bool, hidden: Tensor, weight: Tensor, rows: int) -> Tensor | None:
    """The compiled step's reused ``[rows, vocab]`` matmul output (None where it would go unused)."""
    if not (compiled and rows and _plain_matmuls(hidden, weight)):
        return None
    return torch.empty(rows, weight.shape[0], dtype=hidden.dtype, device=hidden.device)


def _chunk_forward(compiled, h, weight, bias, labels, valid, scale, acc, grad_dtype, with_entropy, buffer=None, work=None):
    """One forward chunk, compiled (into ``buffer``) or eager (in ``work``): ``(losses, lse or None,
    entropy or None, grad or None)``."""
    eager_args = (h, weight, bias, labels, valid, scale, acc, grad_dtype, with_entropy)
    if not compiled:
        return _eager_chunk_forward(*eager_args, work)
    args = (_head_matmul(h, weight, buffer), bias, labels, valid, scale, acc, grad_dtype, with_entropy)
    rows = (0, 2, 3) if scale is None else (0, 2, 3, 4)
    return _CHUNK_STEP.run("forward", _fused_chunk_forward, args, rows, lambda: _eager_chunk_forward(*eager_args))


def _chunk_grad(compiled, h, weight, bias, lse, labels, scale, acc, grad_dtype, buffer=None, work=None):
    """One backward chunk of ``reduction="none"``, compiled (into ``buffer``) or eager (in ``work``):
    the logits' gradient."""
    eager_args = (h, weight, bias, lse, labels, scale, acc, grad_dtype)
    if not compiled:
        return _eager_chunk_grad(*eager_args, work)
    args = (_head_matmul(h, weight, buffer), bias, lse, labels, scale, acc, grad_dtype)
    return _CHUNK_STEP.run("grad", _fused_chunk_grad, args, (0, 2, 3, 4), lambda: _eager_chunk_grad(*eager_args))


def _plain_matmuls(*tensors: Tensor) -> bool:
    """True when a matmul of these may write into a preallocated output: one dtype, no autocast."""
    return len({t.dtype for t in tensors}) == 1 and not torch.is_autocast_enabled(tensors[0].device.type)


def _accumulate_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b``, without a temporary ``[vocab, d]`` product where the dtypes allow it."""
    if _plain_matmuls(out, a, b):
        out.addmm_(a, b)
    else:
        out += (a @ b).to(out.dtype)


def _matmul_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out[...] = a @ b``, written in place where the dtypes allow it."""
    if _plain_matmuls(out, a, b):
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


def _forward(hidden, weight, bias, labels, ignore_index, chunk_size, reduction, with_entropy, needs_grad, compile=False):
    """The chunked forward pass. Returns ``(out, entropy, saved)``: the (reduced) losses, the
    entropies (or None) and the tensors the backward pass needs (None when ``needs_grad``, which
    of hidden, weight and bias need a gradient, is all false: then no gradient work is done).
    ``compile`` says whether the chunk step runs compiled."""
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
    scale = None
    if eager:
        scale = valid.to(acc) / (n_valid.clamp_min(1).to(acc) if reduction == "mean" else 1.0)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=acc) if needs_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and needs_grad[2] else None
    buffer = _chunk_buffer(compile, hidden, weight, min(chunk_size, n_tokens))
    work = None if compile else _Workspace(min(chunk_size, n_tokens), weight.shape[0], acc, hidden.device)
    for start in range(0, n_tokens, chunk_size):
        rows = slice(start, start + chunk_size)
        h = hidden[rows]
        chunk_losses, chunk_lse, chunk_entropy, grad = _chunk_forward(
            compile, h, weight, bias, safe_labels[rows], valid[rows], None if scale is None else scale[rows],
            acc, hidden.dtype if eager else None, with_entropy, buffer, work,
        )
        losses[rows] = chunk_losses
        if lse is not None and chunk_lse is not None:  # (the compiled step's: its backward reads it)
            lse[rows] = chunk_lse
        if with_entropy:
            entropy[rows] = chunk_entropy
        if eager:
            _matmul_into(grad_hidden[rows], grad, weight)
            if grad_weight is not None:
                _accumulate_matmul(grad_weight, grad.t(), h)
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
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_size, reduction, with_entropy, compiled):
        # the autocast state the logits are computed under: the backward recomputes them under it
        ctx.autocast = _autocast_state(hidden.device.type)
        out, entropy, saved = _forward(
            hidden, weight, bias, labels, ignore_index, chunk_size, reduction, with_entropy, ctx.needs_input_grad[:3],
            compiled,
        )
        ctx.reduction = reduction
        ctx.chunk_size = chunk_size
        ctx.compiled = compiled
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
                None, None, None, None, None, None,
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
            buffer = _chunk_buffer(ctx.compiled, hidden, weight, min(ctx.chunk_size, len(kept)))
            work = None if ctx.compiled else _Workspace(min(ctx.chunk_size, len(kept)), weight.shape[0], acc, hidden.device)
            for start in range(0, len(kept), ctx.chunk_size):
                index = kept[start : start + ctx.chunk_size]
                h = hidden.index_select(0, index)
                grad = _chunk_grad(
                    ctx.compiled, h, weight, bias, lse[index], labels[index], grad_out[index], acc, hidden.dtype, buffer,
                    work,
                )
                if grad_hidden is not None:
                    grad_hidden.index_copy_(0, index, (grad @ weight).to(grad_hidden.dtype))
                if grad_weight is not None:
                    _accumulate_matmul(grad_weight, grad.t(), h)
                if grad_bias is not None:
                    grad_bias += grad.sum(0).to(acc)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None, None,
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
    compile: bool | None = None,
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
        chunk_size: tokens per chunk; None picks :func:`auto_chunk_size`'s: about 8 MiB of float32
            logits per chunk, at least ``2 * d`` rows and at most 32 MiB (64 MiB when the step runs compiled).
        reduction: ``"none"`` (per-token losses, shape of ``labels``; the backward pass works only on
            tokens with a nonzero incoming gradient), ``"mean"`` (over valid tokens) or ``"sum"``.
        return_entropy: also return each token's predictive entropy (no gradient; 0 where ignored).
        compile: run the chunk's elementwise work (log-sum-exp, target, entropy, softmax gradient)
            as one ``torch.compile``-d step (True) or op by op (False, the reference). None (the
            default) follows :func:`set_compile`, initially: compiled when ``tokens * vocab`` is at
            least ``2**25``. The first compiled call compiles (seconds); should compiling fail,
            the eager step runs from then on in the process, with one warning. Which step runs is
            logged once (``"linear_cross_entropy: the chunk step runs ..."``; the streaming head's
            calls say theirs under ``streaming_cross_entropy``).

    Returns:
        The losses (float32, or float64 for float64 inputs), and the entropies when asked.

    Raises:
        ValueError: for an unknown reduction, a chunk_size < 1, a compile other than True, False
            or None, or mismatched shapes.
    """
    require_choice("reduction", reduction, ("none", "mean", "sum"))
    require(compile is None or isinstance(compile, bool), "compile", compile, "True, False or None")
    if chunk_size is not None:
        require(isinstance(chunk_size, int) and chunk_size >= 1, "chunk_size", chunk_size, "an integer >= 1 or None")
    check_head_inputs(hidden, weight, labels, bias)
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    compiled = _CHUNK_STEP.use_compiled(compile, flat_hidden.shape[0] * weight.shape[0])
    chunk = chunk_size or auto_chunk_size(weight.shape[0], fused=compiled, hidden_size=weight.shape[1], device=weight.device)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        outputs = _LinearCrossEntropy.apply(
            flat_hidden, weight, bias, flat_labels, ignore_index, chunk, reduction, return_entropy, compiled
        )
        losses, entropy = outputs if return_entropy else (outputs, None)
    else:  # validation, inference, a frozen head: the losses only, no gradient work or buffers
        losses, entropy, _ = _forward(
            flat_hidden, weight, bias, flat_labels, ignore_index, chunk, reduction, return_entropy, (False, False, False),
            compiled,
        )
    if reduction == "none":
        losses = losses.view(labels.shape)
    if return_entropy:
        return losses, entropy.view(labels.shape)
    return losses
