"""Whether every rank holds the same training dataset: the heterogeneous strategies draw each rank's share of a global
batch by index from one dataset that every rank holds whole."""

from __future__ import annotations

import dataclasses
import hashlib
import math
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
from lightning_efficient._generators import held_generators_restored
from lightning_efficient._torch import random_streams_restored

IDENTITY_WORDS = {"class": "classes", "length": "lengths", "samples": "first and last samples",
                  "subset indices": "Subset indices (from a random_split? give it a seeded generator)"}
READS = 4  # reads of each compared sample that must agree (a 50% flip from a generator of its own: all 4 alike 1 in 8)
CONFIRMING_READS = 32  # reads of each where the ranks' samples differ, before refusing (all alike by chance: 1 in 2**31)
UNCOMPARABLE = ("they hold objects other than tensors, arrays, numbers, strings, dataclasses and containers of them, or "
                "content that cannot be read here")


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
        if not distributed_sampler and not read_samples:  # (each rank its own num_workers: every rank has the key)
            identity["samples"] = "DataLoader workers read them, not this process"
    except Exception as failure:  # noqa: BLE001 - every rank learns of it and raises it together
        error = failure
    identities = gather_or_raise_together(identity, error, f"{name} could not compare the ranks' training datasets")
    if not distributed_sampler:
        confirmed = _confirmed_samples(name, dataloader.dataset, [identity["samples"] for identity in identities])
        for identity, samples in zip(identities, confirmed):
            identity["samples"] = samples
    for key in identities[0]:
        values = [identity[key] for identity in identities]
        if key == "samples" and any(isinstance(value, str) for value in values):  # not comparable on some rank
            continue
        differing = [rank for rank, value in enumerate(values) if not alike(value, values[0])]
        if differing:
            _refuse(name, key, values, differing)
    if distributed_sampler:
        return
    unread = next((identity["samples"] for identity in identities if isinstance(identity["samples"], str)), None)
    if unread is not None:  # why the samples of a rank could not be compared
        rank_zero_warn(f"{name}: with use_distributed_sampler=False every rank's training DataLoader must still hold "
                       f"the same, whole dataset, which {name} splits by shares; the ranks' datasets were compared by "
                       f"class, length and Subset indices only (not their samples: {unread}): a rank's own part of the "
                       "data would train only partly")


def _confirmed_samples(name: str, dataset: Any, values: list[Any]) -> list[Any]:
    """The ranks' sample summaries, read again :data:`CONFIRMING_READS` times where they differ (every rank sees the
    same ``values``, so all read again or none): a generator of the dataset's own with few outcomes reads alike
    :data:`READS` times by chance on every rank now and then (a 50% flip of one sample: 1 fit in 128 on 2 ranks), and its
    differing reads tell it from a rank's own part of the data, which reads alike however often it is read."""
    if any(isinstance(value, str) for value in values) or all(alike(value, values[0]) for value in values):
        return values
    summaries, error = None, None
    try:
        summaries = _sample_summaries(dataset, CONFIRMING_READS)
    except Exception as failure:  # noqa: BLE001 - every rank learns of it and raises it together
        error = failure
    return gather_or_raise_together(summaries, error, f"{name} could not compare the ranks' training datasets")


def _refuse(name: str, key: str, values: list[Any], differing: list[int]) -> None:
    said = (", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values)) if key in ("class", "length")
            else f"those of rank(s) {', '.join(map(str, differing))} are not rank 0's")
    raise ValueError(
        f"{name}: the ranks' training datasets differ ({IDENTITY_WORDS[key]}: {said}). {name} draws every rank's share of "
        "each global batch by index from one dataset that every rank holds whole, so a rank's own part of the data "
        f"would train only partly. Give every rank the same, whole dataset ({name} splits it by shares; leave "
        "use_distributed_sampler at its default), or train each rank's own part under strategy='ddp' (ModelParallelStrategy "
        "for a sharded model)")


