"""Moving the tensors a block saves for backward off the device: to host memory or to disk.

Both work through ``torch.autograd.graph.saved_tensors_hooks`` active during a block's forward.
Parameters and buffers (``exclude``), their casts and views (autocast's low-precision weight
copies, recognised by their autograd history) and tensors under ``min_bytes`` are left where they
are. Both move each saved *storage* once, however many saved tensors (the same tensor saved by two
ops, views such as ``q``/``k``/``v`` of one projection) refer to it, and restore each view's shape,
strides and offset from it.

* :class:`HostOffload` (CUDA): each saved storage is copied into pinned host memory on a
  device-to-host stream. The device storages whose copy may still be in flight are held in a
  bounded stash; one pushed out is released only after the compute stream waits for its copy. In
  backward a storage still on the device is reused rather than copied back, and entering a block
  starts copying back its storages and the next offloaded block's on a host-to-device stream, so
  transfers overlap compute; what is left is released when backward ends. The stream and event
  operations sit behind a small interface (``_CudaStreams``; ``_SyncStreams`` copies synchronously,
  and on CPU lets tests drive the whole logic).
* :class:`DiskOffload`: each saved storage is written once by a background writer into a private
  directory (mode 0700) and read back in backward, the previous block's files prefetched by reader
  threads. A CUDA storage is first copied to pinned host memory on the device-to-host stream and
  its device memory is free again once that copy is done, whatever the writer's backlog; the
  bytes waiting for the writer are bounded (``max_pending_bytes``: forward waits for the disk
  beyond it), and a file whose block's backward has already run is not written. A file is removed
  as soon as autograd frees its saved tensors (after backward, or when an exception drops the
  graph), and :meth:`DiskOffload.clear` removes whatever is left. A failed write raises
  :class:`DiskFullError` (path and bytes) on the training thread.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_efficient._torch import eager_saved_tensors_hooks, storage_key
from lightning_efficient._validation import require_bool, require_int

Exclude = Callable[[Tensor], bool]

# autograd nodes of a cast or a view: a chain of them back to a parameter makes a copy of the
# parameter (autocast's cached low-precision weight, and the transposes of it that matmuls save)
_CAST_OR_VIEW = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward2",
})


def is_copy_of(tensor: Tensor, exclude: Exclude, depth: int = 8) -> bool:
    """Whether ``tensor`` is a cast or a view of a parameter (or of another leaf ``exclude`` matches).

    Under autocast a matmul saves the parameter's low-precision copy (``_to_copy`` of it, cached
    for the whole forward), or a transpose of that copy: autograd records it as a chain of cast
    and view nodes ending at the parameter's ``AccumulateGrad``. Moving it would copy the weights
    out and back every step, though the parameter itself stays on the device. The chain is what
    identifies it: an activation of the same shape and dtype has other nodes in its history. (A
    frozen parameter's cast has no autograd history and is not recognised.)
    """
    node = tensor.grad_fn
    for _ in range(depth):
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            return isinstance(node.variable, torch.nn.Parameter) or bool(exclude(node.variable))
        if name not in _CAST_OR_VIEW:
            return False
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


class DiskFullError(OSError):
    """Disk offload cannot write a tensor: the message names the path and the bytes needed."""


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _StorageFile:
    """One saved storage on disk (or still in host memory while its write is under way).

    Tensors that share a storage (a tensor saved by two ops, views such as ``q``/``k``/``v`` of one
    projection) share one file: it holds the whole storage, and each :class:`_DiskView` restores
    its own shape, strides and offset from it. A CUDA storage is first copied to pinned host memory
    on a side stream, and the device memory is free again once that copy is done; another
    accelerator's is copied to host memory at once; a CPU storage is written as it is. The writer
    holds the file weakly: a file that backward has already released (its block's gradients computed
    from the bytes still in memory) is not written.
    """

    def __init__(self, store: DiskOffload, path: Path, tensor: Tensor) -> None:
        self.path = path
        self.device = tensor.device
        self.nbytes = tensor.untyped_storage().nbytes()
        whole = _whole(tensor)
        self._streams = store._streams if tensor.device.type == store._streams.device_type else None
        self._copied: object = None
        host = whole
        if self._streams is not None:
            host, self._copied = self._streams.copy_to_host(whole, blocking_event=True)  # the writer sleeps, not spins
            self._streams.release_after_copy(whole)  # its memory is handed out again only once the copy is done
        elif whole.device.type != "cpu":  # an accelerator without side streams here (MPS, XPU): copied now
            host = whole.cpu()
        self._a_copy = host is not whole  # else the storage's own bytes (a CPU storage)
        self._bytes: Tensor | None = host  # host bytes (the storage itself for a CPU tensor) until on disk
        self._on_device: Tensor | None = None
        self._read: Future | None = None
        self._write: Future = store._submit_write(self)
        weakref.finalize(self, _remove, str(path))

    def write(self, store: DiskOffload) -> None:
        """Write the host bytes to the file (on the writer thread) and release them; a failure is recorded for the
        training thread (:meth:`DiskOffload.check`), not raised here, where nothing would read it and its traceback
        would hold this file's bytes."""
        host = self._bytes
        if host is None or self._on_device is not None:  # backward has read it back already: no need to write
            return
        try:
            if self._copied is not None:
                self._streams.wait_on_host(self._copied)
            host.numpy().tofile(self.path)
        except OSError as error:
            store._failed(DiskFullError(
                f"disk offload could not write {self.nbytes:,} bytes to {self.path}: {error.strerror or error}; free "
                "space there, or give ActivationMemory an offload_dir on a disk with room"))
            return
        except Exception as error:  # noqa: BLE001 - a CUDA error at the copy's event, say: the training thread raises it
            store._failed(error)
            return
        store.bytes_written += self.nbytes  # only this thread adds to it
        self._bytes = None  # on disk now: release the memory

    def _read_file(self) -> Tensor:
        self._write.result()
        raw = torch.from_numpy(np.fromfile(self.path, dtype=np.uint8))
        return raw.to(self.device, non_blocking=True)

    def prefetch(self, reader: ThreadPoolExecutor) -> None:
        """Start reading the file back in the background."""
        if self._read is None and self._bytes is None and self._on_device is None:
            self._read = reader.submit(self._read_file)

    def load(self) -> Tensor:
        """The storage's bytes on its device (a flat uint8 tensor): from host memory if the write has not finished
        (copied back to the device once), else from the file (read once); shared by the storage's views."""
        if self._on_device is not None:  # read back from host memory for an earlier view
            return self._on_device
        host = self._bytes
        if host is not None:
            if not self._a_copy:
                return host  # a CPU storage: the bytes themselves
            if self._copied is not None:
                self._streams.wait(self._copied, self.device)
            self._on_device = host.to(self.device, non_blocking=True)
            return self._on_device
        if self._read is None:
            self._read = Future()
            self._read.set_result(self._read_file())
        return self._read.result()


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

    exclude: Exclude

    def _excluded(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` stays: ``exclude`` matches it, or it is a cast or view of what it matches."""
        return bool(self.exclude(tensor)) or is_copy_of(tensor, self.exclude)

    def hooks(self, block_index: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks context for the forward of block ``block_index``."""
        return eager_saved_tensors_hooks(lambda t: self._pack(block_index, t), lambda h: self._unpack(block_index, h))


class DiskOffload(_BlockHooks):
    """Saved-tensor hooks that keep a block's saved tensors in files.

    Each storage is written once, however many saved tensors (the same tensor saved by two ops,
    views of one storage) refer to it. A write that fails (a full disk, a file-size limit, a
    directory made read-only) raises :class:`DiskFullError`, naming the path and the bytes, on the
    training thread: at the next pack or unpack, or at :meth:`check`.

    A CUDA storage is copied to pinned host memory on a side stream (its device memory is handed out again once
    the copy is done) and the writer writes that copy; a CPU storage is written as it is. At most
    ``max_pending_bytes`` wait for the writer (one storage larger than that waits alone): forward goes no faster
    than the disk, so neither device nor host memory grows with the writer's backlog. A storage whose saved
    tensors backward has already released is not written at all.

    Args:
        directory: where the private directory is made (None: the system's temporary directory).
        min_bytes: tensors smaller than this stay in memory.
        exclude: tensors never moved (the model's parameters and buffers).
        max_pending_bytes: the most bytes waiting for the writer before forward waits for it.

    Raises:
        ValueError: for a ``max_pending_bytes`` under 1.
    """

    def __init__(self, directory: str | None = None, min_bytes: int = 0, exclude: Exclude = lambda t: False, *,
                 max_pending_bytes: int = 2**30, _streams: _SyncStreams | _CudaStreams | None = None) -> None:
        require_int("max_pending_bytes", max_pending_bytes, 1)
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
        self._error: Exception | None = None  # the first failed write's (a DiskFullError where the disk refused it)
        self.bytes_written = 0  # what the writer wrote (not the files backward released before their turn)
        self.bytes_offloaded = 0  # what was handed to the store (every storage it took, written or not)
        self.max_pending_bytes = max_pending_bytes
        self._streams = _streams if _streams is not None else _CudaStreams()
        self._pending = 0  # bytes submitted to the writer and not yet written (or skipped)
        self._room = threading.Condition()

    def _submit_write(self, file: _StorageFile) -> Future:
        """Queue ``file``'s write, holding it weakly (see :class:`_StorageFile`); its bytes count as pending until done."""
        def write(ref: weakref.ref, nbytes: int) -> None:
            try:
                file = ref()
                if file is not None:
                    file.write(self)
            finally:
                self._written(nbytes)

        with self._room:
            self._pending += file.nbytes
        try:
            return self._writer.submit(write, weakref.ref(file), file.nbytes)
        except BaseException:  # the writer is shut down (closed): nothing is pending for it
            self._written(file.nbytes)
            raise

    def _written(self, nbytes: int) -> None:
        with self._room:
            self._pending -= nbytes
            self._room.notify_all()

    def _wait_for_room(self, nbytes: int) -> None:
        """Block until ``nbytes`` more fit under ``max_pending_bytes`` (or nothing is pending): forward goes no faster
        than the disk takes the bytes, so the host copies (and, before them, the device storages) waiting for the
        writer stay bounded."""
        with self._room:
            while self._pending and self._pending + nbytes > self.max_pending_bytes and self._error is None:
                self._room.wait(timeout=1.0)

    def _failed(self, error: Exception) -> None:
        if self._error is None:
            self._error = error

    def check(self, wait: bool = False) -> None:
        """Raise the first failed write's error, a :class:`DiskFullError` where the disk refused it (after the writes
        under way if ``wait``)."""
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
                f"disk offload needs {nbytes:,} more bytes at {self.root} but the disk has {free:,} free; free space "
                "there, or give ActivationMemory an offload_dir on a disk with room"
            )
        self._wait_for_room(nbytes)
        self.check()
        file = _StorageFile(self, self.root / f"{next(self._counter)}.bin", tensor)
        self.bytes_offloaded += nbytes
        self._files[key] = (weakref.ref(tensor), weakref.ref(file))
        self._by_block.setdefault(block_index, weakref.WeakSet()).add(file)
        return file

    def _pack(self, block_index: int, tensor: Tensor) -> Tensor | _DiskView:
        self.check()
        nbytes = tensor.numel() * tensor.element_size()
        if self._excluded(tensor) or nbytes < self.min_bytes or tensor.layout != torch.strided or nbytes == 0:
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


# -- host offload ----------------------------------------------------------------------------------


class _Event:
    """An event of :class:`_SyncStreams`: done at once, or (``pending``) once waited for."""

    __slots__ = ("__weakref__", "done")

    def __init__(self, done: bool) -> None:
        self.done = done


class _SyncStreams:
    """Host offload's copies made synchronously on the current stream.

    This is ``use_streams=False`` on CUDA, and on CPU the stand-in through which the whole offload
    logic runs without a GPU (a "host" copy of a CPU tensor is then a second CPU tensor). With
    ``pending=True`` each copy's event stays unfinished until the compute side waits for it
    (:meth:`wait`), until a copy back waits for it, or until :meth:`complete`, as a side stream's
    copies would while the host runs ahead. Copies, bytes and waits are counted.

    Args:
        device_type: the device type whose tensors are offloaded.
        pending: events stay unfinished until waited for.
    """

    def __init__(self, device_type: str = "cuda", pending: bool = False) -> None:
        self.device_type = device_type
        self.pending = pending
        self.copies_to_host = 0
        self.bytes_to_host = 0
        self.copies_to_device = 0
        self.bytes_to_device = 0
        self.waits = 0
        self._unfinished: weakref.WeakSet[_Event] = weakref.WeakSet()

    def _event(self) -> _Event:
        event = _Event(done=not self.pending)
        if self.pending:
            self._unfinished.add(event)
        return event

    def copy_to_host(self, whole: Tensor, blocking_event: bool = False) -> tuple[Tensor, _Event]:
        """A host copy of ``whole`` (a flat uint8 tensor over a device storage) and its event."""
        host = torch.empty(whole.shape, dtype=whole.dtype, pin_memory=whole.is_cuda)
        host.copy_(whole)
        self.copies_to_host += 1
        self.bytes_to_host += whole.numel()
        return host, self._event()

    def copy_to_device(self, host: Tensor, device: torch.device, after: _Event) -> tuple[Tensor, _Event]:
        """A device copy of ``host``, made once ``after`` (its copy out) is done, and its event."""
        after.done = True
        whole = torch.empty(host.shape, dtype=host.dtype, device=device)
        whole.copy_(host)
        self.copies_to_device += 1
        self.bytes_to_device += host.numel()
        return whole, self._event()

    def wait(self, event: _Event, device: torch.device) -> None:
        """Make ``device``'s current stream wait for ``event``."""
        event.done = True
        self.waits += 1

    def wait_on_host(self, event: _Event) -> None:
        """Block the calling thread until ``event`` has happened (a synchronous copy: at once)."""
        event.done = True

    def release_after_copy(self, whole: Tensor) -> None:
        """Nothing to do: the copy is done when :meth:`copy_to_host` returns."""

    def is_done(self, event: _Event) -> bool:
        """Whether ``event`` has happened."""
        return event.done

    def complete(self) -> None:
        """Finish every unfinished event."""
        for event in list(self._unfinished):
            event.done = True
        self._unfinished.clear()


class _CudaStreams:
    """Host offload's copies on two side streams per device, one each way.

    Copies out wait for the work queued so far on the tensor's device's current stream; copies back
    run on their own stream, so the first one in backward does not queue behind the forward's
    copies out. A copy back's destination is allocated on the compute stream (the current one),
    where it is used and freed, so its block stays in that stream's pool; the copy stream first
    waits for the compute stream's work so far (which may still use a block the allocator hands out
    again), and the copy stream is recorded on it (``record_stream``) in case it is dropped before
    the copy is done.
    """

    device_type = "cuda"

    def __init__(self) -> None:
        self._pairs: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        pair = self._pairs.get(device)
        if pair is None:
            pair = self._pairs[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return pair

    def copy_to_host(self, whole: Tensor, blocking_event: bool = False) -> tuple[Tensor, torch.cuda.Event]:
        """A pinned host copy of ``whole`` started on the device-to-host stream, and its event (``blocking_event``: one
        a thread waiting on it sleeps on instead of spinning, for a thread that waits on the host)."""
        to_host, _ = self._streams(whole.device)
        to_host.wait_stream(torch.cuda.current_stream(whole.device))
        with torch.cuda.stream(to_host):
            host = torch.empty(whole.shape, dtype=whole.dtype, pin_memory=True)
            host.copy_(whole, non_blocking=True)
            event = torch.cuda.Event(blocking=blocking_event)
            event.record(to_host)
            return host, event

    def copy_to_device(self, host: Tensor, device: torch.device, after: torch.cuda.Event) -> tuple[Tensor, torch.cuda.Event]:
        """A device copy of ``host`` started on the host-to-device stream once ``after`` (its copy
        out) is done, and its event."""
        _, to_device = self._streams(device)
        compute = torch.cuda.current_stream(device)
        whole = torch.empty(host.shape, dtype=host.dtype, device=device)  # on the compute stream
        to_device.wait_stream(compute)
        with torch.cuda.stream(to_device):
            to_device.wait_event(after)
            whole.copy_(host, non_blocking=True)
            done = to_device.record_event()
        whole.record_stream(to_device)
        return whole, done

    def wait(self, event: torch.cuda.Event, device: torch.device) -> None:
        """Make ``device``'s current stream wait for ``event`` (the host does not wait)."""
        torch.cuda.current_stream(device).wait_event(event)

    def wait_on_host(self, event: torch.cuda.Event) -> None:
        """Block the calling thread until ``event`` has happened."""
        event.synchronize()

    def release_after_copy(self, whole: Tensor) -> None:
        """Let ``whole``'s memory go when its last reference does, but handed out again only once the copies to the
        host queued so far are done (the allocator waits for the device-to-host stream)."""
        whole.record_stream(self._streams(whole.device)[0])

    def is_done(self, event: torch.cuda.Event) -> bool:
        """Whether ``event`` has happened."""
        return event.query()



class _HostStorage:
    """One saved device storage offloaded to the host.

    It holds the host copy (the whole storage, however many saved tensors are views of it) and,
    while the storage is still on the device (its copy out in flight in the stash, or reused in
    backward), the device storage itself (``device``); a copy back in ``fetched``.
    """

    __slots__ = (
        "__weakref__",
        "alive",
        "block",
        "copied",
        "device",
        "fetched",
        "host",
        "key",
        "on",
        "ready",
        "source",
        "version",
    )

    def __init__(self, tensor: Tensor, block: int, whole: Tensor, host: Tensor, copied: object) -> None:
        self.key = storage_key(tensor)
        self.alive = StorageWeakRef(tensor.untyped_storage())  # the device storage still exists
        self.source = weakref.ref(tensor)
        self.version = tensor._version
        self.block = block
        self.on = tensor.device
        self.host, self.copied = host, copied
        self.device: Tensor | None = whole
        self.fetched: Tensor | None = None
        self.ready: object = None

    def resident(self) -> Tensor | None:
        """The device storage when the saved tensor still exists there unchanged (else None)."""
        source = self.source()
        if source is None or self.alive.expired() or source._version != self.version or storage_key(source) != self.key:
            return None
        return _whole(source)


class _HostView:
    """A saved tensor as a view (dtype, shape, strides, offset) of a :class:`_HostStorage`."""

    __slots__ = ("dtype", "offset", "shape", "storage", "stride")

    def __init__(self, storage: _HostStorage, tensor: Tensor) -> None:
        self.storage = storage
        self.dtype, self.shape, self.stride = tensor.dtype, tensor.shape, tensor.stride()
        self.offset = tensor.storage_offset()

    def restore(self, whole: Tensor) -> Tensor:
        """The saved tensor as the same view of ``whole`` (the storage's bytes on the device)."""
        return torch.empty(0, dtype=self.dtype, device=whole.device).set_(
            whole.untyped_storage(), self.offset, self.shape, self.stride
        )


class HostOffload(_BlockHooks):
    """Saved-tensor hooks that keep a block's saved CUDA tensors in pinned host memory.

    Each saved storage is copied out once, however many saved tensors are views of it, and comes
    back with each view's shape, strides and offset. With ``use_streams`` the copies out run on a
    device-to-host stream while compute goes on; the device storages whose copy may still be in
    flight are held in a stash of at most ``max_in_flight``: a storage pushed out of it, and every
    one left when backward ends, is let go only after the compute stream waits for its copy (a
    device-side wait; the host runs on). In backward a storage still on the device (in the stash,
    or still referenced elsewhere) is reused, not copied back; entering a block's backward starts
    the copies back of that block and of the next offloaded block below it on a host-to-device
    stream, so they overlap compute.

    Parameters, buffers (``exclude``) and their casts and views (autocast's low-precision weight
    copies) stay where they are, as do tensors under ``min_bytes``.

    Args:
        min_bytes: tensors smaller than this stay on the device.
        use_streams: copy on side streams and prefetch in backward; else copy synchronously.
        exclude: tensors never moved (the model's parameters and buffers).
        max_in_flight: the most device storages held while their copy out may be in flight.

    Raises:
        ValueError: for a negative ``min_bytes``, a ``use_streams`` that is not a bool or a
            ``max_in_flight`` under 1.
    """

    def __init__(
        self,
        min_bytes: int = 2**20,
        use_streams: bool = True,
        exclude: Exclude = lambda t: False,
        *,
        max_in_flight: int = 4,
        _streams: _SyncStreams | _CudaStreams | None = None,
    ) -> None:
        require_int("min_bytes", min_bytes, 0)
        require_bool("use_streams", use_streams)
        require_int("max_in_flight", max_in_flight, 1)
        self.min_bytes = min_bytes
        self.exclude = exclude
        self.max_in_flight = max_in_flight
        self._streams = _streams if _streams is not None else _CudaStreams() if use_streams else _SyncStreams("cuda")
        self._storages: weakref.WeakValueDictionary[tuple[str, int], _HostStorage] = weakref.WeakValueDictionary()
        self._stash: list[weakref.ref[_HostStorage]] = []  # device storages held for their copy out, oldest first
        self._by_block: dict[int, list[weakref.ref[_HostStorage]]] = {}
        self._backward: int | None = None  # the autograd graph task whose end drains the stash
        self._backward_block: int | None = None
        self.bytes_offloaded = 0
        self.reused = 0

    @property
    def held_on_device(self) -> int:
        """How many offloaded storages the hooks still reference on the device."""
        refs = [ref for block in self._by_block.values() for ref in block]
        return sum(1 for storage in (ref() for ref in refs) if storage is not None and storage.device is not None)

    # -- forward ----------------------------------------------------------------------------
    def _pack(self, block_index: int, tensor: Tensor) -> Tensor | _HostView:
        nbytes = tensor.numel() * tensor.element_size()
        if (type(tensor) is not Tensor or tensor.device.type != self._streams.device_type
                or tensor.layout != torch.strided or nbytes == 0 or nbytes < self.min_bytes or self._excluded(tensor)):
            return tensor
        return _HostView(self._storage_for(block_index, tensor), tensor)

    def _storage_for(self, block_index: int, tensor: Tensor) -> _HostStorage:
        known = self._storages.get(storage_key(tensor))
        if known is not None and not known.alive.expired() and known.version == tensor._version:
            return known  # a view of a storage already copied (unchanged since)
        whole = _whole(tensor)
        host, copied = self._streams.copy_to_host(whole)
        storage = _HostStorage(tensor, block_index, whole, host, copied)
        self._storages[storage.key] = storage
        block = self._by_block.setdefault(block_index, [])
        if len(block) > 4096:
            block[:] = [ref for ref in block if ref() is not None]
        block.append(weakref.ref(storage))
        self._stash.append(weakref.ref(storage))
        self._drain(keep=self.max_in_flight)
        self.bytes_offloaded += whole.numel()
        return storage

    def _stashed(self) -> list[_HostStorage]:
        return [s for s in (ref() for ref in self._stash) if s is not None and s.device is not None]

    def _release(self, storage: _HostStorage) -> None:
        """Let go of the device storage once its copy out is done (the compute stream waits for it)."""
        self._streams.wait(storage.copied, storage.on)
        storage.device = None

    def _drain(self, keep: int = 0, above_block: int | None = None) -> None:
        """Release stashed storages: all but the newest ``keep``, or those of blocks above ``above_block``."""
        stashed = self._stashed()
        if above_block is not None:
            kept = [s for s in stashed if s.block <= above_block]
        else:
            kept = stashed[max(len(stashed) - keep, 0):] if keep else []
        for storage in stashed:
            if not any(storage is k for k in kept):
                self._release(storage)
        self._stash = [weakref.ref(s) for s in kept]

    # -- backward ---------------------------------------------------------------------------
    def _unpack(self, block_index: int, packed: Tensor | _HostView) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        self._entering(block_index)
        storage = packed.storage
        if storage.device is None and storage.fetched is None:
            self._fetch(storage)
        if storage.device is not None:
            if any(ref() is storage for ref in self._stash):  # still stashed: reused, never copied back
                self._stash = [ref for ref in self._stash if ref() is not storage]
                self.reused += 1
            self._streams.wait(storage.copied, storage.on)  # its memory outlives the copy out
            return packed.restore(storage.device)
        self._streams.wait(storage.ready, storage.on)
        return packed.restore(storage.fetched)

    def _entering(self, block_index: int) -> None:
        """At a block's first unpack in a backward: release what earlier blocks' backward left in the
        stash and start copying back this block's storages and the next offloaded block's below."""
        task = torch._C._current_graph_task_id()
        if task != self._backward:
            self._backward, self._backward_block = task, None
            if task != -1:  # inside autograd's backward (not an unpack from Python)
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if block_index == self._backward_block:
            return
        self._backward_block = block_index
        self._drain(above_block=block_index)
        self._fetch_block(block_index)
        # over a copy of the keys: _live() forgets a block whose storages are all gone (a graph dropped
        # without backward), which changes the dict
        below = [k for k in list(self._by_block) if k < block_index and self._live(k)]
        if below:
            self._fetch_block(max(below))

    def _live(self, block_index: int) -> list[_HostStorage]:
        live = [s for s in (ref() for ref in self._by_block.get(block_index, ())) if s is not None]
        if live:
            self._by_block[block_index] = [weakref.ref(s) for s in live]
        else:
            self._by_block.pop(block_index, None)
        return live

    def _fetch_block(self, block_index: int) -> None:
        for storage in reversed(self._live(block_index)):  # backward asks for the last saved first
            self._fetch(storage)

    def _fetch(self, storage: _HostStorage) -> None:
        """Start bringing ``storage`` back, unless it is on the device (then reused)."""
        if storage.device is not None or storage.fetched is not None:
            return
        resident = storage.resident()
        if resident is not None:  # the saved tensor is still alive on the device
            storage.device = resident
            self.reused += 1
            return
        storage.fetched, storage.ready = self._streams.copy_to_device(storage.host, storage.on, storage.copied)

    def _backward_done(self) -> None:
        """At the end of a backward: release the stash, and every device storage the hooks still hold
        (reused or copied back for saved tensors whose graph lives on: a retained graph, a branch the
        loss did not use); forget what is gone."""
        self._drain()
        self._backward, self._backward_block = None, None
        for block_index in list(self._by_block):
            for storage in self._live(block_index):
                storage.device = storage.fetched = storage.ready = None


def _whole(tensor: Tensor) -> Tensor:
    """The whole storage under ``tensor`` as a flat uint8 tensor (no autograd history)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
