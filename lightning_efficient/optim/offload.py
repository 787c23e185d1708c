"""Where 8-bit optimizer states live: in host memory between steps (offload), or paged after a resume.

**Host offload** (:func:`host_offloaded`). States live in host memory (pinned on CUDA) between
steps. During ``step`` each parameter's state is brought to the device just before its update
while the *next* parameter's state is copied in on one side stream, and each updated state is
copied back on a second side stream while the following updates run (the idea of Deep Optimizer
States). bitsandbytes' own ``step`` synchronises the whole device after every parameter; ours does
not: the update of a parameter waits only for the copy-in of its own state (an event) and the
copy-back waits only for its own update (an event). The host does wait, though not once per step:
once more than :data:`MAX_WRITES_IN_FLIGHT` copies back are in flight, it waits for the oldest
before going on, so from the third parameter with states on, once per parameter (for the copy back
issued two parameters earlier: this bounds the device memory to a few parameters' states); and at
the end of the step, for both side streams, so that the host buffers hold the states when ``step``
returns. Updates and copies overlap within that window. bitsandbytes launches its kernels on the
legacy default stream, so the step runs with the device's default stream current and orders the
copies against it (:meth:`CudaCopies.updating`). Copies to the device are allocated on that
compute stream, where they are used and freed; every device tensor used on another stream is
marked with ``record_stream``, so the caching allocator does not hand its memory out again before
that use is done. Each device has its own streams. The stream operations sit behind a small
interface (:class:`CudaCopies`, and :class:`SyncCopies`: synchronous copies that log what they did)
so that a CPU test drives the same schedule as a GPU.

**Paged states after a resume** (:func:`repaged_on_load`, :func:`repage_states`). bitsandbytes'
``load_state_dict`` puts the loaded ``state1``/``state2`` on the device as ordinary tensors: a
resumed paged optimizer would silently stop paging. After loading, every state bitsandbytes would
page (``get_state_buffer`` decides, as for a new state) is re-created as a paged buffer holding the
loaded values.

Lightning moves every optimizer state to the device right after ``load_state_dict`` (its
``load_optimizer_state_dict``): both classes put loaded states where they belong in
``settle_loaded_states()``, which ``EightBitOptimizer`` calls at train start (before the first
forward) and the next ``step`` calls at the latest.
"""

from __future__ import annotations

import contextlib
from collections import deque
from functools import cache
from typing import Any

import torch
from torch import Tensor

from lightning_efficient.optim.unsynced import on_default_stream, update_each_parameter

_SHARED_KEYS = ("qmap1", "qmap2")  # quantization maps: shared by every parameter, tiny, stay on the device
_PAGED_KEYS = ("state1", "state2")  # what bitsandbytes allocates with get_state_buffer (paged when large)

#: copies back to the host that may be in flight before the host waits for the oldest one: each
#: holds one parameter's device state until it is done
MAX_WRITES_IN_FLIGHT = 2


