"""Exact memory counts in plain torch: saved-for-backward bytes, optimizer-state bytes, peak RSS.

Every count is of distinct storages (two views of one storage count once), in bytes. A DTensor (an
FSDP2 parameter, its gradient and optimizer states) counts as its local shard: the bytes this rank
holds. A storage of size 0 (an FSDP2 unsharded parameter between its all-gathers) holds nothing and
counts as nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import platform
import resource
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from lightning_efficient._torch import eager_saved_tensors_hooks, storage_key

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - a torch built without torch.distributed
    FSDPModule = DTensor = None


def _iter_tensors(obj: object) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _iter_tensors(value)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor (FSDP2, tensor parallelism), else
    ``tensor`` itself."""
    return tensor.to_local() if DTensor is not None and isinstance(tensor, DTensor) else tensor


def local_storage(tensor: Tensor) -> tuple[tuple[str, int], int] | None:
    """``(storage key, bytes)`` of the storage behind this rank's part of ``tensor`` (see
    :func:`local_tensor`), or None for a tensor without one: a non-strided layout, or a storage of
    size 0 (an FSDP2 unsharded parameter freed after its forward has no data pointer to key on)."""
    tensor = local_tensor(tensor)
    if tensor.layout != torch.strided:
        return None
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes == 0:
        return None
    return storage_key(tensor), nbytes


def distinct_storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once; a DTensor's
    local shard; empty storages count 0)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        found = local_storage(tensor)
        if found is not None:
            seen.setdefault(*found)
    return sum(seen.values())