def dataset_identity(dataset: Any, read_samples: bool) -> dict[str, Any]:
    """What tells one rank's training dataset from another's without iterating it: its class and length, the indices of
    each ``Subset`` in it and (``read_samples``) the summaries of its first and last samples (:func:`_sample_summaries`;
    why not, where they cannot be compared). Not a Hugging Face dataset's fingerprint: a transform it cannot hash gets a
    random one, another on each rank."""
    identity: dict[str, Any] = {"class": type(dataset).__qualname__, "length": len(dataset)}
    chain, inner = [], dataset
    while isinstance(inner, Subset):
        chain.append(_indices_digest(inner.indices))
        inner = inner.dataset
    identity["subset indices"] = chain
    if read_samples:
        identity["samples"] = _sample_summaries(dataset)
    return identity


def _indices_digest(indices: Any) -> str | None:
    """A digest of a ``Subset``'s indices as int64 values, whatever holds them (a list, a range, an array, a tensor)."""
    try:
        return digest(torch.as_tensor(indices, dtype=torch.int64))
    except (TypeError, ValueError, RuntimeError):  # not integers: not compared
        return None


def _sample_summaries(dataset: Any, times: int = READS) -> list[Any] | str:
    """:func:`summary` of ``dataset``'s first and last samples, each read ``times`` times under the same seeds of
    torch's CPU, Python's and NumPy's streams (put back afterwards; no accelerator's generator is touched), so that a
    random augmentation drawn from them reads alike on every rank; or why they cannot be compared: reads that differ (a
    generator of the dataset's own, or memory left uninitialised: a few outcomes could agree twice by chance and refuse
    a dataset that is the same on every rank), or a sample of objects :func:`summary` does not read."""
    indices = (0, len(dataset) - 1) if len(dataset) else ()
    with held_generators_restored(dataset):  # (a generator of the dataset's own: the fit draws from it as without the check)
        return _summaries_read(dataset, indices, times)


def _summaries_read(dataset: Any, indices: tuple[int, ...], times: int) -> list[Any] | str:
    reads = []
    for _ in range(times):
        with random_streams_restored(torch.device("cpu")):
            torch.default_generator.manual_seed(0)
            np.random.seed(0)
            random.seed(0)
            sample_reads = [dataset[index] for index in indices]  # (a read that raises: every rank raises, see the caller)
            try:
                reads.append([summary(sample) for sample in sample_reads])
            except (TypeError, ValueError, RuntimeError, NotImplementedError):  # (RecursionError is a RuntimeError)
                return UNCOMPARABLE
    if any(not alike(read, reads[0]) for read in reads):
        return "reads under the same seeds differ: a generator of the dataset's own, or memory left uninitialised"
    return reads[0]