class CudaCopies:
    """The CUDA streams and events of host offload on one device.

    Copies to the device run on one side stream, copies to the host on another, so the two
    directions overlap each other and the updates on the compute stream. One event marks each
    parameter's copies done.

    The compute stream is the device's *default* stream, not the current one: bitsandbytes launches
    its optimizer kernels with no stream argument, so they run on the legacy default stream whatever
    stream is current. The step runs inside :meth:`updating`, which makes the default stream current
    (after it waits for the work queued on the stream current before, the gradients) and makes that
    stream wait for the step's work at the end: torch's ops of the step, bitsandbytes' updates and
    the copies' ordering then all refer to one stream.

    Args:
        device: the CUDA device the parameters are on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.default_stream(device)  # where bitsandbytes' kernels run
        self.to_device_stream = torch.cuda.Stream(device)
        self.to_host_stream = torch.cuda.Stream(device)

    def updating(self) -> contextlib.AbstractContextManager[None]:
        """Run the step's updates with the default stream current, ordered after the current stream's
        work so far and before its work to come (device-side waits; the host does not wait)."""
        return on_default_stream(self.device)

    def to_device(self, hosts: list[Tensor]) -> tuple[list[Tensor], Any]:
        """Start copying ``hosts`` to the device; the copies and the event that marks them done.

        The copies are allocated on the compute stream, where they are used and freed (their blocks
        stay in its pool, not the copy stream's); the copy stream first waits for the compute
        stream's work so far, which may still use a block the allocator hands out again."""
        stream = self.to_device_stream
        with torch.cuda.stream(self.compute):
            copies = [torch.empty_like(host, device=self.device) for host in hosts]
        stream.wait_stream(self.compute)
        with torch.cuda.stream(stream):
            for copy, host in zip(copies, hosts):
                copy.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for copy in copies:
            copy.record_stream(stream)  # dropped before its use (an exception), its memory still waits for the copy
        return copies, event

    def use(self, tensors: list[Tensor], event: Any) -> None:
        """Make the compute stream wait for ``event`` (only) before it uses ``tensors`` (allocated on it)."""
        self.compute.wait_event(event)

    def to_host(self, pairs: list[tuple[Tensor, Tensor]]) -> Any:
        """Copy each ``(device tensor, host tensor)`` pair to the host once the compute stream's work
        so far (the update) is done; the event that marks the copies done."""
        stream = self.to_host_stream
        updated = torch.cuda.Event()
        updated.record(self.compute)
        stream.wait_event(updated)
        with torch.cuda.stream(stream):
            for device_tensor, host in pairs:
                host.copy_(device_tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        for device_tensor, _ in pairs:
            device_tensor.record_stream(stream)  # still read by this copy after the caller drops it
        return done

    def wait_host(self, event: Any) -> None:
        """Block the host until ``event`` is reached."""
        event.synchronize()

    def finish(self) -> None:
        """Block the host until every copy is done (the host buffers then hold the states)."""
        self.compute.wait_stream(self.to_device_stream)
        self.to_host_stream.synchronize()
        self.to_device_stream.synchronize()


class SyncCopies:
    """The same interface with synchronous copies (any device, CPU included), logging each operation.

    What a CPU test drives: ``log`` holds ``(operation, event number, tensor count)`` in the order
    the optimizer issued them (``to_device``, ``use``, ``to_host``, ``wait_host``, ``finish``).
    The "device" copies are fresh tensors on the host tensor's device.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, int, int]] = []
        self._events = 0

    def _event(self) -> int:
        self._events += 1
        return self._events

    def to_device(self, hosts: list[Tensor]) -> tuple[list[Tensor], int]:
        """Copy ``hosts`` now; the copies and an event number."""
        copies = [host.clone() for host in hosts]
        event = self._event()
        self.log.append(("to_device", event, len(hosts)))
        return copies, event

    def use(self, tensors: list[Tensor], event: int) -> None:
        """Log the wait for ``event``."""
        self.log.append(("use", event, len(tensors)))

    def to_host(self, pairs: list[tuple[Tensor, Tensor]]) -> int:
        """Copy each pair's device tensor into its host tensor now; an event number."""
        for device_tensor, host in pairs:
            host.copy_(device_tensor)
        event = self._event()
        self.log.append(("to_host", event, len(pairs)))
        return event

    def updating(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to order: the copies are synchronous."""
        return contextlib.nullcontext()

    def wait_host(self, event: int) -> None:
        """Log the host's wait for ``event``."""
        self.log.append(("wait_host", event, 0))

    def finish(self) -> None:
        """Log the end-of-step wait."""
        self.log.append(("finish", 0, 0))


class _HostOffloadMixin:
    """Mixed into a bitsandbytes optimizer class: keeps per-parameter states in host memory."""

    def _offload_setup(self) -> None:
        self._host_states: dict[int, dict[str, Tensor]] = {}  # id(param) -> key -> host buffer
        self._staged: dict[int, tuple[dict[str, Tensor], Any]] = {}  # prefetched device states and their event
        self._copies: dict[torch.device, CudaCopies | SyncCopies] = {}  # one per parameters' device
        self._writes: deque[Any] = deque()  # events of the copies back still in flight, oldest first
        self._order: list[Tensor] = []
        self._next_index: dict[int, int] = {}
        self._loaded = False  # a state was loaded: place it on the host at the next step at the latest

    def _copies_for(self, device: torch.device) -> CudaCopies | SyncCopies:
        copies = self._copies.get(device)
        if copies is None:
            copies = self._copies[device] = CudaCopies(device) if device.type == "cuda" else SyncCopies()
        return copies

    def _movable(self, p: Tensor) -> dict[str, Tensor]:
        return {k: v for k, v in self.state[p].items() if isinstance(v, Tensor) and k not in _SHARED_KEYS}

    def _host_buffer(self, p: Tensor, key: str, like: Tensor) -> Tensor:
        """The host buffer of ``p``'s state ``key`` (made once, pinned for a CUDA parameter, reused every step)."""
        host = self._host_states.setdefault(id(p), {})
        buffer = host.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=p.is_cuda)
            host[key] = buffer
        return buffer

    def _start_fetch(self, p: Tensor) -> None:
        """Start copying ``p``'s states that are in their host buffers to the device (others stay)."""
        host = self._host_states.get(id(p), {})
        keys = [key for key, value in self._movable(p).items() if host.get(key) is value]
        staged: dict[str, Tensor] = {}
        event = None
        if keys:
            copies, event = self._copies_for(p.device).to_device([self.state[p][key] for key in keys])
            staged = dict(zip(keys, copies))
        self._staged[id(p)] = (staged, event)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step with states fetched per parameter and written back to the host.

        bitsandbytes' loop (overrides checked once, a state made on first use, ``prefetch_state``
        then ``update_step`` per parameter) without its device synchronisation after every
        parameter: the copies are ordered by events; the host waits for the oldest copy back while
        more than :data:`MAX_WRITES_IN_FLIGHT` are in flight, and for every copy at the end.
        """
        loss = None
        if closure is not None:  # before listing the parameters: the closure computes the gradients
            with torch.enable_grad():
                loss = closure()
        if not self.initialized:
            self.check_overrides()  # not bitsandbytes' to_gpu(): the states belong on the host
            self.initialized = True
        if self._loaded:
            self.settle_loaded_states()
        self._order = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self._next_index = {id(p): i + 1 for i, p in enumerate(self._order)}
        try:
            with contextlib.ExitStack() as updating:
                for device in dict.fromkeys(p.device for p in self._order):
                    updating.enter_context(self._copies_for(device).updating())
                update_each_parameter(self)
        finally:
            for copies in self._copies.values():
                copies.finish()
            self._staged.clear()
            self._writes.clear()
        return loss

    def prefetch_state(self, p: Tensor) -> None:
        """Put ``p``'s state on its device (waiting for its own copy only) and start copying the next one's."""
        if id(p) not in self._staged:
            self._start_fetch(p)
        staged, event = self._staged.pop(id(p))
        if staged:
            self._copies_for(p.device).use(list(staged.values()), event)
            self.state[p].update(staged)
        index = self._next_index.get(id(p))
        if index is not None and index < len(self._order):
            following = self._order[index]
            if self.state[following] and id(following) not in self._staged:
                self._start_fetch(following)

    def update_step(self, group, p, gindex, pindex):
        """Update ``p`` on its device, then start copying its state back to (pinned) host memory."""
        super().update_step(group, p, gindex, pindex)
        hosts = {key: self._host_buffer(p, key, value) for key, value in self._movable(p).items()}
        if not hosts:
            return
        copies = self._copies_for(p.device)
        self._writes.append(copies.to_host([(self.state[p][key], host) for key, host in hosts.items()]))
        self.state[p].update(hosts)  # each device copy is freed once its copy back is done
        while len(self._writes) > MAX_WRITES_IN_FLIGHT:
            copies.wait_host(self._writes.popleft())

    def load_state_dict(self, state_dict, move_to_device=True):
        """Load a state (any bitsandbytes optimizer's, offloaded or not) into the host buffers."""
        super().load_state_dict(state_dict, move_to_device=move_to_device)
        self._host_states.clear()
        self.settle_loaded_states()
        self._loaded = True  # Lightning moves every state to the device right after loading

    def settle_loaded_states(self) -> None:
        """Copy every state that is not in its host buffer (a loaded state, or one that Lightning's
        ``load_optimizer_state_dict`` moved to the device after loading) into it, and drop the other copy."""
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    for key, value in self._movable(p).items():
                        host = self._host_buffer(p, key, value)
                        if host is not value:
                            host.copy_(value)
                            self.state[p][key] = host
        self._loaded = False


def share_quantization_maps(optimizer: torch.optim.Optimizer) -> int:
    """Point every parameter's ``qmap1``/``qmap2`` at one tensor per key and device, as bitsandbytes holds them.

    bitsandbytes gives every 8-bit state the same two quantization maps; a loaded state holds its own copy per
    parameter (one ``load_state_dict`` moves each state to the device apart): 2 KiB a parameter, which an offloaded
    optimizer leaves on the device (0.1 MiB for a 110M GPT on an H200). Only maps equal to the first one are
    shared. Returns how many were re-pointed."""
    shared: dict[tuple[str, torch.device], Tensor] = {}
    count = 0
    for state in optimizer.state.values():
        for key in _SHARED_KEYS:
            value = state.get(key) if isinstance(state, dict) else None
            if type(value) is not Tensor:
                continue
            first = shared.setdefault((key, value.device), value)
            if first is not value and torch.equal(first, value):
                state[key] = first
                count += 1
    return count


@cache
def host_offloaded(cls: type) -> type:
    """A subclass of the bitsandbytes optimizer ``cls`` whose states live in host memory between steps."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        self._offload_setup()

    return type(f"HostOffloaded{cls.__name__}", (_HostOffloadMixin, cls), {"__init__": __init__})


def repage_states(optimizer: torch.optim.Optimizer) -> int:
    """Re-create the states a paged bitsandbytes ``optimizer`` would page as paged buffers, values kept.

    For every ``state1``/``state2`` not held by bitsandbytes' page manager, asks ``optimizer.get_state_buffer`` for a
    buffer of its shape and dtype, as bitsandbytes does for a new state; where that buffer is paged
    (bitsandbytes pages tensors of 100,000 elements or more on CUDA) the values are copied into it
    and it replaces the state. Returns the number of states re-paged.
    """
    if not getattr(optimizer, "is_paged", False):
        return 0
    # a tensor is paged when bitsandbytes' page manager holds it: a loaded tensor may carry a stale
    # ``is_paged`` attribute (torch.save keeps it) without being managed memory
    registered = {id(t) for t in optimizer.page_mng.paged_tensors}
    count = 0
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in _PAGED_KEYS:
                    value = state.get(key)
                    if not isinstance(value, Tensor) or id(value) in registered:
                        continue
                    like = value if value.device == p.device else value.to(p.device)
                    buffer = optimizer.get_state_buffer(like, dtype=value.dtype)
                    if not getattr(buffer, "is_paged", False):
                        continue  # bitsandbytes would not page it either (small, or on CPU)
                    buffer.copy_(value)
                    state[key] = buffer
                    registered.add(id(buffer))
                    count += 1
    return count


class _RepagedOnLoadMixin:
    """Mixed into a paged bitsandbytes optimizer class: states stay paged after ``load_state_dict``.

    Loaded states are paged again by :meth:`settle_loaded_states`, which ``EightBitOptimizer`` calls
    at train start (after Lightning's ``load_optimizer_state_dict`` has moved every state to the
    device) and the next ``step`` calls (before its first update) at the latest.
    """

    _loaded = False

    def load_state_dict(self, state_dict, move_to_device=True):
        """Load a state; what bitsandbytes' loading put on the device as ordinary tensors is paged again by
        :meth:`settle_loaded_states` (not at once: Lightning moves the states after loading, and paged
        memory that bitsandbytes' page manager holds is never freed)."""
        super().load_state_dict(state_dict, move_to_device=move_to_device)
        self._loaded = True

    def settle_loaded_states(self) -> None:
        """Page again every state bitsandbytes would page that is an ordinary tensor now."""
        if repage_states(self) and torch.cuda.is_available():
            torch.cuda.synchronize()  # copies into managed memory are done before the first paged kernel
        self._loaded = False

    def prefetch_state(self, p: Tensor) -> None:
        """bitsandbytes' prefetch; at the first parameter after a load, every loaded state is paged again
        first (not by overriding ``step``: torch's step hooks would run twice)."""
        if self._loaded:
            self.settle_loaded_states()
        super().prefetch_state(p)


@cache
def repaged_on_load(cls: type) -> type:
    """A subclass of the paged bitsandbytes optimizer ``cls`` whose loaded states are paged again."""
    return type(cls.__name__, (_RepagedOnLoadMixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
