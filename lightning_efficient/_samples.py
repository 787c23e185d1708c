"""How many samples a batch holds, read from the batch itself, for the figures that count samples (MemoryReport,
ActivationMemory's plan). The heterogeneous strategies weigh each rank's loss by the size their plan gives each
micro-batch, and only check it against this."""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

_LOOKED_AT = 4096  # values looked at in a batch at most (a batch that holds a tokenizer or raw text is not walked whole)
_ITEMS = 64  # items looked at in one container


def _children(value: Any) -> list[Any]:
    """What a batch's container holds: a mapping's values (a dict, Hugging Face's ``BatchEncoding``), a list's or tuple's
    items (a namedtuple), a dataclass's fields, another object's attributes (a batch class of the user's)."""
    if isinstance(value, str | bytes | type | types.ModuleType | nn.Module):
        return []
    if isinstance(value, Mapping):
        return list(itertools.islice(value.values(), _ITEMS))
    if isinstance(value, list | tuple):
        return list(value[:_ITEMS])
    if dataclasses.is_dataclass(value):
        return [getattr(value, field.name, None) for field in dataclasses.fields(value)][:_ITEMS]
    namespace = getattr(value, "__dict__", None)
    return list(itertools.islice(namespace.values(), _ITEMS)) if isinstance(namespace, dict) else []


def _tensors(batch: Any) -> Iterator[Tensor]:
    """The tensors a batch holds, the shallowest first, as they are found (at most :data:`_LOOKED_AT` values looked
    at; a value that cannot be read is passed over)."""
    queue, looked = deque([batch]), 0
    while queue and looked < _LOOKED_AT:
        value = queue.popleft()
        looked += 1
        if isinstance(value, Tensor):
            yield value
            continue
        try:
            queue.extend(_children(value))
        except Exception:  # noqa: BLE001 - a value that cannot be read decides nothing
            continue


def _leading(tensor: Tensor) -> int | None:
    """``tensor``'s samples: its leading dimension (None for a 0-d tensor, or a nested tensor's unreadable shape)."""
    try:
        return int(tensor.shape[0]) if tensor.dim() >= 1 else None
    except Exception:  # noqa: BLE001 - a value that cannot be read (a nested tensor's shape) decides nothing
        return None


def _first_samples(tensors: Any) -> int | None:
    """The leading dimension of the first of ``tensors`` that has one."""
    return next((n for n in map(_leading, tensors) if n is not None), None)


def batch_samples(batch: Any) -> int | None:
    """The samples in ``batch``: the leading dimension of its first tensor of one dimension or more, the shallowest
    first (so a 0-d value, a sequence length, listed before the samples does not decide it, nor do per-sample targets in
    a list beside them); for a list or tuple of strings or numbers (text tokenized in the step), its length; else None.

    A new user's trial: a dataclass batch, a ``BatchEncoding`` and a dict whose first value was 0-d were each counted as
    one sample.
    """
    samples = _first_samples(_tensors(batch))
    if samples is not None:
        return samples
    if isinstance(batch, list | tuple) and batch and all(isinstance(item, str | bytes | int | float) for item in batch):
        return len(batch)
    return None


def token_ids(batch: Any) -> Tensor | None:
    """The batch's token ids: its :func:`token_tensor` where that holds integers in two or more dimensions, None else (a
    batch of float features, images, 1-D values: a new user's trial, an MLP's "tokens/s" in the AutoFit plan and in
    ``MemoryReport`` were its features a second)."""
    tensor = token_tensor(batch)
    if tensor is None or tensor.dim() < 2 or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        return None
    return tensor


def token_tensor(batch: Any) -> Tensor | None:
    """The tensor of a batch whose rows are its samples' tokens: a ``[samples, sequence]`` tensor (integer ids before
    others), else the batch's first tensor; None without one. A batch whose first tensor is a 1-D index or label beside
    its token ids counted one token a sample (a new user's trial: a plan's tokens/s were its samples/s); images, packed
    1-D ids and masks of more dimensions are read as before, by the first tensor."""
    tensors = list(_tensors(batch))
    samples = _first_samples(tensors)  # (as batch_samples reads them)
    rows = [t for t in tensors if t.dim() == 2 and _leading(t) == samples]
    return next((t for t in rows if not t.is_floating_point()), rows[0] if rows else (tensors[0] if tensors else None))