class ParameterStorages:
    """Tells whether a tensor lives in one of a module's parameter or buffer storages: a predicate
    ``storages(tensor) -> bool`` for saved-tensor hooks, which must not treat weights as activations.

    Under DDP or one device the parameters' storages never change. Under FSDP2 (``fully_shard``)
    they do: a parameter is a DTensor (its local shard, whose storage stays put, is what this rank
    holds) until FSDP2's pre-forward hook all-gathers it into an unsharded plain tensor, whose
    storage is freed again after the forward (and re-allocated at another address next time). So
    while :meth:`track` is active, a forward pre-hook on every FSDP2 module, run after FSDP2's own
    (which it registers first), adds the storages of the module's unsharded parameters, and a
    forward hook, run after FSDP2's reshard, reads them again: a block resharded after its forward
    has none left (an activation allocated later at a freed weight's address is an activation), while
    the root module, which FSDP2 leaves unsharded after the forward until backward, keeps its
    gathered weights recognised — also when the loss uses one after the forward returned
    (``FusedTokenLoss(hidden, self.head.weight, labels)``). Each hook reads only its own module's
    parameters that are not DTensors (those of sharded children are DTensors again by then).

    Args:
        module: the model (a LightningModule).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._gathered: dict[int, set[tuple[str, int]]] = {}  # id(FSDP2 module) -> its unsharded storages
        self._static: set[tuple[str, int]] = set()
        self.refresh()

    def refresh(self) -> None:
        """Read the storages of every parameter and buffer registered now (forgetting the unsharded
        ones the hooks added)."""
        keys = (local_storage(t) for t in [*self.module.parameters(), *self.module.buffers()])
        self._static = {found[0] for found in keys if found is not None}
        self._gathered = {}
        self._keys = set(self._static)

    def _unsharded(self, module: nn.Module) -> set[tuple[str, int]]:
        keys = (local_storage(p) for p in module.parameters() if DTensor is None or not isinstance(p, DTensor))
        return {found[0] for found in keys if found is not None}

    def _update(self, module: nn.Module) -> None:
        # before and after the module's forward alike, its parameters that are not DTensors now are the
        # gathered ones: after the forward FSDP2 has resharded a block (none left), but not the root,
        # whose gathered weights stay in use after it returns (a loss on ``self.head.weight``)
        self._gathered[id(module)] = self._unsharded(module)
        self._keys = self._static.union(*self._gathered.values())

    def __call__(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lives in a parameter or buffer storage (as of the last refresh)."""
        found = local_storage(tensor)
        return found is not None and found[0] in self._keys

    def track(self) -> ParameterStorages:
        """Keep up with FSDP2's all-gathers (a no-op without FSDP2); undone by :meth:`stop`. Call it
        while the parameters are sharded (between steps)."""
        self.stop()
        for module in self.module.modules():
            if is_fsdp2(module):
                self._handles.append(module.register_forward_pre_hook(lambda m, *_: self._update(m)))
                self._handles.append(module.register_forward_hook(lambda m, *_: self._update(m)))
        self.refresh()
        return self

    def stop(self) -> None:
        """Remove the hooks :meth:`track` added."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def is_fsdp2(module: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``module`` itself."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


def unsharded_class(module: nn.Module) -> type:
    """The module's own class: the one ``fully_shard`` derived ``FSDP<Name>`` from, else its type."""
    if not is_fsdp2(module):
        return type(module)
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Exact bytes of every tensor in ``optimizer.state`` (any optimizer, bitsandbytes' included).

    Tensors shared between parameters (such as bitsandbytes' quantization maps) count once; DTensor
    states (of FSDP2 parameters) count their local shard.
    """
    return distinct_storage_bytes(_iter_tensors(list(optimizer.state.values())))


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's distinct parameters (tied weights count once; sharded ones: this rank's shard)."""
    return distinct_storage_bytes(module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's gradients that currently exist (sharded ones: this rank's shard)."""
    return distinct_storage_bytes(p.grad for p in module.parameters() if p.grad is not None)


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward while the context is active.

    A ``torch.autograd.graph.saved_tensors_hooks`` context whose pack hook notes each saved
    tensor's storage and returns the tensor unchanged, so nothing is copied or kept alive longer.
    Storages of the ``exclude`` tensors (pass the model's parameters and buffers) are not counted:
    they are not activations. What an inner ``saved_tensors_hooks`` context (activation
    checkpointing, offload) packs is not seen here, by the way these hooks nest.

    Args:
        exclude: tensors whose storages are not activations, or a predicate saying so of a tensor
            (a :class:`ParameterStorages`, which also sees FSDP2's unsharded parameters).
    """

    def __init__(self, exclude: Iterable[Tensor] | Callable[[Tensor], bool] = ()) -> None:
        if callable(exclude):
            self._excluded_by: Callable[[Tensor], bool] | None = exclude
            self._excluded: set[tuple[str, int]] = set()
        else:
            self._excluded_by = None
            self._excluded = {found[0] for found in map(local_storage, exclude) if found is not None}
        self._seen: dict[tuple[str, int], int] = {}
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: Tensor) -> Tensor:
        found = local_storage(tensor)
        excluded = found is None or found[0] in self._excluded
        if not excluded and (self._excluded_by is None or not self._excluded_by(tensor)):
            self._seen.setdefault(*found)
        return tensor

    @staticmethod
    def _unpack(tensor: Tensor) -> Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        """Distinct bytes saved so far."""
        return sum(self._seen.values())

    def __enter__(self) -> SavedTensorCounter:
        self._seen.clear()
        self._context = eager_saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._context is not None
        self._context.__exit__(*exc)
        self._context = None


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``VmHWM`` on Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


_OPEN_METERS: weakref.WeakSet[PeakMemory] = weakref.WeakSet()
"""The meters reset and not yet dropped: each reset of the process's one peak first hands them the peak it drops."""


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index where it is CUDA's current one named without (``cuda`` is ``cuda:0`` there)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_peak_bytes(device: torch.device) -> int:
    """The device's peak since its last reset: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak
    RSS (``VmHWM``)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def _meters_of(device: torch.device) -> list[PeakMemory]:
    """The open :class:`PeakMemory` meters reading ``device``'s peak (an indexed device)."""
    return [m for m in list(_OPEN_METERS) if (m.device.type == "cuda") == (device.type == "cuda")
            and (device.type != "cuda" or m.device == device)]


def reset_peak(device: torch.device) -> bool:
    """Reset the device's peak (CUDA's peak allocation, else the process's peak RSS: Linux ``clear_refs``), first
    handing the peak it drops to every open :class:`PeakMemory` of that device, so that one reader's reset does not
    shorten another's window (AutoFit measuring inside a MemoryReport's training window, a benchmark's meter around
    AutoFit's planning); False where the peak RSS cannot be reset."""
    device = _indexed(device)
    watching = _meters_of(device)
    if watching:
        dropped = device_peak_bytes(device)
        for meter in watching:
            meter.dropped_peak_bytes = max(meter.dropped_peak_bytes, dropped)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


_SECONDS_OUTSIDE_TRAINING = [0.0]


def seconds_outside_training() -> float:
    """The seconds this process has spent inside :func:`outside_training` so far (a step clock subtracts what passed
    between its readings)."""
    return _SECONDS_OUTSIDE_TRAINING[0]


def _pack_as_is(tensor: torch.Tensor) -> torch.Tensor:
    # (detached: the tensor itself, an operation's output, would hold its own grad_fn in a reference cycle that a forward
    # ended by an error, never reaching backward, leaves behind)
    return tensor.detach()


@contextlib.contextmanager
def outside_training(device: torch.device) -> Iterator[None]:
    """Leave what runs inside out of what the fit's meters count.

    For work between training steps that is not training (AutoFit measuring again, ActivationMemory profiling again,
    at a step's start mid-fit):

    * every :class:`PeakMemory` open on ``device``, and on the host (where measuring copies the run's state), keeps the
      peak it had before and goes on from after it (a meter reset inside reads from its own reset);
    * a saved-tensor count open around it (:class:`SavedTensorCounter`, :class:`MemoryReport`'s) does not see what
      is saved inside: it is packed by hooks that keep the tensor as it is (counters opened inside count as usual);
    * the seconds inside are added to :func:`seconds_outside_training`, which step clocks subtract.
    """
    devices = list(dict.fromkeys([_indexed(device), torch.device("cpu")]))
    before = {meter: (max(device_peak_bytes(watched), meter.dropped_peak_bytes), meter.resets)
              for watched in devices for meter in _meters_of(watched)}
    started = time.perf_counter()
    try:
        with eager_saved_tensors_hooks(_pack_as_is, _pack_as_is):
            yield
    finally:
        _SECONDS_OUTSIDE_TRAINING[0] += time.perf_counter() - started
        for watched in devices:
            reset_peak(watched)
        for meter, (peak, resets) in before.items():
            if meter.resets == resets:  # (a meter reset inside keeps what it read since its reset)
                meter.dropped_peak_bytes = peak


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs``; see :func:`reset_peak`); False where that is
    not possible."""
    return reset_peak(torch.device("cpu"))


def current_rss_bytes() -> int:
    """This process's resident set size now, in bytes (0 where unknown)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@functools.cache
