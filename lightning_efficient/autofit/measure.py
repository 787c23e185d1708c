"""What AutoFit plans from, measured on real training steps of the run: a forward and backward at two
micro-batch sizes (peak memory and time) and at a ladder of smaller ones (time), the blocks' profile, and
each optimizer option's state bytes, step time and step peak. Parameters, buffers, optimizer states and random streams are put back
afterwards, so measuring changes nothing in the run.

The steps run the class's ``training_step`` in the precision plugin's context, outside the loop (as the
micro-batch probe and ``ActivationMemory(policy="auto")`` do): under DDP none of DDP's collectives runs;
under FSDP2, and where a SyncBatchNorm gathers under DDP, every rank runs the same sizes in the same order
(nothing follows a rank's own readings), so the collectives stay in step.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_efficient._samples import token_ids
from lightning_efficient._step import restored_run_state, run_state_tensors, step_loss
from lightning_efficient._torch import synchronize
from lightning_efficient.activations.planner import BlockProfile
from lightning_efficient.activations.profile import profile_blocks
from lightning_efficient.autofit.model import OptimizerOption, RankProfile
from lightning_efficient.balance.probe import is_out_of_memory, release_optimizer_state
from lightning_efficient.memory import (
    PeakMemory,
    collect_young_garbage,
    is_fsdp2,
    local_tensor,
    optimizer_state_bytes,
    release_free_memory,
)
from lightning_efficient.report import host_state_bytes, paged_state_bytes


@dataclass
class OptimizerSpec:
    """An optimizer option to measure: ``build`` gives the optimizers to step (the run's own, or twins)."""

    name: str
    build: Callable[[], list[torch.optim.Optimizer]]
    cleanup: Callable[[], None] = lambda: None
    own: bool = False  # the run's own optimizers (else their states, held while measuring, are not the option's)


def device_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of ``optimizer``'s states on ``device`` (paged and host-offloaded states excluded on CUDA)."""
    total = optimizer_state_bytes(optimizer)
    if device.type != "cuda":
        return total
    return total - paged_state_bytes(optimizer) - host_state_bytes(optimizer)


def can_resize(dataloader: DataLoader) -> bool:
    """True when samples can be drawn by index and collated into a batch of any size."""
    return not isinstance(dataloader.dataset, IterableDataset) and hasattr(dataloader.dataset, "__getitem__") \
        and hasattr(dataloader.dataset, "__len__") and dataloader.batch_size is not None


def tokens_per_sample(batch: Any) -> float | None:
    """Tokens in one sample of ``batch`` (:func:`~lightning_efficient._samples.token_ids`' elements per row); None for a
    batch without token ids (float features, images, 1-D values: the plan's rate is then in samples)."""
    tensor = token_ids(batch)
    if tensor is None or tensor.shape[0] == 0:
        return None
    return tensor.numel() / tensor.shape[0]


def measure_rank(
    strategy: Any,
    batches: Callable[[int], Any],
    sizes: tuple[int, int],
    *,
    meter: PeakMemory,
    options: list[OptimizerSpec],
    blocks: list[tuple[str, nn.Module]],
    exclude: Callable[[torch.Tensor], bool],
    policies: tuple[str, ...],
    budget_bytes: int,
    usable_bytes: int | None = None,
    fixed_policies: list[str] | None = None,
    min_offload_bytes: int = 2**16,
    offload_dir: str | None = None,
    ladder: tuple[int, ...] = (),
    option_steps: int = 2,
) -> RankProfile:
    """Measure this rank (see the module description).

    Each size is read once (the ladder's timed only), and a second time where :func:`worth_reading_again` says
    (could be picked and did not read the least time per sample; a measured size also where it reads slower per
    sample than a smaller one: a one-off cost such as a compilation on a new shape), and the smaller measured size
    where the larger missed the budget (the memory line's anchor below it); the least time and the larger peak kept.

    Args:
        strategy: the trainer's strategy, set up (optimizers built).
        batches: ``size -> batch on the device``.
        sizes: the two micro-batch sizes (``m1 <= m2``).
        meter: the peak-memory meter (CUDA allocator, or RSS above the fit's start).
        options: the optimizer options; the first is the run's own optimizers.
        blocks: the blocks to profile (empty: none).
        exclude: what is not an activation (the parameters' storages).
        policies: the activation policies to profile.
        budget_bytes: this rank's budget (carried in the profile).
        usable_bytes: the budget less the plan's margin (None: the budget): no plan may peak above it, so a smaller
            size reading above it moves both sizes down, and a larger one is not read again. Every line a plan near
            the budget is predicted from is then fitted where such plans run, the same for any budget above them (the
            line through larger sizes over-predicted small ones, so the least budget a refusal named was refused in turn).
            The sizes read above it before moving down are kept beside them (``peaks``, ``times``): the model
            predicts larger micro-batches (a plan recomputing its blocks there) from them, not from a line through
            the smaller sizes.
        fixed_policies: the block policies the user fixed (carried in the profile).
        min_offload_bytes: as for :class:`~lightning_efficient.ActivationMemory` (what offload leaves on the device).
        offload_dir: where the disk policy's bandwidth is measured.
        ladder: more micro-batch sizes to time (those below the smaller measured size).
        option_steps: optimizer steps timed per option (the least kept).
    """
    module = strategy.lightning_module
    device = strategy.root_device
    sync_off = _sync_off(strategy)
    # the states an optimizer held before the fit (one configure_optimizers keeps between fits), which measuring steps:
    # on CPU their copy's bytes are left out of the readings as the module's copy's are
    saved_states = [SavedOptimizerState(o) if len(o.state) else None for o in strategy.optimizers]
    held = _backup_bytes(module, device) + (sum(s.host_bytes for s in saved_states if s) if device.type != "cuda" else 0)

    def forward_backward(size: int) -> None:
        batch = batches(size)
        with sync_off():
            loss = step_loss(strategy, batch)
            loss.backward()
        del loss

    def timed(size: int, as_in_a_fit: bool = False, may_run_out: bool = True) -> tuple[int | None, float]:
        """``(peak, seconds)`` of a micro-step at ``size``; ``(None, inf)`` where it ran out of memory (only above the
        smallest size, ``may_run_out``, and not in lockstep, where the other ranks would be left in a collective)."""
        collect_young_garbage()  # no step before is counted in this one (see _as_a_window_leaves_gradients)
        meter.reset()
        if as_in_a_fit:
            _as_a_window_leaves_gradients(module, lambda: forward_backward(min(small, m1)))
        synchronize(device)
        start = time.perf_counter()
        ran_out = False
        try:
            forward_backward(size)
        except Exception as error:
            if not (may_run_out and size > smallest and not lockstep and is_out_of_memory(error)):
                raise
            ran_out = True  # leaving the handler drops the error and the frames holding the step's tensors
        synchronize(device)
        elapsed = time.perf_counter() - start
        peak = meter.read()
        module.zero_grad(set_to_none=False)  # the gradients stay held, as in a real accumulation
        if ran_out:
            free_what_running_out_left(device)
            return None, math.inf
        return peak, elapsed

    m1, m2 = sizes
    with restored_run_state(strategy), _not_counting(meter, held):
        try:
            # every rank must run the same steps where a forward or backward runs collectives (FSDP2's, a
            # SyncBatchNorm's under DDP): then nothing here may follow a rank's own readings
            lockstep = _in_lockstep(module)
            # warm-up (lazy initialisation, compilation) on one sample, which the window steps then use too (the least
            # that makes the gradients); two where the model cannot train on one (a BatchNorm's statistics: then no
            # plan may use one) or where the ranks run in step (one rank's failure would leave the others waiting)
            small, smallest = (2, 1) if lockstep else (1, 1)
            if small == 1:
                try:
                    forward_backward(1)
                except Exception:  # noqa: BLE001 - at one sample only: two are tried next, where a real fault raises
                    module.zero_grad(set_to_none=False)
                    small = smallest = 2
            if small > 1:
                forward_backward(min(small, m1))
            for optimizer in strategy.optimizers:
                if len(optimizer.state) == 0:
                    optimizer.step()
            module.zero_grad(set_to_none=False)
            run_state = sum(device_state_bytes(o, device) for o in strategy.optimizers)
            # each reading of a measured size (its peak is what the plan predicts) finds the gradients as a fit's
            # micro-step at that size does
            peak1, time1 = timed(m1, as_in_a_fit=True)
            # where the smaller size already misses the budget less the margin (usable_bytes), or runs out of memory:
            # the larger one is not run (on a device of that size it would not fit), both sizes move down
            usable = budget_bytes if usable_bytes is None else usable_bytes
            out_of_memory_at: int | None = None  # the least size that ran out of memory: no plan may use it or more
            above: list[tuple[int, int, float]] = []  # sizes read above usable that the sizes moved below: kept
            peak2, time2 = None, math.inf  # the larger size: not read yet
            while (peak1 is None or peak1 > usable) and m1 > smallest and not lockstep:
                if peak1 is None:
                    out_of_memory_at = m1
                if peak2 is not None:  # the larger size's reading (read as the smaller one before moving down)
                    above.append((m2, peak2, time2))
                m1, m2 = max(smallest, m1 // 2), m1
                peak2, time2 = peak1, time1
                peak1, time1 = timed(m1, as_in_a_fit=True)
            # the larger size, or the one size again (the micro-batch not searched): in a window of its own, not next
            # in the smaller's (where glibc's allocator keeps the smaller step's freed heap, the reading rose by tens
            # of MiB in a test process)
            if (m1, m2) == sizes:
                peak2, time2 = timed(m2, as_in_a_fit=True)
                if peak2 is None:
                    out_of_memory_at = m2
            if peak2 is None:  # the larger size ran out of memory: the line runs through two sizes that trained
                m2, peak2, time2 = m1, peak1, time1
                if m1 > smallest:
                    m1 = max(smallest, m1 // 2)
                    peak1, time1 = timed(m1, as_in_a_fit=True, may_run_out=False)
            # below the smaller size, once it has moved; one sample only where the warm-up ran on it (not where it
            # failed, nor in lockstep, where one rank failing on it would leave the others waiting)
            smaller = sorted({size for size in ladder if small <= size < m1})
            times = [(size, timed(size, may_run_out=False)[1]) for size in smaller]
            # second readings (see above); not of the larger size where it missed the budget (as above)
            once = dict(times)
            again = set()
            if m1 != m2:
                once[m1] = time1
                if peak2 <= usable or lockstep:
                    once[m2] = time2
                else:
                    again.add(m1)
            for size in sorted(again.union(worth_reading_again(once, lockstep=lockstep, first_shapes=(m1, m2)))):
                if size == m1 and m1 != m2:
                    again1, retime1 = timed(m1, as_in_a_fit=True, may_run_out=False)
                    peak1, time1 = max(peak1, again1), min(time1, retime1)
                elif size == m2 and m1 != m2:
                    again2, retime2 = timed(m2, as_in_a_fit=True, may_run_out=False)
                    peak2, time2 = max(peak2, again2), min(time2, retime2)
                else:
                    times.append((size, timed(size, may_run_out=False)[1]))
            profiles: list[BlockProfile] = []
            if blocks:
                profiles = _profile_blocks(strategy, batches, m1, blocks, exclude, _profiled_policies(policies, fixed_policies),
                                           min_offload_bytes, offload_dir)
            measured = [_measure_option(spec, meter, device, 0 if spec.own else run_state, option_steps) for spec in options]
        finally:
            for state in saved_states:
                if state is not None:
                    state.restore()
    release_free_memory(device)
    return RankProfile(
        sizes=(m1, m2), peak_bytes=(peak1, peak2), step_s=(time1, time2), run_state_bytes=run_state,
        blocks=profiles, blocks_size=m1, options=measured, budget_bytes=budget_bytes,
        tokens_per_sample=tokens_per_sample(batches(1)), fixed_policies=fixed_policies,
        times=[*times, *((size, seconds) for size, _, seconds in above)], smallest_micro_batch=smallest,
        out_of_memory_at=out_of_memory_at, peaks=[(size, peak) for size, peak, _ in above],
    )


#: how far above the least time per sample a size's first reading may be and still be read again
READ_AGAIN_WITHIN = 0.10


def worth_reading_again(once: dict[int, float], within: float = READ_AGAIN_WITHIN, *, lockstep: bool = False,
                        first_shapes: tuple[int, ...] = ()) -> list[int]:
    """The sizes read once (``size -> seconds``) to read a second time: those whose time per sample is within
    ``within`` of the least, but not the size that read the least (the largest of those where several did), and of
    ``first_shapes`` (the sizes whose reading was the first on new shapes after the warm-up) those slower per
    sample than a smaller size. Only a size that could be picked needs the second reading that the noise of one
    calls for, and each costs planning time; a first reading that noise slowed by more than ``within`` leaves its
    size out, as its second would have had to be that much faster. The least reading's own second one could only
    make it faster still, while the others' are what may overtake it: it was a training step's time of the demo's
    planning at its loose budget. A one-off cost (a compilation on a new shape, torch.compile's recompilation for
    dynamic shapes) is no noise. With ``lockstep`` (every rank must run the same steps, while each rank's readings
    differ) every size."""
    if lockstep or not once:
        return sorted(once)
    per_sample = {size: seconds / size for size, seconds in once.items()}
    best = min(per_sample.values())
    least = max(size for size, t in per_sample.items() if t == best)
    return sorted(size for size, t in per_sample.items() if (size != least and t <= (1 + within) * best) or (
        size in first_shapes and any(t > other for smaller, other in per_sample.items() if smaller < size)))


def free_what_running_out_left(device: torch.device) -> None:
    """After a measuring step that ran out of memory, its error dropped: the tensors its frames held (in reference
    cycles too) collected and the memory handed back, so that the next reading starts from what the run holds."""
    gc.collect()
    release_free_memory(device)


def _as_a_window_leaves_gradients(module: nn.Module, small_step: Callable[[], None]) -> None:
    """Leave the gradients as an accumulation window's first micro-step leaves them for the next: set to None
    (as Lightning's ``zero_grad`` does at the window's start) and made again by a backward (``small_step``: one
    sample, or two where the model cannot train on one, a BatchNorm's statistics, or the ranks run in step), in
    the middle of the heap. A micro-step accumulating into them peaks above one accumulating into
    gradients held from before: on CPU 2-4 MiB more RSS for a model of 1M parameters at every micro-batch size.
    It is the reading for a step without accumulation too: one into gradients set to None read 5 MiB under such a fit
    (the demo GPT of the benchmark at 16 samples, 195.8 against 201.4 MiB), this one 199.9.

    The small step's garbage is freed after it: with automatic collection paused while measuring (as AutoFit
    measures), the reference cycles a step leaves (a user's closure over its frame) would stay, and each reading
    would count those of every step before it, where a fit's automatic collections free them soon after each step."""
    module.zero_grad(set_to_none=True)
    small_step()
    collect_young_garbage()


def _in_lockstep(module: nn.Module) -> bool:
    """Whether every rank must run the same forward and backward steps: under FSDP2 (its all-gathers and
    reduce-scatters) and where a SyncBatchNorm gathers statistics in a distributed run."""
    if any(is_fsdp2(m) for m in module.modules()):
        return True
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    return distributed and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())


def _backup_bytes(module: nn.Module, device: torch.device) -> int:
    """Host bytes of :func:`~lightning_efficient._step.restored_run_state`'s copy of the module's state (one copy per
    ``state_dict`` entry and non-persistent buffer): resident while measuring on CPU, never during training (0 on CUDA,
    where it is in host memory)."""
    if device.type == "cuda":
        return 0
    return sum(local_tensor(t).numel() * t.element_size() for t in run_state_tensors(module).values())


class SavedOptimizerState:
    """An optimizer's state as it was, put back exactly after measuring steps the optimizer.

    For torch's own state handling (the class overrides neither ``state_dict`` nor ``load_state_dict``) each
    per-parameter state tensor is copied to host memory (on CUDA a copy on the device would read in every peak
    measured) and put back on its device with its dtype straight into ``optimizer.state``: not through
    ``load_state_dict``, which casts floating states to their parameter's dtype (ASGD's float32 ``eta`` of a bf16
    parameter would come back bf16). Tensor subclasses (FSDP2's DTensor states, quantized ones) and other values are
    deep-copied where they are; ``param_groups`` too (their parameters kept). Other optimizers (bitsandbytes',
    this project's offloaded and sharded ones): a deep copy of ``state_dict``, loaded back.

    Args:
        optimizer: the optimizer whose state to keep.

    Attributes:
        host_bytes: the bytes of the copy (on CPU resident while measuring).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.host_bytes = optimizer_state_bytes(optimizer)
        self.direct = _torch_state_handling(optimizer)
        if self.direct:
            self.state = {param: {key: torch.utils._pytree.tree_map(_to_host, value) for key, value in per_param.items()}
                          for param, per_param in optimizer.state.items()}
            self.groups = [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
                           for group in optimizer.param_groups]
        else:
            self.state_dict = copy.deepcopy(optimizer.state_dict())

    def restore(self) -> None:
        """Put the state back (the copy becomes the optimizer's: call once)."""
        if not self.direct:
            self.optimizer.load_state_dict(self.state_dict)
            return
        self.optimizer.state.clear()
        for param, per_param in self.state.items():
            self.optimizer.state[param] = {key: torch.utils._pytree.tree_map(_to_device, value) for key, value in per_param.items()}
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            params = group["params"]
            group.clear()
            group.update(saved, params=params)


@dataclass
class _OnHost:
    """A state tensor copied to host memory, and the device it goes back to."""

    tensor: torch.Tensor
    device: torch.device


def _to_host(value: Any) -> Any:
    if type(value) is torch.Tensor:
        return _OnHost(value.detach().to("cpu", copy=True), value.device)
    return copy.deepcopy(value)


def _to_device(value: Any) -> Any:
    return value.tensor.to(value.device) if isinstance(value, _OnHost) else value


def _torch_state_handling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps its state as torch's own optimizers do (``state`` and ``param_groups`` are all of
    it): its class overrides neither ``state_dict`` nor ``load_state_dict`` (bitsandbytes' do)."""
    kind = type(optimizer)
    return (kind.state_dict is torch.optim.Optimizer.state_dict
            and kind.load_state_dict is torch.optim.Optimizer.load_state_dict)


@contextlib.contextmanager
def _not_counting(meter: PeakMemory, held_bytes: int) -> Iterator[None]:
    """Readings of ``meter`` leave out ``held_bytes`` held only while measuring."""
    meter.start_rss_bytes += held_bytes
    try:
        yield
    finally:
        meter.start_rss_bytes -= held_bytes


def measure_peak(strategy: Any, batches: Callable[[int], Any], size: int, meter: PeakMemory) -> tuple[int, float]:
    """The peak and seconds of one forward and backward at ``size`` samples (every block as it is now), the run's
    state restored."""
    module = strategy.lightning_module
    sync_off = _sync_off(strategy)

    def small_step() -> None:
        with sync_off():
            step_loss(strategy, batches(min(2, size))).backward()

    with restored_run_state(strategy), _not_counting(meter, _backup_bytes(module, strategy.root_device)):
        stateless = [o for o in strategy.optimizers if len(o.state) == 0]
        if stateless:  # the run's states are held during a real step
            small_step()
            for optimizer in stateless:
                optimizer.step()
        module.zero_grad(set_to_none=False)
        batch = batches(size)
        collect_young_garbage()
        meter.reset()
        _as_a_window_leaves_gradients(module, small_step)
        synchronize(strategy.root_device)
        start = time.perf_counter()
        with sync_off():
            loss = step_loss(strategy, batch)
            loss.backward()
        del loss
        synchronize(strategy.root_device)
        seconds = time.perf_counter() - start
        peak = meter.read()
    release_free_memory(strategy.root_device)
    return peak, seconds


def _sync_off(strategy: Any) -> Callable[[], Any]:
    """The context the measured backwards run in: DDP's ``no_sync`` where the strategy has one (no collective
    runs), but nothing under FSDP2. A backward with FSDP2's gradient sync off leaves its gradients on FSDP2's
    unsharded parameters, which ``zero_grad`` does not reach, and the next backward that reduce-scatters (the
    fit's first step) would add them in; with the sync on they are reduce-scattered into the sharded
    gradients, which are zeroed. Every rank measures the same sizes in the same order, so the collectives
    stay in step."""
    if any(is_fsdp2(m) for m in strategy.lightning_module.modules()):
        return contextlib.nullcontext
    return getattr(strategy, "gradient_sync_off", contextlib.nullcontext)


def _profiled_policies(policies: tuple[str, ...], fixed_policies: list[str] | None) -> tuple[str, ...]:
    """Every allowed policy, or only keep and the ones the user fixed."""
    return policies if fixed_policies is None else tuple(dict.fromkeys(("keep", *fixed_policies)))


def measure_blocks(
    strategy: Any,
    batches: Callable[[int], Any],
    size: int,
    *,
    blocks: list[tuple[str, nn.Module]],
    exclude: Callable[[torch.Tensor], bool],
    policies: tuple[str, ...],
    fixed_policies: list[str] | None = None,
    min_offload_bytes: int = 2**16,
    offload_dir: str | None = None,
) -> list[BlockProfile]:
    """Profile the blocks at ``size`` samples, the run's state put back afterwards: for a :class:`RankProfile` measured
    without them (``measure_rank(blocks=[])``), when the search finds that the block policies matter after all.

    Args:
        strategy: the trainer's strategy, set up.
        batches: ``size -> batch on the device``.
        size: the profile's smaller measured size (as ``measure_rank`` profiles them: half the cost, and within the budget
            where the larger size may not be; held bytes and costs scale with the micro-batch).
        blocks: the blocks to profile.
        exclude: what is not an activation (the parameters' storages).
        policies: the activation policies allowed (every one is profiled, or keep and ``fixed_policies``).
        fixed_policies: the block policies the user fixed, if any.
        min_offload_bytes: as for :class:`~lightning_efficient.ActivationMemory`.
        offload_dir: where the disk policy's files go.
    """
    with restored_run_state(strategy):
        profiles = _profile_blocks(strategy, batches, size, blocks, exclude, _profiled_policies(policies, fixed_policies),
                                   min_offload_bytes, offload_dir)
    release_free_memory(strategy.root_device)
    return profiles


def _profile_blocks(strategy, batches, size, blocks, exclude, policies, min_offload_bytes, offload_dir) -> list[BlockProfile]:
    module = strategy.lightning_module
    sync_off = _sync_off(strategy)
    batch = batches(size)

    def run_step() -> None:
        with sync_off():
            loss = step_loss(strategy, batch)
            loss.backward()
        module.zero_grad(set_to_none=False)

    def run_forward() -> None:
        step_loss(strategy, batch)

    return profile_blocks(run_step, run_forward, blocks, exclude, module.device,
                          min_offload_bytes=min_offload_bytes, policies=policies, offload_dir=offload_dir)


def _measure_option(spec: OptimizerSpec, meter: PeakMemory, device: torch.device, others_bytes: int, steps: int) -> OptimizerOption:
    """Step the option's optimizers (once first where that creates their states) and time ``steps`` more: the least
    time, the largest peak; ``others_bytes`` (the run's own states, held meanwhile but not under this option) are
    not counted."""
    optimizers: list[torch.optim.Optimizer] = []
    fresh: list[torch.optim.Optimizer] = []
    try:
        optimizers = spec.build()
        fresh = [o for o in optimizers if len(o.state) == 0]
        for optimizer in fresh:
            optimizer.step()
        collect_young_garbage()
        meter.reset()
        elapsed = math.inf
        for _ in range(max(1, steps)):
            synchronize(device)
            start = time.perf_counter()
            for optimizer in optimizers:
                optimizer.step()
            synchronize(device)
            elapsed = min(elapsed, time.perf_counter() - start)
        peak = max(0, meter.read() - others_bytes)
        state = sum(device_state_bytes(o, device) for o in optimizers)
    finally:
        for optimizer in fresh:
            release_optimizer_state(optimizer)
        spec.cleanup()
    return OptimizerOption(spec.name, state, elapsed, peak)
