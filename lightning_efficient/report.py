"""``MemoryReport``: memory and speed of a fit, logged, printed as one table and given as a dict."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_efficient._samples import batch_samples, token_ids
from lightning_efficient._torch import synchronize
from lightning_efficient._validation import require, require_bool, require_int, require_path
from lightning_efficient.memory import (
    ParameterStorages,
    PeakMemory,
    SavedTensorCounter,
    fit_start_rss_bytes,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    peak_rss_bytes,
    seconds_outside_training,
)
from lightning_efficient.optim._bnb import bitsandbytes

#: memory figures that differ by rank: under several processes each rank's is reported as
#: ``rank{i}/<name>`` and ``<name>`` is the largest over the ranks
PER_RANK_FIGURES = ("peak_rss_bytes", "rss_above_start_bytes", "cuda_max_allocated_bytes", "activation_bytes")
#: training-state figures: this rank's bytes (under FSDP2 its local shards), and under several processes
#: also each rank's as ``rank{i}/<name>`` and their sum as ``all_ranks/<name>``
STATE_FIGURES = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")


def _paged_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    manager = getattr(optimizer, "page_mng", None)
    return {id(t) for t in manager.paged_tensors} if manager is not None else set()


def _state_bytes(optimizer: torch.optim.Optimizer, keep: Callable[[torch.Tensor, bool], bool]) -> int:
    paged = _paged_ids(optimizer)
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and keep(value, id(value) in paged):
                seen.setdefault(value.data_ptr(), value.numel() * value.element_size())
    return sum(seen.values())


def paged_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s paged states: the tensors of its state that bitsandbytes' page
    manager holds (CUDA managed memory, outside the caching allocator's counts); 0 for others."""
    return _state_bytes(optimizer, lambda tensor, paged: paged)