def _mkl_free_buffers() -> Callable[[], None] | None:
    """MKL's ``mkl_free_buffers`` where torch runs on MKL on Linux (x86 builds link it into ``libtorch_cpu``,
    exported as ``mkl_serv_free_buffers``; a build against a shared MKL exports ``mkl_free_buffers``), else ``None``."""
    if not sys.platform.startswith("linux") or not torch.backends.mkl.is_available():
        return None
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    for path in ([library] if os.path.exists(library) else []) + [None]:
        try:
            handle = ctypes.CDLL(path)
        except (OSError, TypeError):
            continue
        for symbol in ("mkl_serv_free_buffers", "mkl_free_buffers"):
            function = getattr(handle, symbol, None)
            if function is not None:
                function.argtypes, function.restype = [], None
                return function
    return None


def release_free_memory(device: torch.device | None = None) -> None:
    """Hand memory the process has freed back to the system, so a peak measured next starts from
    what is really held: on Linux MKL's cached work buffers (its memory manager keeps one for each matrix
    shape multiplied so far, which a fit at one micro-batch size never holds all of) and glibc's
    ``malloc_trim(0)`` (freed heap pages otherwise stay resident and count in RSS); on CUDA the caching
    allocator's free blocks."""
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    free_mkl_buffers = _mkl_free_buffers()
    if free_mkl_buffers is not None:
        free_mkl_buffers()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def freed_heap_stays_resident() -> bool:
    """Whether this process's RSS keeps heap that was freed: glibc's allocator with its default mmap threshold (set
    neither by ``MALLOC_MMAP_THRESHOLD_`` nor by ``GLIBC_TUNABLES``' ``glibc.malloc.mmap_threshold``), which serves
    large tensors from a heap it keeps once it has grown. Then a fit's peak RSS depends on what ran before in the
    process, and readings of the same step differ between processes."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    started_with = _environment_at_start()  # (glibc reads it when the process starts: a later os.environ does nothing)
    return "MALLOC_MMAP_THRESHOLD_" not in started_with and "glibc.malloc.mmap_threshold" not in started_with.get("GLIBC_TUNABLES", "")


def _environment_at_start() -> dict[str, str]:
    """The environment this process started with (``/proc/self/environ``; ``os.environ`` where it cannot be read)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if b"=" in entry)


