"""bitsandbytes' optimizer step without its device synchronisation after every parameter.

bitsandbytes (0.50) calls ``torch.cuda.synchronize()`` after each parameter's update: the host waits for
the device once per parameter, and no launch overlaps the device's work (about 150 waits a step for the
110M demo GPT, whose 8-bit step ran at 0.69-0.78x the tokens/s of torch's fused AdamW on an H200). The
updates are independent kernels on one stream, so their order needs no wait; bitsandbytes' own open
change (pull request 2050) removes these waits for non-paged CUDA optimizers too. Its kernels run on the
device's legacy default stream whatever stream is current, so the step is ordered after the current
stream's work (the gradients) and before what follows, by device-side waits (:func:`on_default_stream`).
Paged optimizers keep bitsandbytes' step (managed memory is prefetched on that stream), and host-offloaded
ones have their own (:mod:`lightning_efficient.optim.offload`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache

import torch


@contextlib.contextmanager
def on_default_stream(device: torch.device) -> Iterator[None]:
    """Run the body with ``device``'s default stream current (where bitsandbytes' kernels run), ordered after the
    current stream's work so far and before its work to come: device-side waits, the host does not wait. Nothing
    to do on CPU, or where the default stream is already current."""
    if device.type != "cuda":
        yield
        return
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current == default:
        yield
        return
    default.wait_stream(current)
    try:
        with torch.cuda.stream(default):
            yield
    finally:
        current.wait_stream(default)


def update_each_parameter(optimizer: torch.optim.Optimizer) -> None:
    """bitsandbytes' loop over the parameters with gradients, without its wait after each: a state made on first use,
    then ``prefetch_state`` and ``update_step`` (the optimizer's own, so a mixin's overrides take part)."""
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if len(optimizer.state[p]) == 0:
                optimizer.init_state(group, p, gindex, pindex)
            optimizer.prefetch_state(p)
            optimizer.update_step(group, p, gindex, pindex)


class _UnsyncedStepMixin:
    """Mixed into a bitsandbytes optimizer class: its ``step`` loop (overrides checked and states moved once, a
    state made on first use, ``prefetch_state`` then ``update_step`` per parameter) without the wait per parameter."""

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; the host does not wait for the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.initialized:
            self.check_overrides()
            self.to_gpu()
            self.initialized = True
        with contextlib.ExitStack() as ordered:
            for device in dict.fromkeys(p.device for g in self.param_groups for p in g["params"] if p.grad is not None):
                ordered.enter_context(on_default_stream(device))
            update_each_parameter(self)
        return loss


@cache
def unsynced(cls: type) -> type:
    """A subclass of the (non-paged) bitsandbytes optimizer ``cls`` whose ``step`` does not wait for the device after
    every parameter (same name and module: it is the same optimizer, for code that tells optimizers by them)."""
    return type(cls.__name__, (_UnsyncedStepMixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
