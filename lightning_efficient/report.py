"""``MemoryReport``: memory and speed of a fit, logged, printed as one table and given as a dict."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_efficient._validation import require_int
from lightning_efficient.memory import (
    SavedTensorCounter,
    first_tensor,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    peak_rss_bytes,
)

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


class MemoryReport(Callback):
    """Measures a fit: step time, tokens/s and memory, every ``every_n_steps`` steps.

    Figures: ``step_time_s`` and ``tokens_per_s``/``samples_per_s`` (means over the steps after
    the first), ``parameter_bytes``, ``gradient_bytes``, ``optimizer_state_bytes`` (exact tensor
    bytes of every optimizer's state), ``activation_bytes`` (saved for backward, counted with
    ``saved_tensors_hooks`` on the sampled steps; the largest), ``peak_rss_bytes`` (process VmHWM) and,
    on CUDA, ``cuda_max_allocated_bytes``. Any other callback with a ``memory_figures()`` method
    returning a dict adds its figures. They are logged through the Trainer's loggers under
    ``memory/``, printed as one table at the end of fit on rank zero, and returned by :meth:`report`.

    Tokens per step are the valid tokens of a :class:`~lightning_efficient.tokens.TokenLosses`
    output, else the elements of the batch's first tensor when it has two or more dimensions.

    Args:
        every_n_steps: how often (in training batches) the memory figures are sampled (>= 1).
        log: log the figures through the Trainer's loggers.
        print_table: print the summary table at the end of fit.
        json_path: also write the figures to this JSON file at the end of fit.

    Raises:
        ValueError: when ``every_n_steps`` < 1.
    """

    def __init__(
        self, every_n_steps: int = 50, log: bool = True, print_table: bool = True, json_path: str | None = None
    ) -> None:
        require_int("every_n_steps", every_n_steps, 1)
        self.every_n_steps = every_n_steps
        self.log = log
        self.print_table = print_table
        self.json_path = json_path
        self._reset()

    def _reset(self) -> None:
        self._figures: dict[str, Any] = {}
        self._step_times: list[float] = []
        self._tokens: list[int] = []
        self._samples: list[int] = []
        self._step_start = 0.0
        self._counter: SavedTensorCounter | None = None
        self._sampling = False

    def _sync(self, pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        self._figures["parameter_bytes"] = parameter_bytes(pl_module)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._sampling = batch_idx % self.every_n_steps == 0
        if self._sampling:
            self._counter = SavedTensorCounter(exclude=[*pl_module.parameters(), *pl_module.buffers()])
            self._counter.__enter__()
        self._sync(pl_module)
        self._step_start = time.perf_counter()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._sampling:
            self._raise("gradient_bytes", gradient_bytes(pl_module))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(pl_module)
        self._step_times.append(time.perf_counter() - self._step_start)
        self._count_tokens(outputs, batch)
        if not self._sampling:
            return
        self._close_counter()
        self._raise("optimizer_state_bytes", sum(optimizer_state_bytes(o) for o in trainer.optimizers))
        self._figures["peak_rss_bytes"] = peak_rss_bytes()
        if pl_module.device.type == "cuda":
            self._figures["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(pl_module.device)
        for callback in trainer.callbacks:
            if callback is not self and callable(getattr(callback, "memory_figures", None)):
                self._figures.update(callback.memory_figures())
        if self.log:
            numbers = {f"memory/{k}": float(v) for k, v in self.report().items() if isinstance(v, (int, float))}
            pl_module.log_dict(numbers, on_step=True, on_epoch=False, rank_zero_only=True)

    def _close_counter(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._raise("activation_bytes", self._counter.bytes)
            self._counter = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        with contextlib.suppress(Exception):
            self._close_counter()

    def _raise(self, name: str, value: int) -> None:
        self._figures[name] = max(value, self._figures.get(name, 0))

    def _count_tokens(self, outputs: Any, batch: Any) -> None:
        mask = outputs.get("mask") if isinstance(outputs, Mapping) else None
        first = first_tensor(batch)
        if isinstance(mask, torch.Tensor):
            self._tokens.append(int(mask.sum()))
        elif first is not None and first.dim() >= 2:
            self._tokens.append(first.numel())
        if first is not None and first.dim() >= 1:
            self._samples.append(first.shape[0])

    def report(self) -> dict[str, Any]:
        """The figures measured so far, as a dict of plain numbers."""
        figures = dict(self._figures)
        times = self._step_times[1:] or self._step_times
        figures["steps"] = len(self._step_times)
        if times:
            elapsed = sum(times)
            skip = len(self._step_times) - len(times)
            figures["step_time_s"] = elapsed / len(times)
            if self._tokens:
                figures["tokens_per_s"] = sum(self._tokens[skip:]) / elapsed
            if self._samples:
                figures["samples_per_s"] = sum(self._samples[skip:]) / elapsed
        return figures

    def table(self) -> str:
        """The figures as a two-column text table."""
        rows = [(name, _format(name, value)) for name, value in self.report().items()]
        width = max(len(name) for name, _ in rows)
        lines = ["MemoryReport", "-" * (width + 20)]
        lines += [f"{name:<{width}}  {value:>16}" for name, value in rows]
        return "\n".join(lines)

    def to_json(self, path: str | Path) -> None:
        """Write the figures to ``path`` as JSON."""
        Path(path).write_text(json.dumps(self.report(), indent=2, sort_keys=True))

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_counter()
        self._finish()

    @rank_zero_only
    def _finish(self) -> None:
        if self.print_table:
            print(self.table(), flush=True)
        if self.json_path:
            self.to_json(self.json_path)
