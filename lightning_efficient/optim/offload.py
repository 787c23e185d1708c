"""Host offload of 8-bit optimizer states, updated on an interleaved schedule.

States live in host memory (pinned on CUDA) between steps. During ``step`` each parameter's state
is brought to the device just before its update while the *next* parameter's state is copied on a
side stream, and the updated state is copied back asynchronously: transfers overlap the updates
(the idea of Deep Optimizer States). On a CPU device the copies are no-ops and the schedule is the
same, which is what the tests exercise.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

_SHARED_KEYS = ("qmap1", "qmap2")  # quantization maps: shared by every parameter, tiny, stay on the device


class _HostOffloadMixin:
    """Mixed into a bitsandbytes optimizer class: keeps per-parameter states in host memory."""

    def _offload_setup(self) -> None:
        self._host_states: dict[int, dict[str, Tensor]] = {}
        self._device_states: dict[int, dict[str, Tensor]] = {}
        self._copy_stream = None
        self._order: list[Tensor] = []
        self._next_index: dict[int, int] = {}

    def _movable(self, p: Tensor) -> dict[str, Tensor]:
        return {k: v for k, v in self.state[p].items() if isinstance(v, Tensor) and k not in _SHARED_KEYS}

    def _fetch(self, p: Tensor, non_blocking: bool) -> dict[str, Tensor]:
        return {k: v.to(p.device, non_blocking=non_blocking) for k, v in self._movable(p).items()}

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step with states fetched per parameter and written back to the host."""
        loss = None
        if closure is not None:  # before listing the parameters: the closure computes the gradients
            with torch.enable_grad():
                loss = closure()
        if self._copy_stream is None and any(p.is_cuda for g in self.param_groups for p in g["params"]):
            self._copy_stream = torch.cuda.Stream()
        self._order = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self._next_index = {id(p): i + 1 for i, p in enumerate(self._order)}
        super().step()
        if self._copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self._copy_stream)
            self._copy_stream.synchronize()
        self._device_states.clear()
        return loss

    def prefetch_state(self, p: Tensor) -> None:
        """Bring ``p``'s state to its device (waiting for an earlier prefetch) and prefetch the next one."""
        if id(p) in self._device_states and self._copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self._copy_stream)
        staged = self._device_states.pop(id(p), None) or self._fetch(p, non_blocking=False)
        self.state[p].update(staged)
        index = self._next_index.get(id(p))
        if index is not None and index < len(self._order):
            following = self._order[index]
            if self.state[following]:
                if self._copy_stream is not None:
                    with torch.cuda.stream(self._copy_stream):
                        self._device_states[id(following)] = self._fetch(following, non_blocking=True)
                else:
                    self._device_states[id(following)] = self._fetch(following, non_blocking=False)

    def update_step(self, group, p, gindex, pindex):
        """Update ``p`` on its device, then copy its state back to (pinned) host memory."""
        super().update_step(group, p, gindex, pindex)
        host = self._host_states.setdefault(id(p), {})
        for key, value in self._movable(p).items():
            if key not in host or host[key].shape != value.shape or host[key].dtype != value.dtype:
                host[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
            if value.is_cuda and self._copy_stream is not None:
                self._copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._copy_stream):
                    host[key].copy_(value, non_blocking=True)
            else:
                host[key].copy_(value)
            self.state[p][key] = host[key]


@cache
def host_offloaded(cls: type) -> type:
    """A subclass of the bitsandbytes optimizer ``cls`` whose states live in host memory between steps."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        self._offload_setup()

    return type(f"HostOffloaded{cls.__name__}", (_HostOffloadMixin, cls), {"__init__": __init__})
