"""Moving the tensors a block saves for backward off the device: to host memory or to disk.

Both work through ``torch.autograd.graph.saved_tensors_hooks`` active during a block's forward.
Parameters and buffers (``exclude``) and tensors under ``min_bytes`` are left where they are.

* :class:`HostOffload` (CUDA): each saved tensor is copied into pinned host memory on a side
  stream; in backward, the first unpack in a block starts copying the *previous* block's tensors
  back (backward runs blocks in reverse), so transfers overlap compute.
* :class:`DiskOffload`: each saved storage is written once (however many saved tensors are views
  of it) by a background writer into a private directory (mode 0700) and read back in backward,
  the previous block's files prefetched by reader threads. A file is removed as soon as autograd
  frees its saved tensors (after backward, or when an exception drops the graph), and
  :meth:`DiskOffload.clear` removes whatever is left. A failed write raises
  :class:`DiskFullError` (path and bytes) on the training thread.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_efficient._torch import storage_key

Exclude = Callable[[Tensor], bool]


class DiskFullError(OSError):
    """Disk offload cannot write a tensor: the message names the path and the bytes needed."""


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _StorageFile:
    """One saved storage on disk (or still in memory while its write is under way).

    Tensors that share a storage (a tensor saved by two ops, views such as ``q``/``k``/``v`` of one
    projection) share one file: it holds the whole storage, and each :class:`_DiskView` restores
    its own shape, strides and offset from it.
    """

    def __init__(self, store: DiskOffload, path: Path, tensor: Tensor) -> None:
        self.path = path
        self.device = tensor.device
        self.nbytes = tensor.untyped_storage().nbytes()
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
        self._bytes: Tensor | None = whole  # the storage itself, until it is on disk
        self._read: Future | None = None
        self._write: Future = store._writer.submit(self._write_file, store, whole)
        weakref.finalize(self, _remove, str(path))

    def _write_file(self, store: DiskOffload, whole: Tensor) -> None:
        try:
            whole.detach().cpu().numpy().tofile(self.path)
        except OSError as error:
            failure = DiskFullError(
                f"disk offload could not write {self.nbytes:,} bytes to {self.path}: {error.strerror or error}"
            )
            store._failed(failure)
            raise failure from error
        store.bytes_written += self.nbytes  # only this thread adds to it
        self._bytes = None  # on disk now: release the memory

    def _read_file(self) -> Tensor:
        self._write.result()
        raw = torch.from_numpy(np.fromfile(self.path, dtype=np.uint8))
        return raw.to(self.device, non_blocking=True)

    def prefetch(self, reader: ThreadPoolExecutor) -> None:
        """Start reading the file back in the background."""
        if self._read is None and self._bytes is None:
            self._read = reader.submit(self._read_file)

    def load(self) -> Tensor:
        """The storage's bytes (a flat uint8 tensor), from memory if the write has not finished, else the file."""
        whole = self._bytes
        if whole is not None:
            return whole
        if self._read is None:
            self._read = Future()
            self._read.set_result(self._read_file())
        return self._read.result()  # read once, shared by the storage's views


class _DiskView:
    """A saved tensor as a view (dtype, shape, strides, offset) of a :class:`_StorageFile`."""

    def __init__(self, file: _StorageFile, tensor: Tensor) -> None:
        self.file = file
        self.dtype, self.shape, self.stride = tensor.dtype, tensor.shape, tensor.stride()
        self.offset = tensor.storage_offset()

    def load(self) -> Tensor:
        """The saved tensor, restored as the same view of its storage."""
        whole = self.file.load()
        return torch.empty(0, dtype=self.dtype, device=whole.device).set_(
            whole.untyped_storage(), self.offset, self.shape, self.stride
        )