def fit_start_rss_bytes() -> int:
    """The RSS a fit's memory is counted above, read when the fit is set up: after a garbage collection and
    :func:`release_free_memory`. Earlier work's garbage (reference cycles the previous fit, a notebook cell or a test
    left, tensors among them) is freed now: a collection during the fit would otherwise free it then, and every
    reading after that would count from a start that included it (a profile read 9 MiB low on a 20 MiB model)."""
    gc.collect()
    release_free_memory()
    return current_rss_bytes()


@contextlib.contextmanager
def automatic_collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside (an explicit ``gc.collect()`` still runs, and moves what survives it
    into the oldest generation): what a collection would free at a random moment is not the work measured inside,
    and freed mid-way it moves the readings that follow."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def older_collections() -> int:
    """How many collections of the older generations (1 and 2) this process has run."""
    return sum(generation["collections"] for generation in gc.get_stats()[1:])


def collect_young_garbage() -> None:
    """Free the youngest generation's garbage: what was made since the last collection, as an automatic collection
    soon would (with automatic collection paused, between two readings, so that none counts another's garbage)."""
    gc.collect(0)


def collect_garbage_made_since(older: int) -> None:
    """Free the garbage made with automatic collection paused since :func:`older_collections` read ``older``.

    Where no collection of an older generation ran since, all of it is in the young generations, which a collection
    of those frees without walking the whole heap (a full collection took 0.2 s beside the demo GPT, a training
    step's worth). A collection of an older generation since (a ``gc.collect()`` in the user's ``training_step``)
    moved what was alive then into the oldest, where it may have become garbage after: then, and on a collector
    whose generations are not those (CPython 3.14's incremental one), a full collection."""
    if older_collections() != older or sys.version_info >= (3, 14):
        gc.collect()
    else:
        gc.collect(1)


class PeakMemory:
    """The peak memory a fit counts, measured between :meth:`reset` and :meth:`read`: on CUDA
    ``torch.cuda.max_memory_allocated``; elsewhere the process's peak RSS above ``start_rss_bytes``
    (the RSS when the fit started, as :func:`fit_start_rss_bytes` reads it), with freed heap handed back first
    (:func:`release_free_memory`).

    The process has one peak per device, which each meter resets to start its own: a reset through
    :func:`reset_peak` hands the peak it drops to the other meters open, so each reads the highest since its own
    reset, whatever was reset in between.

    Args:
        device: the device the fit runs on.
        start_rss_bytes: the RSS the CPU figure is counted above.
    """

    _warned = False

    def __init__(self, device: torch.device, start_rss_bytes: int = 0) -> None:
        self.device = _indexed(device)
        self.start_rss_bytes = start_rss_bytes
        self.dropped_peak_bytes = 0  # the highest peak another reset dropped since this meter's own reset
        self.resets = 0  # how many times this meter was reset

    def reset(self, release: bool = True) -> None:
        """Start a new peak from what is held now (``release``: with freed memory handed back first; on CPU where
        the peak cannot be reset, warns once: the readings are then the process's all-time peak)."""
        if release:
            release_free_memory(self.device)
        if not reset_peak(self.device) and not PeakMemory._warned:
            PeakMemory._warned = True
            warnings.warn("PeakMemory: this system cannot reset the peak RSS (/proc/self/clear_refs): each reading is "
                          "the process's peak so far, not the peak since the reset", stacklevel=2)
        self.dropped_peak_bytes = 0
        self.resets += 1
        _OPEN_METERS.add(self)

    def read(self) -> int:
        """The peak since the last :meth:`reset`, in bytes."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(device_peak_bytes(self.device), self.dropped_peak_bytes)
        return max(0, max(peak_rss_bytes(), self.dropped_peak_bytes) - self.start_rss_bytes)
