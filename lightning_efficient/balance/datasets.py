"""Whether every rank holds the same training dataset: the heterogeneous strategies draw each rank's share of a global
batch by index from one dataset that every rank holds whole."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from lightning_efficient._distributed import gather_or_raise_together
from lightning_efficient._torch import random_streams_restored

IDENTITY_WORDS = {"class": "classes", "length": "lengths", "samples": "first and last samples",
                  "subset indices": "Subset indices (from a random_split? give it a seeded generator)"}
READS = 4  # reads of each compared sample that must agree (a 50% flip from a generator of its own: all 4 alike 1 in 8)
UNCOMPARABLE = "they hold objects other than tensors, arrays, numbers, strings, dataclasses and containers of them"


def check_same_dataset(name: str, dataloader: DataLoader, world: int, distributed_sampler: bool) -> None:
    """Refuse training datasets that differ between the ``world`` ranks: a rank's own part of the data
    (``use_distributed_sampler=False`` over a ``Subset`` per rank, a new user's trial) trained the part of it the
    strategy meant for that rank, and the rest of every rank's part never.

    Told apart by class, length and the indices of each ``Subset``; with ``distributed_sampler=False`` (where a rank's
    own part is what plain Lightning would train) also by the first and last samples, where this process reads the
    samples anyway (no DataLoader workers: a file a dataset opens on its first read would otherwise be open before the
    workers fork), read under the same seeds on every rank. Every rank raises together, also where a read raised on one.
    """
    if world == 1:
        return
    read_samples = not distributed_sampler and dataloader.num_workers == 0
    identity, error = None, None
    try:
        identity = dataset_identity(dataloader.dataset, read_samples)
    except Exception as failure:  # noqa: BLE001 - every rank learns of it and raises it together
        error = failure
    identities = gather_or_raise_together(identity, error, f"{name} could not compare the ranks' training datasets")
    for key in identities[0]:
        values = [identity[key] for identity in identities]
        if key == "samples" and any(isinstance(value, str) for value in values):  # not comparable on some rank
            continue
        if any(value != values[0] for value in values):
            _refuse(name, key, values)
    if not distributed_sampler:
        unread = "DataLoader workers read them, not this process" if not read_samples else next(
            (identity["samples"] for identity in identities if isinstance(identity["samples"], str)), None)
        if unread is not None:
            rank_zero_warn(f"{name}: with use_distributed_sampler=False every rank's training DataLoader must still hold "
                           f"the same, whole dataset, which {name} splits by shares; the ranks' datasets were compared by "
                           f"class, length and Subset indices only (not their samples: {unread}): a rank's own part of the "
                           "data would train only partly")


def _refuse(name: str, key: str, values: list[Any]) -> None:
    differing = ", ".join(str(rank) for rank, value in enumerate(values) if value != values[0])
    said = (", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values)) if key in ("class", "length")
            else f"those of rank(s) {differing} are not rank 0's")
    raise ValueError(
        f"{name}: the ranks' training datasets differ ({IDENTITY_WORDS[key]}: {said}). {name} draws every rank's share of "
        "each global batch by index from one dataset that every rank holds whole, so a rank's own part of the data "
        f"would train only partly. Give every rank the same, whole dataset ({name} splits it by shares; leave "
        "use_distributed_sampler at its default), or use strategy='ddp' to train each rank's own part")


def dataset_identity(dataset: Any, read_samples: bool) -> dict[str, Any]:
    """What tells one rank's training dataset from another's without iterating it: its class and length, the indices of
    each ``Subset`` in it and (``read_samples``) the digests of its first and last samples (:func:`_sample_digests`; why
    not, where they cannot be compared). Not a Hugging Face dataset's fingerprint: a transform it cannot hash gets a
    random one, another on each rank."""
    identity: dict[str, Any] = {"class": type(dataset).__qualname__, "length": len(dataset)}
    chain, inner = [], dataset
    while isinstance(inner, Subset):
        chain.append(_indices_digest(inner.indices))
        inner = inner.dataset
    identity["subset indices"] = chain
    if read_samples:
        identity["samples"] = _sample_digests(dataset)
    return identity


def _indices_digest(indices: Any) -> str | None:
    """A digest of a ``Subset``'s indices as int64 values, whatever holds them (a list, a range, an array, a tensor)."""
    try:
        return digest(torch.as_tensor(indices, dtype=torch.int64))
    except (TypeError, ValueError, RuntimeError):  # not integers: compared as they are
        return digest(indices)


def _sample_digests(dataset: Any) -> list[str] | str:
    """The digests of ``dataset``'s first and last samples, each read :data:`READS` times under the same seeds of
    torch's, Python's and NumPy's streams (put back afterwards), so that a random augmentation drawn from them reads
    alike on every rank; or why they cannot be compared: reads that differ (a generator of the dataset's own: a few
    outcomes could agree twice by chance, and refuse a dataset that is the same on every rank), or a sample without a
    content :func:`digest` reads."""
    indices = (0, len(dataset) - 1) if len(dataset) else ()
    reads = []
    for _ in range(READS):
        with random_streams_restored(torch.device("cpu")):
            torch.manual_seed(0)
            np.random.seed(0)
            random.seed(0)
            reads.append([digest(dataset[index]) for index in indices])
    if None in reads[0]:
        return UNCOMPARABLE
    if any(read != reads[0] for read in reads):
        return "two reads under the same seeds differ, a generator of the dataset's own"
    return reads[0]


def digest(value: Any) -> str | None:
    """A digest of ``value``'s content, the same in every process (None for an object :func:`_feed` does not read)."""
    hashed = hashlib.sha1()
    try:
        _feed(hashed, value)
    except (TypeError, ValueError, RuntimeError, pickle.PicklingError):  # not compared
        return None
    return hashed.hexdigest()


def _feed(hashed: Any, value: Any) -> None:
    """Feed ``value``'s content to ``hashed``: tensors and arrays by dtype, shape and values (a pickled tensor holds its
    storage's key, another in each process), containers item by item (a set's items in the order of their digests: its
    own order follows string hashing, another in each process), a dataclass field by field, numbers, strings and bytes
    pickled; anything else raises TypeError (its pickle may hold what differs between processes, as a tensor's does)."""
    if isinstance(value, np.ndarray) and value.dtype == object:  # (its bytes are pointers)
        _feed(hashed, value.tolist())
    elif isinstance(value, Tensor | np.ndarray):
        array = value.detach().cpu().contiguous() if isinstance(value, Tensor) else np.ascontiguousarray(value)
        hashed.update(f"{type(value).__name__}{array.dtype}{tuple(array.shape)}".encode())
        hashed.update(array.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(array, Tensor) else array.tobytes())
    elif isinstance(value, Mapping):
        hashed.update(f"{type(value).__name__}{len(value)}".encode())
        for key in value:
            _feed(hashed, key)
            _feed(hashed, value[key])
    elif isinstance(value, list | tuple | range):
        hashed.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(hashed, item)
    elif isinstance(value, set | frozenset):
        hashed.update(f"{type(value).__name__}{len(value)}".encode())
        for item_digest in sorted(digest(item) or "" for item in value):
            hashed.update(item_digest.encode())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        hashed.update(type(value).__qualname__.encode())
        for field in dataclasses.fields(value):
            _feed(hashed, field.name)
            _feed(hashed, getattr(value, field.name))
    elif value is None or isinstance(value, bool | int | float | complex | str | bytes | np.generic):
        hashed.update(pickle.dumps(value, protocol=4))
    else:
        raise TypeError(f"no content digest for {type(value).__qualname__}")