class _BlockHooks:
    """Per-block ``saved_tensors_hooks`` over a subclass's ``_pack(block, tensor)`` / ``_unpack(block, packed)``."""

    def hooks(self, block_index: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks context for the forward of block ``block_index``."""
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(block_index, t), lambda h: self._unpack(block_index, h)
        )


class DiskOffload(_BlockHooks):
    """Saved-tensor hooks that keep a block's saved tensors in files.

    Each storage is written once, however many saved tensors (the same tensor saved by two ops,
    views of one storage) refer to it. A write that fails (a full disk, a file-size limit, a
    directory made read-only) raises :class:`DiskFullError`, naming the path and the bytes, on the
    training thread: at the next pack or unpack, or at :meth:`check`.

    Args:
        directory: where the private directory is made (None: the system's temporary directory).
        min_bytes: tensors smaller than this stay in memory.
        exclude: tensors never moved (the model's parameters and buffers).
    """

    def __init__(self, directory: str | None = None, min_bytes: int = 0, exclude: Exclude = lambda t: False) -> None:
        parent = Path(directory).expanduser() if directory else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="lightning_efficient_activations_", dir=parent))
        os.chmod(self.root, 0o700)
        self.min_bytes = min_bytes
        self.exclude = exclude
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="activation-writer")
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="activation-reader")
        self._counter = itertools.count()
        self._by_block: dict[int, weakref.WeakSet[_StorageFile]] = {}
        # storage key -> (a weak reference to a tensor on that storage, its file): while the tensor
        # lives, so does the storage, so its address cannot belong to another storage
        self._files: dict[tuple[str, int], tuple[weakref.ref, weakref.ref]] = {}
        self._error: DiskFullError | None = None
        self.bytes_written = 0

    def _failed(self, error: DiskFullError) -> None:
        if self._error is None:
            self._error = error

    def check(self, wait: bool = False) -> None:
        """Raise the first failed write's :class:`DiskFullError` (after the writes under way if ``wait``)."""
        if wait:
            self.flush()
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait until the writes under way have finished (or failed)."""
        self._writer.submit(lambda: None).result()

    def _file_for(self, block_index: int, tensor: Tensor) -> _StorageFile:
        key = storage_key(tensor)
        known = self._files.get(key)
        if known is not None:
            alive, file = known[0](), known[1]()
            if alive is not None and file is not None:
                return file
        if len(self._files) > 4096:  # forget entries whose tensors are gone
            self._files = {k: v for k, v in self._files.items() if v[0]() is not None and v[1]() is not None}
        nbytes = tensor.untyped_storage().nbytes()
        free = shutil.disk_usage(self.root).free
        if free < nbytes:
            raise DiskFullError(
                f"disk offload needs {nbytes:,} more bytes at {self.root} but the disk has {free:,} free"
            )
        file = _StorageFile(self, self.root / f"{next(self._counter)}.bin", tensor)
        self._files[key] = (weakref.ref(tensor), weakref.ref(file))
        self._by_block.setdefault(block_index, weakref.WeakSet()).add(file)
        return file

    def _pack(self, block_index: int, tensor: Tensor) -> Tensor | _DiskView:
        self.check()
        nbytes = tensor.numel() * tensor.element_size()
        if self.exclude(tensor) or nbytes < self.min_bytes or tensor.layout != torch.strided or nbytes == 0:
            return tensor
        return _DiskView(self._file_for(block_index, tensor), tensor)

    def _unpack(self, block_index: int, packed: Tensor | _DiskView) -> Tensor:
        self.check()
        if isinstance(packed, Tensor):
            return packed
        for file in list(self._by_block.get(block_index - 1, ())):
            file.prefetch(self._reader)
        return packed.load()

    def files(self) -> list[Path]:
        """The offload files that exist now."""
        return sorted(self.root.glob("*.bin")) if self.root.exists() else []

    def clear(self) -> None:
        """Remove every file (after an exception, or at the end)."""
        self.flush()  # let a write under way finish first
        for path in self.files():
            _remove(str(path))

    def close(self) -> None:
        """Remove the files and the directory, and stop the threads."""
        self.clear()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        shutil.rmtree(self.root, ignore_errors=True)


class _HostHandle:
    def __init__(self, host: Tensor, device: torch.device, event: torch.cuda.Event | None) -> None:
        self.host, self.device, self.event = host, device, event
        self.on_device: Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class HostOffload(_BlockHooks):
    """Saved-tensor hooks that keep a block's saved CUDA tensors in pinned host memory.

    Args:
        min_bytes: tensors smaller than this stay on the device.
        use_streams: copy on a side stream and prefetch the previous block in backward; else copy
            synchronously.
        exclude: tensors never moved (the model's parameters and buffers).
    """

    def __init__(self, min_bytes: int = 2**20, use_streams: bool = True, exclude: Exclude = lambda t: False) -> None:
        self.min_bytes = min_bytes
        self.exclude = exclude
        self.stream = torch.cuda.Stream() if use_streams and torch.cuda.is_available() else None
        self._in_flight: list[tuple[torch.cuda.Event, Tensor]] = []
        self._by_block: dict[int, weakref.WeakSet] = {}
        self.bytes_offloaded = 0

    def _pack(self, block_index: int, tensor: Tensor) -> Tensor | _HostHandle:
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_cuda or self.exclude(tensor) or nbytes < self.min_bytes:
            return tensor
        self._in_flight = [(e, t) for e, t in self._in_flight if not e.query()]  # device copies done: free them
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        event = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self._in_flight.append((event, tensor))  # the device tensor lives until its copy is done
        else:
            host.copy_(tensor)
        handle = _HostHandle(host, tensor.device, event)
        self._by_block.setdefault(block_index, weakref.WeakSet()).add(handle)
        self.bytes_offloaded += nbytes
        return handle

    def _fetch(self, handle: _HostHandle) -> None:
        if handle.on_device is not None:
            return
        if self.stream is None:
            handle.on_device = handle.host.to(handle.device)
            return
        with torch.cuda.stream(self.stream):
            if handle.event is not None:
                self.stream.wait_event(handle.event)
            handle.on_device = handle.host.to(handle.device, non_blocking=True)
            handle.ready = torch.cuda.Event()
            handle.ready.record(self.stream)

    def _unpack(self, block_index: int, packed: Tensor | _HostHandle) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        self._fetch(packed)
        for handle in list(self._by_block.get(block_index - 1, ())):
            self._fetch(handle)
        if packed.ready is not None:
            torch.cuda.current_stream().wait_event(packed.ready)
            packed.on_device.record_stream(torch.cuda.current_stream())
        tensor, packed.on_device = packed.on_device, None
        return tensor
