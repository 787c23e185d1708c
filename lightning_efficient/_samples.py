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


_ID_DTYPES = (torch.int32, torch.int64)  # (uint8 images, int16 audio: data, not ids)
_ID_NAMES = ("input_ids", "token_ids", "ids", "tokens", "input")


def _is_ids(tensor: Any) -> bool:
    """Whether ``tensor`` reads as ``[samples, sequence]`` token ids: 2-D, int32 or int64, longer than one a row."""
    return isinstance(tensor, Tensor) and tensor.dim() == 2 and tensor.dtype in _ID_DTYPES and tensor.shape[1] > 1


def _named_ids(batch: Any) -> Tensor | None:
    """The token ids a mapping (a ``BatchEncoding`` too) or dataclass batch names: ``input_ids``, ``*_ids``, ..."""
    if isinstance(batch, Mapping):
        items = list(itertools.islice(batch.items(), _ITEMS))
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [(f.name, getattr(batch, f.name, None)) for f in dataclasses.fields(batch)][:_ITEMS]
    else:
        return None
    return next((value for name, value in items if isinstance(name, str) and (name in _ID_NAMES or name.endswith("_ids"))
                 and _is_ids(value)), None)


def token_ids(batch: Any) -> Tensor | None:
    """The batch's ``[samples, sequence]`` token ids (int32/int64), or None for a batch without them: its named ids
    (``input_ids``, ``*_ids``: :func:`_named_ids`), else the first integer 2-D tensor of the samples, unless a float
    tensor of two or more dimensions comes before it (features or images first: integer tensors after them are labels).
    Masks (bool), 1-D values, uint8 images and int16 audio are not ids. A new user's trial: an MLP's float features
    were counted as its tokens, a plan's "tokens/s" its features a second; a review: class labels beside features,
    uint8 images, a bool mask before the ids."""
    named = _named_ids(batch)
    if named is not None:
        return named
    tensors = list(_tensors(batch))
    samples = _first_samples(tensors)  # (as batch_samples reads them)
    for tensor in tensors:
        if tensor.dtype == torch.bool or tensor.dim() < 2:
            continue
        if _is_ids(tensor) and _leading(tensor) == samples:
            return tensor
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dim() > 2 or tensor.dtype not in _ID_DTYPES:
            return None
    return None