def host_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s states in host memory (host-offloaded states), paged buffers not included."""
    return _state_bytes(optimizer, lambda tensor, paged: tensor.device.type == "cpu" and not paged)


def _format(name: str, value: float | int | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return f"{value / 2**20:,.2f} MiB"
    if name.endswith("_time_s"):
        return f"{value * 1e3:,.1f} ms"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def _uses_bitsandbytes(callbacks: list[Callback]) -> bool:
    """Whether a callback of the fit may load bitsandbytes (an EightBitOptimizer, an AutoFit with 8-bit options)."""
    from lightning_efficient.autofit import AutoFit
    from lightning_efficient.optim import EightBitOptimizer

    return any(isinstance(c, EightBitOptimizer) or (isinstance(c, AutoFit) and c.may_use_8bit) for c in callbacks)


class MemoryReport(Callback):
    """Measures a fit: step time, tokens/s and memory, every ``every_n_steps`` steps.

    Figures: ``step_time_s`` and ``tokens_per_s``/``samples_per_s`` (means over the steps after
    the first; a step here is a training batch, so under gradient accumulation ``steps``, ``step_time_s``
    and ``samples_per_step``/``tokens_per_step`` are per micro-batch, not per optimizer step),
    ``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes`` (exact tensor bytes of every
    optimizer's state), ``activation_bytes`` (saved for backward, counted with
    ``saved_tensors_hooks`` on the sampled steps; the largest), ``peak_rss_bytes`` (process VmHWM),
    ``rss_above_start_bytes`` (that peak less the RSS when the fit was set up, freed heap handed back
    first: the fit's own memory on CPU, the figure an ``AutoFit`` budget is held to there) and,
    on CUDA, ``cuda_max_allocated_bytes``; with a paged bitsandbytes optimizer also
    ``paged_optimizer_bytes``, the bytes of its paged states (CUDA managed memory, which
    ``max_memory_allocated`` does not see); on CUDA ``optimizer_state_host_bytes``, the part of
    ``optimizer_state_bytes`` in host memory (``EightBitOptimizer(offload="cpu")``'s states
    between steps; the rest of it, paged bytes aside, is on the device). Any other callback with a
    ``memory_figures()`` method returning a dict adds its figures. They are logged through the Trainer's loggers under
    ``memory/``, printed as one table at the end of fit on rank zero, and returned by :meth:`report`.

    The peaks cover training steps only: ``peak_rss_bytes`` (on Linux, where the kernel's peak can be
    reset) and ``cuda_max_allocated_bytes`` are reset when the first training step of the fit begins,
    after everything that runs before it, in any callback order: ``ActivationMemory``'s auto plan
    (a profiling step at the first batch), ``hetero_ddp``'s micro-batch probe, checkpoint loading. They
    are read at each sampled step and again at the end of fit (the peak over every step since the
    first, validation included), as are the other callbacks' figures and the optimizer-state bytes (which a
    sampled first micro-batch of an accumulation window has not made yet); gradient bytes are read at the
    optimizer step of each sampled micro-batch's window.

    Tokens per step are the valid tokens of a :class:`~lightning_efficient.tokens.TokenLosses`
    output, else the elements of the batch's ``[samples, sequence]`` tensor of token ids
    (:func:`~lightning_efficient._samples.token_ids`: integers in two or more dimensions); a batch of float features
    or images has no tokens, and its figures are ``samples_per_s``/``samples_per_step``.

    Under several processes (DDP, ``hetero_ddp``) the figures are the run's, gathered from every
    rank on the sampled steps and at the end of fit: ``samples_per_s``/``tokens_per_s`` and
    ``samples_per_step``/``tokens_per_step`` count every rank's samples and tokens (the whole global
    batch) over the slowest rank's time, ``step_time_s`` is the slowest rank's, ``world_size`` is
    the number of ranks, and each rank's ``peak_rss_bytes``, ``cuda_max_allocated_bytes`` and
    ``activation_bytes`` appear as ``rank{i}/<name>`` with ``<name>`` the largest over the ranks.
    ``parameter_bytes``, ``gradient_bytes`` and ``optimizer_state_bytes`` are the bytes this rank
    holds — under FSDP2 (``ModelParallelStrategy`` with ``fully_shard``) its local shards of the
    DTensor parameters, gradients and optimizer states — and each rank's appears as
    ``rank{i}/<name>``, their sum over the ranks as ``all_ranks/<name>`` (under DDP, every rank's
    replica counted). The other figures are rank zero's.

    Args:
        every_n_steps: how often (in training batches) the memory figures are sampled (>= 1).
        log: log the figures through the Trainer's loggers.
        print_table: print the summary table at the end of fit.
        json_path: also write the figures to this JSON file at the end of fit; its directory is
            created at construction if missing.

    Raises:
        ValueError: when ``every_n_steps`` < 1, or ``json_path`` is a directory or its directory
            cannot be created.
    """

    def __init__(
        self, every_n_steps: int = 50, log: bool = True, print_table: bool = True, json_path: str | None = None
    ) -> None:
        require_int("every_n_steps", every_n_steps, 1)
        require_bool("log", log)
        require_bool("print_table", print_table)
        require_path("json_path", json_path)
        if json_path is not None:
            target = Path(json_path).expanduser()
            require(not target.is_dir(), "json_path", json_path, "a file path, not a directory")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                require(False, "json_path", json_path, f"a path whose directory can be created ({error})")
        self.every_n_steps = every_n_steps
        self.log = log
        self.print_table = print_table
        self.json_path = json_path
        self._start_rss = 0  # the RSS when the fit was set up (read in setup; not cleared with the figures)
        self._reset()

    def _reset(self) -> None:
        self._figures: dict[str, Any] = {}
        self._step_times: list[float] = []
        self._tokens: list[int] = []
        self._samples: list[int] = []
        self._step_start = 0.0
        self._outside_at_start = 0.0
        self._counter: SavedTensorCounter | None = None
        self._weights: ParameterStorages | None = None
        self._sampling = False
        self._gradients_due = False
        self._run: dict[str, Any] = {}
        self._first_step_pending = False
        self._rss_peak: PeakMemory | None = None  # the training window's peaks (from the first step)
        self._cuda_peak: PeakMemory | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            if _uses_bitsandbytes(trainer.callbacks):
                bitsandbytes()  # its import (native libraries, tens of MiB) is not the fit's memory; AutoFit loads it first too
            self._start_rss = fit_start_rss_bytes()  # what earlier work freed or left as garbage is not the fit's (as AutoFit's)

    def _sync(self, pl_module: LightningModule) -> None:
        synchronize(pl_module.device)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap_training_step(trainer)
        self._reset()
        self._figures["parameter_bytes"] = parameter_bytes(pl_module)
        self._first_step_pending = True

    def _reset_peaks(self, pl_module: LightningModule) -> None:
        """Start the peaks and the step counters afresh: what ran before the first step is not training."""
        # meters, not the process's one peak: another callback resetting it mid-fit (AutoFit measuring again) shortens
        # no window of this report's
        self._rss_peak = PeakMemory(torch.device("cpu"))
        self._rss_peak.reset(release=False)
        self._cuda_peak = PeakMemory(pl_module.device) if pl_module.device.type == "cuda" else None
        if self._cuda_peak is not None:
            self._cuda_peak.reset(release=False)
        self._step_times.clear()
        self._tokens.clear()
        self._samples.clear()

    def _wrap_training_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Reset the peaks when the strategy's ``training_step`` first runs: callbacks after this one may
        still do work in ``on_train_batch_start`` of the first batch (``ActivationMemory``'s auto plan
        profiles a step there). The profile and the micro-batch probe call the module's step directly,
        never the strategy's."""
        strategy = trainer.strategy
        original = strategy.training_step
        pending = [True]  # one shot: another plugin may have wrapped this wrapper, which then stays in the chain

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if pending:
                pending.clear()
                self._unwrap_training_step(trainer)  # only while it is still the outermost
                self._reset_peaks(pl_module)
            return original(*args, **kwargs)

        training_step._memory_report_original = original  # type: ignore[attr-defined]
        training_step._memory_report_had_own = "training_step" in vars(strategy)  # type: ignore[attr-defined]
        strategy.training_step = training_step

    @staticmethod
    def _unwrap_training_step(trainer: Trainer) -> None:
        strategy = trainer.strategy
        wrapper = vars(strategy).get("training_step")
        if wrapper is None or not hasattr(wrapper, "_memory_report_original"):
            return
        if wrapper._memory_report_had_own:
            strategy.training_step = wrapper._memory_report_original
        else:
            del strategy.training_step

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._first_step_pending:
            self._first_step_pending = False
            self._reset_peaks(pl_module)  # also here: on its own if no strategy step runs this batch
            self._wrap_training_step(trainer, pl_module)
        self._sampling = batch_idx % self.every_n_steps == 0
        # a sampled micro-batch's gradients are read at its window's optimizer step (the first micro-batch of a window has
        # made none yet; at the fit's end Lightning has released them before its last validation: a new user's trial)
        self._gradients_due = self._gradients_due or self._sampling
        if self._sampling:
            # weights are not activations (under FSDP2: not the all-gathered parameters either)
            self._weights = ParameterStorages(pl_module).track()
            self._counter = SavedTensorCounter(exclude=self._weights)
            self._counter.__enter__()
        self._sync(pl_module)
        self._step_start = time.perf_counter()
        self._outside_at_start = seconds_outside_training()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._sampling or self._gradients_due:  # (each optimizer's step of a sampled batch: manual optimization's too)
            self._gradients_due = False
            self._raise("gradient_bytes", gradient_bytes(pl_module))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        # (less what callbacks after this one did at the step's start that is not training: AutoFit measuring again)
        outside = seconds_outside_training() - self._outside_at_start
        self._step_times.append(time.perf_counter() - self._step_start - outside)
        self._count_tokens(outputs, batch)
        if not self._sampling:
            return
        self._close_counter()
        self._raise("optimizer_state_bytes", sum(optimizer_state_bytes(o) for o in trainer.optimizers))
        if any(getattr(o, "is_paged", False) for o in trainer.optimizers):
            self._raise("paged_optimizer_bytes", sum(paged_state_bytes(o) for o in trainer.optimizers))
        if pl_module.device.type == "cuda":
            self._raise("optimizer_state_host_bytes", sum(host_state_bytes(o) for o in trainer.optimizers))
        self._read_peaks(trainer, pl_module)
        self._gather(trainer, pl_module)
        if self.log:
            numbers = {f"memory/{k}": float(v) for k, v in self.report().items() if isinstance(v, (int, float))}
            pl_module.log_dict(numbers, on_step=True, on_epoch=False, rank_zero_only=True)

    def _read_peaks(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The peaks since training started (not only at sampled steps) and the other callbacks' figures."""
        self._figures["peak_rss_bytes"] = self._rss_peak.read() if self._rss_peak is not None else peak_rss_bytes()
        self._figures["rss_above_start_bytes"] = max(0, self._figures["peak_rss_bytes"] - self._start_rss)
        if pl_module.device.type == "cuda":
            self._figures["cuda_max_allocated_bytes"] = (self._cuda_peak.read() if self._cuda_peak is not None
                                                         else torch.cuda.max_memory_allocated(pl_module.device))
        for callback in trainer.callbacks:
            if callback is not self and callable(getattr(callback, "memory_figures", None)):
                self._figures.update(callback.memory_figures())

    def _close_counter(self) -> None:
        if self._weights is not None:
            self._weights.stop()
            self._weights = None
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._raise("activation_bytes", self._counter.bytes)
            self._counter = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap_training_step(trainer)
        with contextlib.suppress(Exception):
            self._close_counter()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap_training_step(trainer)  # a fit that ended before its first step

    def _raise(self, name: str, value: int) -> None:
        self._figures[name] = max(value, self._figures.get(name, 0))

    def _count_tokens(self, outputs: Any, batch: Any) -> None:
        mask = outputs.get("mask") if isinstance(outputs, Mapping) else None
        tokens = token_ids(batch)
        if isinstance(mask, torch.Tensor):
            self._tokens.append(int(mask.sum()))
        elif tokens is not None:
            self._tokens.append(tokens.numel())
        samples = batch_samples(batch)
        if samples is not None:
            self._samples.append(samples)

    def _local_totals(self) -> tuple[int, float, int, int]:
        """This rank's timed steps (all after the first), their seconds, samples and tokens."""
        times = self._step_times[1:] or self._step_times
        skip = len(self._step_times) - len(times)
        return len(times), sum(times), sum(self._samples[skip:]), sum(self._tokens[skip:])

    def _gather(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Collect every rank's totals and memory (a collective: called on every rank alike)."""
        if trainer.world_size <= 1:
            return
        steps, elapsed, samples, tokens = self._local_totals()
        local = [float(steps), elapsed, float(samples), float(tokens), float(bool(self._tokens))]
        local += [float(self._figures.get(name, -1)) for name in (*PER_RANK_FIGURES, *STATE_FIGURES)]
        if not (dist.is_available() and dist.is_initialized()):
            return
        mine = torch.tensor(local, dtype=torch.float64, device=pl_module.device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        rows = [row.cpu().tolist() for row in gathered]
        run: dict[str, Any] = {"world_size": len(rows)}
        run_steps = int(max(row[0] for row in rows))
        run_elapsed = max(row[1] for row in rows)
        if run_steps and run_elapsed > 0:
            run["step_time_s"] = run_elapsed / run_steps
            run["samples_per_s"] = sum(row[2] for row in rows) / run_elapsed
            run["samples_per_step"] = sum(row[2] for row in rows) / run_steps
            if all(row[4] for row in rows):
                run["tokens_per_s"] = sum(row[3] for row in rows) / run_elapsed
                run["tokens_per_step"] = sum(row[3] for row in rows) / run_steps
        for offset, name in enumerate(PER_RANK_FIGURES, start=5):
            values = [int(row[offset]) for row in rows]
            if all(v >= 0 for v in values):
                run[name] = max(values)
                run.update({f"rank{rank}/{name}": value for rank, value in enumerate(values)})
        for offset, name in enumerate(STATE_FIGURES, start=5 + len(PER_RANK_FIGURES)):
            values = [int(row[offset]) for row in rows]
            if all(v >= 0 for v in values):
                run.update({f"rank{rank}/{name}": value for rank, value in enumerate(values)})
                run[f"all_ranks/{name}"] = sum(values)
        self._run = run

    def report(self) -> dict[str, Any]:
        """The figures measured so far, as a dict of plain numbers.

        Under several processes the throughput and per-rank memory are the run's as gathered at the
        last sampled step or the end of fit (see the class description); before any gathering, and
        in a single process, they are this process's.
        """
        figures = dict(self._figures)
        steps, elapsed, samples, tokens = self._local_totals()
        figures["steps"] = len(self._step_times)
        if steps and elapsed > 0:
            figures["step_time_s"] = elapsed / steps
            if self._tokens:
                figures["tokens_per_s"] = tokens / elapsed
                figures["tokens_per_step"] = tokens / steps
            if self._samples:
                figures["samples_per_s"] = samples / elapsed
                figures["samples_per_step"] = samples / steps
        figures.update(self._run)
        return figures

    def table(self) -> str:
        """The figures as a two-column text table."""
        figures = self.report()
        rows = [(name, _format(name, value)) for name, value in figures.items()]
        width = max(len(name) for name, _ in rows)
        title = "MemoryReport"
        if figures.get("world_size", 1) > 1:
            title += (
                f" ({figures['world_size']} ranks: throughput of all ranks together; rank<i>/ memory is each"
                " rank's, all_ranks/ their sum; unprefixed peaks and activations the largest; the rest rank 0's)"
            )
        lines = [title, "-" * (width + 20)]
        lines += [f"{name:<{width}}  {value:>16}" for name, value in rows]
        return "\n".join(lines)

    def to_json(self, path: str | Path) -> None:
        """Write the figures to ``path`` as JSON."""
        Path(path).expanduser().write_text(json.dumps(self.report(), indent=2, sort_keys=True))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the states and gradients a sampled step can miss: its first micro-batch of an accumulation window comes before
        # any optimizer step (no states yet) and before the backward that makes the gradients. Read here, not at fit
        # end: Lightning's teardown (before on_fit_end) moves a CUDA run's states to the CPU one parameter at a time,
        # which copies a tensor the parameters share (bitsandbytes' quantization maps) once per parameter
        if self._step_times:
            self._raise("optimizer_state_bytes", sum(optimizer_state_bytes(o) for o in trainer.optimizers))
            if gradients := gradient_bytes(pl_module):
                self._raise("gradient_bytes", gradients)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_counter()
        if self._step_times:  # the final figures cover every step, and what other callbacks read after the last sample
            self._read_peaks(trainer, pl_module)
        self._gather(trainer, pl_module)
        self._finish()

    @rank_zero_only
    def _finish(self) -> None:
        if self.print_table:
            print(self.table(), flush=True)
        if self.json_path:
            self.to_json(self.json_path)
