"""How many samples a batch holds, read from the batch itself: the heterogeneous strategies weigh each rank's loss by it
(each rank's micro-batch is its own size), and the reports count samples with it."""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor, nn

_DEPTH = 4  # containers nested within a batch that are looked into
_TENSORS = 256  # tensors whose leading dimension is counted


def _batch_tensors(value: Any, depth: int = 0) -> Iterator[Tensor]:
    """The tensors in a batch: in mappings (a dict, Hugging Face's ``BatchEncoding``), lists, tuples (namedtuples),
    dataclasses and the attributes of another object (a batch class of the user's), up to :data:`_DEPTH` levels."""
    if isinstance(value, Tensor):
        yield value
        return
    if depth >= _DEPTH or isinstance(value, str | bytes | type | types.ModuleType | nn.Module):
        return
    if isinstance(value, Mapping):
        children = list(value.values())
    elif isinstance(value, list | tuple):
        children = list(value)
    elif dataclasses.is_dataclass(value):
        children = [getattr(value, field.name) for field in dataclasses.fields(value)]
    elif isinstance(getattr(value, "__dict__", None), dict):
        children = list(vars(value).values())
    else:
        return
    for child in children:
        yield from _batch_tensors(child, depth + 1)


def batch_samples(batch: Any) -> int | None:
    """The samples in ``batch``: the most common leading dimension of its tensors of one dimension or more (the first
    such on a tie), so that a 0-d value (a sequence length) or a per-batch table beside the samples does not decide it;
    for a list or tuple of strings or numbers (text tokenized in the step), its length; else None.

    A new user's trial: a dataclass batch, a ``BatchEncoding`` and a dict whose first value was 0-d were each counted as
    one sample, and hetero_ddp weighed every rank's loss by that, silently (weights 0.6 apart after a step).
    """
    leading = [t.shape[0] for t in itertools.islice((t for t in _batch_tensors(batch) if t.dim() >= 1), _TENSORS)]
    if leading:
        return Counter(leading).most_common(1)[0][0]
    if isinstance(batch, list | tuple) and batch and all(isinstance(item, str | bytes | int | float) for item in batch):
        return len(batch)
    return None