def summary(value: Any) -> Any:
    """What :func:`alike` compares of a sample: integers, strings, bytes and booleans exactly (as a digest), floating
    point content by shape, sum, absolute sum and its first values (computed floats differ in their last bits between
    hosts of other thread counts or instruction sets), containers item by item (a mapping and a set in no order: a dict
    built from a set of keys is ordered by string hashing, another in each process), a dataclass field by field.

    Raises:
        TypeError: for another object (its pickle may hold what differs between processes, as a tensor's does); what
            torch raises for content it cannot read (a meta or nested tensor): ValueError, RuntimeError,
            NotImplementedError.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:  # (objects: item by item)
            return ("objects", tuple(value.shape), summary(value.tolist()))
        if value.dtype.names:  # records: field by field (an aligned one's padding bytes are not its content)
            return ("record", value.dtype.names, [summary(value[name]) for name in value.dtype.names])
        if value.dtype.kind not in "biufc":  # strings, bytes, dates: their bytes, in native byte order
            return ("exact", digest(value.astype(value.dtype.newbyteorder("="))))
        if value.dtype.kind in "fc" and value.dtype.itemsize > (8 if value.dtype.kind == "f" else 16):  # (long double)
            value = value.astype(np.float64 if value.dtype.kind == "f" else np.complex128)
        value = torch.from_numpy(np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("=")))
    if isinstance(value, Tensor):
        array = value.detach().cpu()
        if array.layout != torch.strided:  # sparse: its indices and values (a dense copy may not fit)
            array = (array if array.layout == torch.sparse_coo else array.to_sparse_coo()).coalesce()
            return ("sparse", tuple(array.shape), summary(array.indices()), summary(array.values()))
        if array.is_floating_point() or array.is_complex():
            flat = torch.view_as_real(array.resolve_conj()).reshape(-1) if array.is_complex() else array.reshape(-1)
            # a NaN or an infinity (a mask, a missing value) counted exactly; the figures over the finite values
            counts = (int(flat.isnan().sum()), int((flat == float("inf")).sum()), int((flat == float("-inf")).sum()))
            finite = flat.nan_to_num(0.0, 0.0, 0.0)
            return ("float", (str(array.dtype), tuple(array.shape), counts), float(finite.sum(dtype=torch.float64)),
                    float(finite.abs().sum(dtype=torch.float64)), flat[:16].to(torch.float64).tolist(), math.prod(array.shape))
        return ("exact", digest(array))
    if isinstance(value, float | np.floating):
        finite = value if math.isfinite(value) else 0.0
        return ("float", ("scalar", math.isnan(value), value if math.isinf(value) else 0.0), float(finite), abs(float(finite)),
                [float(value)], 1)
    if value is None or isinstance(value, bool | int | complex | str | bytes | np.generic):
        return ("exact", digest(value))
    if isinstance(value, Mapping):
        return ("map", sorted(((summary(key), summary(item)) for key, item in value.items()), key=repr))
    if isinstance(value, set | frozenset):
        return ("set", sorted((summary(item) for item in value), key=repr))
    if isinstance(value, list | tuple | range):
        return ("sequence", type(value).__name__, [summary(item) for item in value])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("dataclass", type(value).__qualname__, [(field.name, summary(getattr(value, field.name)))
                                                          for field in dataclasses.fields(value)])
    raise TypeError(f"no content summary for {type(value).__qualname__}")


def alike(first: Any, second: Any, rtol: float = 1e-4) -> bool:
    """Whether two :func:`summary` values agree: floating point content within ``rtol`` of its scale (the absolute
    sum: a sum that cancels is compared against it, and the first values against the mean magnitude; NaN alike NaN)
    and 1e-12, everything else exactly. A rank's own part of the data differs by far more."""
    if _is_float_summary(first) and _is_float_summary(second):
        (_, kind, total, magnitude, values, size), (_, other_kind, other_total, other_magnitude, other_values, _) = first, second
        scale = max(magnitude, other_magnitude)  # (of the finite values: a sum that cancels is compared against it)
        floor = 1e-12  # (content that is all but zero: 0 on one host, 1e-17 on another)
        return (kind == other_kind and _close(magnitude, other_magnitude, rtol, floor)
                and _close(total, other_total, rtol, rtol * scale + floor) and len(values) == len(other_values)
                and all(_close(a, b, rtol, rtol * scale / max(1, size) + floor) for a, b in zip(values, other_values)))
    if isinstance(first, list | tuple) and isinstance(second, list | tuple):
        return type(first) is type(second) and len(first) == len(second) and all(alike(a, b, rtol) for a, b in zip(first, second))
    return first == second


def _is_float_summary(value: Any) -> bool:
    """``("float", (dtype, shape, non-finite counts), sum, absolute sum, first values, size)``, of :func:`summary`."""
    return isinstance(value, tuple) and len(value) == 6 and value[0] == "float"


def _close(first: float, second: float, rtol: float, atol: float) -> bool:
    """``math.isclose``, with NaN alike NaN (a sample holding one is the same sample)."""
    return (math.isnan(first) and math.isnan(second)) or math.isclose(first, second, rel_tol=rtol, abs_tol=atol)


def digest(value: Any) -> str:
    """A digest of an exact value, the same in every process: a tensor or array by dtype, shape and bytes (a pickled
    tensor holds its storage's key, another in each process), anything else by its pickle (numbers, strings, bytes)."""
    hashed = hashlib.sha1()
    if isinstance(value, Tensor | np.ndarray):
        array = value.detach().cpu().contiguous() if isinstance(value, Tensor) else np.ascontiguousarray(value)
        hashed.update(f"{type(value).__name__}{array.dtype}{tuple(array.shape)}".encode())
        hashed.update(array.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(array, Tensor) else array.tobytes())
    else:
        hashed.update(pickle.dumps(value, protocol=4))
    return hashed.hexdigest()
