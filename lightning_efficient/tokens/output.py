"""What a ``training_step`` returns to opt into token selection.

A module returns :class:`TokenLosses` (per-token losses plus the mask of valid positions). It is a
``dict`` so that Lightning and DDP treat it as the usual ``{"loss": ...}`` output: without any
plugin, ``"loss"`` is the plain mean over the valid tokens. When :class:`SelectiveTokenLoss` is
attached it reads the per-token losses instead and computes the step loss itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from lightning_efficient.tokens.linear_ce import check_head_inputs, linear_cross_entropy
from lightning_efficient.tokens.normalize import kept_loss_sum
from lightning_efficient.tokens.streaming import StreamedLoss, streaming_cross_entropy

_REDUCTION_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("reduction_deferred", default=False)


@contextlib.contextmanager
def deferred_reduction() -> Iterator[None]:
    """Within this context, token-loss outputs skip computing their default mean ``"loss"``.

    The selective-loss callback runs the module's ``training_step`` inside it, because it computes
    the step loss itself; outside it every output carries the plain mean as ``"loss"``.
    """
    token = _REDUCTION_DEFERRED.set(True)
    try:
        yield
    finally:
        _REDUCTION_DEFERRED.reset(token)


def masked_mean(losses: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``losses`` over the positions where ``mask`` is true (0 when none is)."""
    total = torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)).sum()
    return total / mask.sum().clamp_min(1)


def loss_sum_and_count(output: object) -> tuple[Tensor, Tensor] | None:
    """The valid tokens' loss sum and count of a :class:`TokenLosses` or :class:`FusedTokenLoss` output with its plain
    mean ``"loss"`` (None for any other output): what a step's token mean over several micro-batches is built from.
    A fused output's sum is its mean times the count, so the gradients its forward computed are kept."""
    if isinstance(output, TokenLosses) and "loss" in output:  # the exact sum, not one rebuilt from a rounded mean
        return kept_loss_sum(output.token_losses, output.mask), output.mask.sum()
    if isinstance(output, FusedTokenLoss) and "loss" in output:
        count = output.mask.sum()
        return output["loss"] * count, count
    return None


def _carries_history(value: object) -> bool:
    return isinstance(value, Tensor) and value.grad_fn is not None


def _flatten_output(output: dict) -> tuple[list[object], tuple[tuple[object, ...], dict[object, object], dict[str, object]]]:
    """The output's tensors with autograd history as pytree children; everything else (a FusedTokenLoss's head weight,
    masks, labels, its attributes) stays in the context, so DDP copies only what its synchronising function needs."""
    children = [value for value in output.values() if _carries_history(value)]
    rest = {key: value for key, value in output.items() if not _carries_history(value)}
    return children, (tuple(output.keys()), rest, dict(vars(output)))


def _output_unflattener(cls: type[dict]) -> Callable[[list[object], tuple[tuple[object, ...], dict[object, object], dict[str, object]]], dict]:
    def unflatten(children: list[object], context: tuple[tuple[object, ...], dict[object, object], dict[str, object]]) -> dict:
        keys, rest, attributes = context
        output = cls.__new__(cls)  # (not __init__: the keys are as they were, a loss computed or deferred alike)
        given = iter(children)
        dict.update(output, {key: rest[key] if key in rest else next(given) for key in keys})
        vars(output).update(attributes)
        return output

    return unflatten


def register_output_pytree(cls: type[dict]) -> None:
    """Make a training-step output class a pytree node whose children are its tensors with autograd history.

    DistributedDataParallel passes the tensors of a forward's output through its synchronising autograd function (under
    static_graph=True, the one whose first backward queues the gradients' all-reduce) by flattening the output, and a
    dict subclass it does not know is one leaf of no tensor. A review: DDP(static_graph=True) with a TokenLosses output,
    with or without a plugin, never synchronised the ranks' gradients (0.3 apart every step). Subclasses register
    themselves (torch looks a node up by its exact type)."""
    if cls not in torch.utils._pytree.SUPPORTED_NODES:
        torch.utils._pytree.register_pytree_node(cls, _flatten_output, _output_unflattener(cls),
                                                 serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


class _PytreeOutput:
    """A training-step output class registered as a pytree node, its subclasses too (:func:`register_output_pytree`)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        register_output_pytree(cls)


class TokenLosses(_PytreeOutput, dict):
    """Unreduced per-token losses of one batch, as a ``training_step`` output.

    Keys: ``"token_losses"`` (float ``[batch, seq]``), ``"mask"`` (bool ``[batch, seq]``, true where
    the token counts) and, unless a plugin computes the step loss itself, ``"loss"``: the mean over
    valid tokens (where a plugin does, ``out["loss"]`` still reads that mean, detached, for logging). Extra keyword
    arguments are kept as further keys (Lightning passes them on to ``on_train_batch_end`` detached).

    Args:
        token_losses: per-token losses; ignored positions may hold any finite value.
        mask: which positions are valid; all of them when omitted.
        **extra: further outputs to carry along.

    Raises:
        TypeError: when ``token_losses`` is not a floating tensor with at least one dimension.
        ValueError: when ``mask`` does not have the shape of ``token_losses``.
    """

    #: the keys that carry the losses themselves (the rest are extra outputs)
    LOSS_KEYS = ("token_losses", "mask", "loss")

    def __init__(self, token_losses: Tensor, mask: Tensor | None = None, **extra: object) -> None:
        if not isinstance(token_losses, Tensor) or not token_losses.is_floating_point() or token_losses.dim() == 0:
            raise TypeError(
                "token_losses must be a floating tensor of per-token losses with shape [batch, seq], "
                f"got {type(token_losses).__name__} {getattr(token_losses, 'shape', '')}"
            )
        if mask is None:
            mask = torch.ones_like(token_losses, dtype=torch.bool)
        if mask.shape != token_losses.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)} but token_losses has {tuple(token_losses.shape)}")
        super().__init__(token_losses=token_losses, mask=mask.bool(), **extra)
        if not _REDUCTION_DEFERRED.get():
            self["loss"] = masked_mean(token_losses, self["mask"])

    @property
    def token_losses(self) -> Tensor:
        """The per-token losses."""
        return self["token_losses"]

    @property
    def mask(self) -> Tensor:
        """True where a token counts."""
        return self["mask"]

    def extra(self) -> dict[str, object]:
        """The further outputs given as keyword arguments."""
        return {k: v for k, v in self.items() if k not in self.LOSS_KEYS}

    def __missing__(self, key: str) -> Tensor:
        # a plugin computes the step loss itself: ``out["loss"]`` read inside training_step (to log it) is the plain
        # mean, detached, and is not stored (``"loss" in out`` stays false, as the plugin needs)
        if key != "loss":
            raise KeyError(key)
        with torch.no_grad():
            return masked_mean(self["token_losses"], self["mask"])


class FusedTokenLoss(_PytreeOutput, dict):
    """Hidden states, output head and labels, as a ``training_step`` output: the fused path.

    The per-token losses are computed by :func:`~lightning_efficient.tokens.linear_cross_entropy`,
    which never builds the ``[tokens, vocab]`` logits. Without any plugin, ``"loss"`` is the mean
    over valid tokens (gradients computed during the forward pass, as Liger-Kernel does). With
    :class:`SelectiveTokenLoss` attached, the head's backward pass runs only for the kept tokens (on
    its streaming path, the kept tokens' gradients are computed during the forward pass, at a threshold
    known before it: :meth:`streamed_losses`); ``out["loss"]`` read inside ``training_step`` is then the
    plain mean, detached, computed by one more pass of the head without gradients.

    Args:
        hidden: ``[batch, seq, d]`` hidden states, the head's input.
        weight: ``[vocab, d]`` head weight.
        labels: ``[batch, seq]`` target ids; ``ignore_index`` marks invalid positions.
        bias: optional ``[vocab]`` head bias.
        ignore_index: the label of ignored positions.
        chunk_size: tokens per chunk of logits (None: :func:`~lightning_efficient.tokens.linear_ce.auto_chunk_size`'s).
        **extra: further outputs to carry along.

    Raises:
        ValueError: when hidden, weight, labels and bias shapes do not fit together.
    """

    #: the keys that carry the head inputs and the loss (the rest are extra outputs)
    LOSS_KEYS = ("hidden", "weight", "labels", "mask", "loss")

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None = None,
        ignore_index: int = -100,
        chunk_size: int | None = None,
        **extra: object,
    ) -> None:
        check_head_inputs(hidden, weight, labels, bias)
        super().__init__(hidden=hidden, weight=weight, labels=labels, mask=labels != ignore_index, **extra)
        self.bias = bias
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        if not _REDUCTION_DEFERRED.get():
            self["loss"] = self._cross_entropy("mean")

    @property
    def mask(self) -> Tensor:
        """True where a token counts."""
        return self["mask"]

    def extra(self) -> dict[str, object]:
        """The further outputs given as keyword arguments."""
        return {k: v for k, v in self.items() if k not in self.LOSS_KEYS}

    def __missing__(self, key: str) -> Tensor:
        # as TokenLosses': under a plugin that computes the step loss, the plain mean for logging (one more pass
        # of the head, without gradients, each time it is read)
        if key != "loss":
            raise KeyError(key)
        with torch.no_grad():
            return self._cross_entropy("mean")

    @property
    def vocab_size(self) -> int:
        """Rows of the head weight."""
        return self["weight"].shape[0]

    def _cross_entropy(self, reduction: str, return_entropy: bool = False):
        return linear_cross_entropy(
            self["hidden"], self["weight"], self["labels"], self.bias, self.ignore_index, self.chunk_size,
            reduction, return_entropy,
        )

    def token_losses(self, return_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Per-token losses ``[batch, seq]`` (and entropies); the backward pass skips zero-gradient tokens."""
        return self._cross_entropy("none", return_entropy)

    def streamed_losses(
        self,
        *,
        threshold: float | Tensor | None = None,
        keep: Tensor | None = None,
        score: str = "loss",
        reference_losses: Tensor | None = None,
        return_scores: bool = False,
    ) -> StreamedLoss:
        """The kept tokens' loss sum, selected while the head streams (see
        :func:`~lightning_efficient.tokens.streaming.streaming_cross_entropy`, whose keyword arguments
        these are): each chunk's logits once, the kept tokens' gradients in the same pass."""
        return streaming_cross_entropy(
            self["hidden"], self["weight"], self["labels"], self.bias, self.ignore_index, self.chunk_size,
            threshold=threshold, keep=keep, score=score, reference_losses=reference_losses, return_scores=return_scores,
        )


class NormalisedTokenLoss(_PytreeOutput, dict):
    """The step loss :class:`~lightning_efficient.tokens.SelectiveTokenLoss` returns in place of the
    module's ``training_step`` output.

    Keys: ``"loss"`` (its gradient already weighted so that the step's gradient is the mean over every kept
    token of the step, see :class:`~lightning_efficient.tokens.normalize.StepTokenNormaliser`; its value the
    micro-batch's mean over its kept tokens on this rank),
    ``"mask"`` (the valid tokens), ``"keep"`` (the kept ones) and the module output's extra keys.
    A strategy that re-weights token losses itself (``hetero_ddp``) recognises it by type and
    leaves it as it is.
    """
