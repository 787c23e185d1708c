"""Every CUDA path in one run: ``python benchmarks/gpu_check.py`` (sized for under 8 minutes on one H200).

Runtime on one H200 (2026-12-04): about 4 minutes (about 47 fits of a few steps each, the FSDP2 rows'
17 among them, two with AutoFit's planning, and four optimizer twins of a few steps): 158 s before
disk offload waited for the disk, and 193 s for all but AutoFit's after (its two disk fits run at the
disk's speed, about 1 s a step); AutoFit's rows took 23 s. Give a run 6 minutes. The table is written
to ``--out`` after each check, so a run cut short keeps its rows. ``--smoke``: 5-10 s on 2 CPU cores.

Prints ONE table (check, variant, metric, value, ratio to the check's baseline — for a comparison of
tensors, the largest per-tensor ``max|diff| / max|reference|`` —, result) and exits non-zero when
any check fails or a case raises. Goals (the issue's targets) are reported as
``goal met`` / ``goal not met`` and do not change the exit code; checks (``pass`` / ``FAIL``) do.
Without a CUDA device (and without ``--smoke``) it says so and exits 0. ``--smoke`` runs every
check at toy sizes on the CPU (under a minute; ``make test`` runs it): CUDA-only variants run their
CPU fallback (``offload`` keeps, paged/offloaded 8-bit states are plain 8-bit) and CUDA-only figures
and goals say ``skipped: needs CUDA``, but every numerical check runs. ``--only CHECK`` (repeatable)
runs some checks only; ``--out FILE`` also writes the table to FILE (the table is wider and longer
than a terminal's tail).

Every case is a real ``lightning.Trainer.fit`` of ``DemoGPT`` (on a GPU: 12 layers, d_model 768,
seq 1024, vocab 32,768, about 110 M parameters, batch 8, precision ``bf16-mixed``, its own foreach
AdamW and LambdaLR) beside the same fit without the plugin. Each case builds its model afresh and
frees it before the next (``del``, ``gc.collect``, ``torch.cuda.empty_cache``); the device and
pinned-host peaks are reset at the first timed step, after warm-up steps, so the ``auto`` plan's
profiling step and the micro-batch probe are not in them. Step times are means over the timed
steps, each step between two device synchronisations (checkpoint saving falls outside).

Checks (table ``check`` column):
  * ``baseline``: the plain fit: step time, tokens/s, device peak, saved-for-backward bytes.
  * ``activations``: ``ActivationMemory`` checkpoint, selective, offload (pinned host, side
    stream), disk, and auto with a budget of half the every-block-kept bytes: step time, device
    peak, pinned host peak (the host allocator's blocks in use, each rounded up to a power of two),
    the bytes saved outside any inner hooks, the allocator's reserved peak (``max_memory_reserved``:
    blocks cached for a side stream's pool show here, not in the allocated peak); for offload,
    HostOffload's own count of bytes copied per step, the bytes taken off the device (baseline peak
    minus offload peak) as a share of the bytes offload can move: the blocks' saved bytes (the
    baseline's saved bytes minus checkpoint's, which are those outside the blocks) less the blocks'
    autocast weight copies (``is_copy_of`` a parameter: HostOffload leaves them in place), the step
    time against keep and against checkpoint, and the share of the blocks' copy time (out and back
    at the measured device-to-host bandwidth) hidden behind compute.
  * ``grads`` (numerical): gradients of every policy (and of a fit with ``MemoryReport``) against
    keep over two steps (the second exercises the offload's stash and host buffers again): offload
    and disk bitwise at every step; checkpoint, selective and the report at the first step, bitwise
    or within the bf16 tolerance ``GRAD_TOLERANCE`` (largest per-tensor ``max|diff| / max|keep|``).
    ``keep_rerun`` is the control that shows the platform's own noise: when it is not bitwise, an
    exact check that differs says ``inconclusive`` (not ``FAIL``), with the reason.
  * ``tokens``: ``SelectiveTokenLoss(method="eslm", keep_ratio=0.5)`` on the fused path beside the
    fused path alone and the baseline.
  * ``linear_ce``: the loss path alone (16,384 tokens, hidden 2,048, vocabulary 32,000, bf16): full
    logits + cross-entropy against ``linear_cross_entropy`` (mean; per token with half kept):
    forward+backward time and device peak.
  * ``memory_report``: ``MemoryReport`` beside the baseline: step time; its CUDA peak (reset at the
    first training step, after any planning or probing: includes that first step, a warm-up step
    here) beside this script's steady-state peak; its activation bytes equal this script's count of
    the baseline (numerical).
  * ``optim``: torch fused AdamW, ``EightBitOptimizer()`` plain, ``paged=True`` and
    ``offload="cpu"``: step time, tokens/s, optimizer-state bytes on the device, in host memory and
    paged (managed memory, invisible to ``max_memory_allocated``), device peak.
  * ``optim_twins`` (numerical): the optimizer path alone: plain, paged and host-offloaded 8-bit
    AdamW twins of the model's parameters fed the same gradient sequence (seeded, identical for
    every twin): parameters after N steps equal plain 8-bit's bitwise (``8bit_rerun`` the control;
    on CPU paged is plain 8-bit, the offloaded twin runs its schedule with synchronous copies).
  * ``optim_exact`` (numerical): parameters after N whole fits' steps with paged or offloaded 8-bit
    states equal plain 8-bit's exactly; ``8bit_rerun`` is the control (same fit twice): when it is
    not bitwise (kernels that are not deterministic), the dependent exact checks (here and under
    ``resume``) say ``inconclusive``, with the reason, and do not fail.
  * ``resume`` (numerical): each 8-bit variant fit N steps with a checkpoint at N/2 (an epoch end),
    then resumed from it: the resumed parameters equal the uninterrupted ones exactly; after the
    resume the paged states are as paged, and the offloaded ones as far off the device, as in the
    uninterrupted run (CUDA).
  * ``hetero``: ``hetero_ddp`` with ``max_micro_batch="auto"`` on one device under an allocator
    limit of the model's footprint plus 24 GiB: the probed cap, the accumulation, the training peak
    against the limit (a figure: the allocator enforces the limit, so the peak is always within it),
    and a check that can fail: the allocator retried no allocation (``num_alloc_retries``: freeing
    its cache and trying again, the sign of running at the edge) during training after the probe,
    as the probe's 10% margin should ensure.
  * ``fsdp2``: FSDP2 on one device: Lightning's ``ModelParallelStrategy(data_parallel_size=1,
    tensor_parallel_size=1)``, ``DemoGPT`` with ``fully_shard`` per block and on the root in
    ``configure_model`` (its training step goes through ``forward``, so the root's hook gathers the
    embeddings and the tied head), each variant beside plain FSDP2 in the same run: plain FSDP2
    (against the one-device baseline), ``ActivationMemory`` checkpoint and offload,
    ``EightBitOptimizer``, ``hetero_fsdp`` with fixed shares, ``MemoryReport``: step time, tokens/s,
    device peak and steady bytes, pinned host peak, saved bytes, optimizer-state bytes. Numerical:
    gradients against plain FSDP2 (``plain_rerun`` the control) — checkpoint at the first step within
    ``GRAD_TOLERANCE``, offload and ``hetero_fsdp`` bitwise at both steps and in the parameters after
    them (one rank trains like plain FSDP2); plain FSDP2 against the one-device fit
    (``plain_vs_one_device``, within the tolerance; one rank's shard is the whole tensor); the 8-bit
    parameters after N steps under FSDP2 equal plain 8-bit's on one device exactly (bitsandbytes
    updates the local shard; ``inconclusive`` when ``plain_vs_one_device`` is not bitwise);
    ``MemoryReport``'s activation bytes equal this script's count of plain FSDP2 and its parameter
    bytes the model's. FSDP2 fits run with ``use_distributed_sampler=False`` (one rank: Lightning's
    sampler would only shuffle), so every fit sees the same batches.
  * ``autofit``: ``AutoFit`` on the demo GPT at a budget of 2 GiB and of half the baseline's device
    peak, over its whole space (micro-batch with accumulation keeping the global batch, each block's
    policy, 32-bit / 8-bit / paged / host-offloaded states): its pick, its predicted peak against the
    ``max_memory_allocated`` peak of the whole training (AutoFit's own reading after the warm-up steps,
    the probe's of the timed steps), tokens/s beside the default configuration's (the baseline), its
    planning seconds and their worth in training steps (ratios: the budget's to the baseline's peak, the
    predicted and measured peaks' to the budget, the predicted tokens/s' to the measured). Goals (``goal met`` / ``goal not met``): peak
    within the budget, predicted peak within +-10% of it, planning within 5 steps; an infeasible budget
    is a row quoting AutoFit's answer (the budget that would do). On the CPU the 2 GiB fit runs at toy
    sizes (memory figures and goals need CUDA) and the other budget, a fraction of a CUDA peak, is skipped.
  * ``cleanup``: the most device memory a case left allocated once freed.
  * ``goals``: the issue's goals, met or not: host offload takes >= 80% of the bytes it can move (the
    blocks' saved bytes less their autocast weight copies) off the device at <= 1.10x the plain step time; the 8-bit fit reaches >= 0.90x fused AdamW's
    tokens/s; offloaded 8-bit states leave <= 1% of plain 8-bit's state bytes on the device; every
    numerical check passes.

The numerical fits run with ``torch.use_deterministic_algorithms(True, warn_only=True)`` (and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` on CUDA, set for the whole run so every fit shares it);
the ops that warned they are not deterministic are listed under the table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import Tensor

from lightning_efficient._torch import synchronize

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"model": {"vocab_size": 32768, "n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 1024},
            "batch": 8, "warm": 2, "timed": 6, "exact_steps": 4, "probe_batch": 256, "probe_headroom": 24 * 2**30,
            "probe_steps": 2, "budget": 0.5, "min_offload_bytes": None,
            "linear_ce": (16384, 2048, 32000)},
    "smoke": {"model": {"vocab_size": 512, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32},
              "batch": 2, "warm": 2, "timed": 2, "exact_steps": 4, "probe_batch": 8, "probe_headroom": None,
              # the toy model saves half its bytes outside the blocks, and no tensor of 64 KiB (the default)
              "probe_steps": 2, "budget": 0.75, "min_offload_bytes": 0, "linear_ce": (256, 32, 512)},
}
PRECISION = "bf16-mixed"
#: gradients of a policy against keep: bitwise, or largest per-tensor max|diff| / max|keep| within this
#: (2**-7: a few bf16 rounding steps of the largest gradient; offload and disk should be bitwise)
GRAD_TOLERANCE = 2**-7
#: goals of the issue
OFFLOAD_SHARE_GOAL, OFFLOAD_TIME_GOAL, EIGHT_BIT_SPEED_GOAL, OFFLOADED_STATE_DEVICE_GOAL = 0.80, 1.10, 0.90, 0.01
NEEDS_CUDA = "skipped: needs CUDA"
RESULTS_THAT_FAIL = ("FAIL", "error")


@dataclass
class Row:
    """One line of the table."""

    check: str
    variant: str
    metric: str
    value: float | None
    ratio: float | None = None
    result: str = ""


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, or None when either is missing or the base is zero."""
    return None if value is None or not base else value / base


# -- data and modules ---------------------------------------------------------------------------
class TokenRows(torch.utils.data.Dataset):
    """Random token rows, the same for every index whatever the run (``input_ids`` and next-token ``labels``)."""

    def __init__(self, length: int, seq_len: int, vocab_size: int) -> None:
        self.length, self.seq_len, self.vocab_size = length, seq_len, vocab_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        generator = torch.Generator().manual_seed(1_000_003 + index)
        ids = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def fused_adamw_gpt() -> type:
    """``DemoGPT`` whose AdamW is torch's fused implementation on CUDA (the 8-bit step's reference)."""
    from lightning_efficient import DemoGPT

    class FusedAdamWGPT(DemoGPT):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            plain, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"].lr_lambdas[0]
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in plain.param_groups]
            fused = torch.optim.AdamW(groups, lr=plain.defaults["lr"], betas=plain.defaults["betas"],
                                      fused=self.device.type == "cuda")
            config["optimizer"] = fused
            config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(fused, schedule)
            return config

    return FusedAdamWGPT


# -- measuring ---------------------------------------------------------------------------------
def state_bytes_by_place(optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Optimizer-state bytes of distinct storages: ``device`` (ordinary CUDA tensors), ``paged``
    (bitsandbytes' managed memory) and ``host`` (CPU tensors; pinned or not)."""
    from lightning_efficient._torch import storage_key

    seen: dict[tuple[str, int], tuple[str, int]] = {}

    def visit(value: Any) -> None:
        if isinstance(value, Tensor):
            value = local(value)
            place = "paged" if getattr(value, "is_paged", False) else "device" if value.is_cuda else "host"
            seen.setdefault(storage_key(value), (place, value.untyped_storage().nbytes()))
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for optimizer in optimizers:
        visit(list(optimizer.state.values()))
    totals = {"device": 0, "paged": 0, "host": 0}
    for place, nbytes in seen.values():
        totals[place] += nbytes
    return totals


def local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer states), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def make_probe(device: torch.device, warm: int, count_saved: bool, keep_params: bool, grab_grads: bool):
    """A callback that measures a fit (built here so Lightning is imported only when needed).

    It counts the bytes saved for backward on the last warm-up step (outermost hooks only), resets
    the device and pinned-host peaks at the first timed step, times each timed step between two
    synchronisations, and at the end of training reads the peaks, the optimizer states' placement,
    the other callbacks' ``memory_figures()``, and, if asked, the parameters (or the first step's
    gradients), copied to the host.
    """
    from lightning.pytorch import Callback

    from lightning_efficient._torch import storage_key
    from lightning_efficient.activations.offload import is_copy_of
    from lightning_efficient.memory import ParameterStorages, SavedTensorCounter

    on_cuda = device.type == "cuda"

    class Counter(SavedTensorCounter):
        """The saved bytes, and apart the autocast weight copies among them (HostOffload leaves those).
        Parameters are told by :class:`ParameterStorages`, which also sees FSDP2's all-gathered ones."""

        def __init__(self, module: torch.nn.Module) -> None:
            self.storages = ParameterStorages(module).track()
            super().__init__(exclude=self.storages)
            self._is_param = self.storages
            self.weight_copies: dict[tuple[str, int], int] = {}

        def _pack(self, tensor: Tensor) -> Tensor:
            if tensor.layout == torch.strided and is_copy_of(tensor, self._is_param):
                self.weight_copies.setdefault(storage_key(tensor), tensor.untyped_storage().nbytes())
            return super()._pack(tensor)

    class Probe(Callback):
        def __init__(self) -> None:
            self.figures: dict[str, Any] = {}
            self.saved_bytes: int | None = None
            self.weight_copy_bytes: int | None = None
            self.params: dict[str, Tensor] | None = None
            self.grads: dict[str, Tensor] | None = None
            self._counter: Counter | None = None
            self._retries_at_start: int | None = None
            self._first_timed: int | None = None
            self._timing = False
            self._start = 0.0
            self.seconds = 0.0
            self.tokens = 0
            self.steps = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = trainer.global_step
            if count_saved and self.saved_bytes is None and self._counter is None and step == max(warm - 1, 0):
                self._counter = Counter(pl_module)
                self._counter.__enter__()
            if step < warm:
                return
            synchronize(device)
            if self._first_timed is None:
                self._first_timed = step
                if on_cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    with contextlib.suppress(AttributeError, RuntimeError):  # the pinned-host figures are extras
                        torch.cuda.reset_peak_host_memory_stats()
                    self.figures["steady_device_bytes"] = torch.cuda.memory_allocated(device)
            self._timing, self._start = True, time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self._counter is not None:
                self._counter.__exit__(None, None, None)
                self._counter.storages.stop()
                self.saved_bytes, self.weight_copy_bytes = self._counter.bytes, sum(self._counter.weight_copies.values())
                self._counter = None
            if self._timing:
                synchronize(device)
                self.seconds += time.perf_counter() - self._start
                self.tokens += int(batch["input_ids"].numel())
                self._timing = False

        def on_train_start(self, trainer, pl_module) -> None:
            if on_cuda:  # after the micro-batch probe (it runs when the loader is set up), before any step
                self._retries_at_start = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if grab_grads:  # every step's, named "step<i>/<parameter>"
                self.grads = self.grads or {}
                self.grads.update({f"step{trainer.global_step}/{n}": local(p.grad).detach().float().cpu()
                                   for n, p in pl_module.named_parameters() if p.grad is not None})

        def on_train_end(self, trainer, pl_module) -> None:
            synchronize(device)
            if self._first_timed is not None:
                self.steps = trainer.global_step - self._first_timed
            if on_cuda:
                self.figures["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
                self.figures["peak_reserved_device_bytes"] = torch.cuda.max_memory_reserved(device)
                if self._retries_at_start is not None:
                    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
                    self.figures["alloc_retries_in_training"] = retries - self._retries_at_start
                stats: dict[str, Any] = {}
                with contextlib.suppress(AttributeError, RuntimeError):
                    stats = torch.cuda.host_memory_stats()
                # pinned blocks in use at the peak (the allocator rounds each up to a power of two)
                self.figures["pinned_host_peak_bytes"] = stats.get("active_bytes.peak", stats.get("allocated_bytes.peak"))
            self.figures.update({f"optimizer_{k}_bytes": v for k, v in state_bytes_by_place(trainer.optimizers).items()})
            for callback in trainer.callbacks:
                if callback is not self and callable(getattr(callback, "memory_figures", None)):
                    self.figures.update(callback.memory_figures())
                # HostOffload's own count of the bytes it copied to the host (read defensively: the
                # callback's internals may change; the row then says "-")
                offloaded = getattr(getattr(callback, "_host", None), "bytes_offloaded", None)
                if isinstance(offloaded, int):
                    self.figures["host_offload_bytes_per_step"] = offloaded / max(1, trainer.global_step)
            caps = getattr(trainer.strategy, "micro_batch_caps", None)
            if caps:
                self.figures["micro_batch_cap"] = caps[0]
                self.figures["accumulation"] = trainer.accumulate_grad_batches
            if keep_params:
                self.params = {n: local(p).detach().cpu().clone() for n, p in pl_module.named_parameters()}

        def on_exception(self, trainer, pl_module, exception) -> None:
            if self._counter is not None:
                self._counter.__exit__(None, None, None)
                self._counter.storages.stop()
                self._counter = None

        @property
        def step_time_s(self) -> float | None:
            return self.seconds / self.steps if self.steps else None

        @property
        def tokens_per_s(self) -> float | None:
            return self.tokens / self.seconds if self.steps and self.seconds else None

    return Probe()


@dataclass
class Fit:
    """What one fit measured."""

    step_time_s: float | None = None
    tokens_per_s: float | None = None
    saved_bytes: int | None = None
    weight_copy_bytes: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Tensor] | None = None
    grads: dict[str, Tensor] | None = None
    checkpoint: Path | None = None
    wall_s: float = 0.0


def max_difference(reference: dict[str, Tensor], candidate: dict[str, Tensor]) -> tuple[float, float, bool]:
    """(largest absolute difference, largest per-tensor ``max|diff| / max|reference|``, bitwise equal)."""
    if reference.keys() != candidate.keys():
        return math.inf, math.inf, False
    worst_abs, worst_rel, bitwise = 0.0, 0.0, True
    for name, ref in reference.items():
        other = candidate[name]
        bitwise = bitwise and ref.dtype == other.dtype and torch.equal(ref, other)
        diff = float((ref.double() - other.double()).abs().max()) if ref.numel() else 0.0
        scale = float(ref.double().abs().max()) if ref.numel() else 0.0
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / scale if scale else (0.0 if diff == 0 else math.inf))
    return worst_abs, worst_rel, bitwise


class Bench:
    """Device, sizes, the fits run so far and the rows of the table."""

    def __init__(self, device: torch.device, sizes: dict[str, Any], perturb: set[str], workdir: Path) -> None:
        self.device, self.sizes, self.perturb, self.workdir = device, sizes, perturb, workdir
        self.on_cuda = device.type == "cuda"
        self.rows: list[Row] = []
        self.fits: dict[str, Fit | None] = {}
        self.leftover: list[tuple[str, int]] = []
        self.nondeterministic: set[str] = set()

    # -- running one fit -------------------------------------------------------------------
    def fit(self, name: str, *, module_class: type | None = None, module_kwargs: dict | None = None,
            callbacks: list | None = None, steps: int | None = None, steps_per_epoch: int | None = None,
            warm: int | None = None, batch: int | None = None, strategy: Any = "auto", count_saved: bool = True,
            keep_params: bool = False, grab_grads: bool = False, save_at_epoch_end: bool = False,
            resume_from: Path | None = None, trainer_kwargs: dict | None = None) -> Fit:
        """One ``Trainer.fit`` of a fresh model; everything it made is freed before this returns."""
        import lightning
        from lightning.pytorch.callbacks import ModelCheckpoint

        from lightning_efficient import DemoGPT

        sizes = self.sizes
        warm = sizes["warm"] if warm is None else warm
        steps = warm + sizes["timed"] if steps is None else steps
        batch = sizes["batch"] if batch is None else batch
        rows = (steps_per_epoch or steps) * batch
        model_sizes = sizes["model"]
        torch.manual_seed(0)
        module = (module_class or DemoGPT)(**model_sizes, **(module_kwargs or {}))
        probe = make_probe(self.device, warm, count_saved, keep_params, grab_grads)
        extra = list(callbacks or [])
        checkpoints = self.workdir / name
        if save_at_epoch_end:
            # saved after the epoch's last batch (on_train_batch_end), not in on_train_epoch_end: Lightning resumes a
            # checkpoint taken there by running the unfinished epoch 0 again from a fresh iterator (its first batch as
            # "batch 2"), so the resumed run trained other batches than the uninterrupted one (the first H200 run)
            extra.append(ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1,
                                         every_n_train_steps=steps_per_epoch or steps))
        trainer = lightning.Trainer(
            accelerator=self.device.type, devices=1, strategy=strategy, precision=PRECISION, max_steps=steps,
            max_epochs=-1, logger=False, enable_checkpointing=save_at_epoch_end, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=self.workdir,
            callbacks=[*extra, probe], **(trainer_kwargs or {}),
        )
        loader = torch.utils.data.DataLoader(TokenRows(rows, model_sizes["seq_len"], model_sizes["vocab_size"]),
                                             batch_size=batch)
        start = time.perf_counter()
        trainer.fit(module, loader, ckpt_path=str(resume_from) if resume_from else None)
        result = Fit(probe.step_time_s, probe.tokens_per_s, probe.saved_bytes, probe.weight_copy_bytes, dict(probe.figures),
                     probe.params,
                     probe.grads, checkpoints / "epoch=0.ckpt" if save_at_epoch_end else None,
                     time.perf_counter() - start)
        del trainer, module, probe, extra, loader, callbacks
        self.free(name)
        return result

    def free(self, name: str) -> None:
        """Collect garbage, empty the CUDA cache and note what the case left on the device."""
        gc.collect()
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.leftover.append((name, torch.cuda.memory_allocated(self.device)))

    @contextlib.contextmanager
    def deterministic(self) -> Iterator[None]:
        """Deterministic algorithms (warn only) for the numerical fits; the warned ops are noted.

        On CUDA attention runs on SDPA's math backend: with ``warn_only`` the fused backends (cuDNN's, chosen
        on an H200, flash and memory-efficient) only warn and keep their non-deterministic backward, which
        made the first H200 run's controls (the same fit twice) differ by 1% of the largest gradient."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        before, before_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings(record=True) as caught, (
                    sdpa_kernel(SDPBackend.MATH) if self.on_cuda else contextlib.nullcontext()):
                warnings.simplefilter("always")
                yield
            for warning in caught:
                text = str(warning.message)
                if "deterministic" in text:
                    self.nondeterministic.add(text.split(".")[0][:160])
        finally:
            torch.use_deterministic_algorithms(before, warn_only=before_warn)

    # -- rows ------------------------------------------------------------------------------
    def add(self, check: str, variant: str, metric: str, value: float | None, ratio: float | None = None,
            result: str = "") -> None:
        """Add one row to the table."""
        self.rows.append(Row(check, variant, metric, value, ratio, result))

    def cuda_only(self, check: str, variant: str, metric: str, value: float | None, base: float | None = None) -> None:
        """A figure only CUDA has: the value, or a row saying it was skipped."""
        if self.on_cuda:
            self.add(check, variant, metric, value, ratio(value, base))
        else:
            self.add(check, variant, metric, None, None, NEEDS_CUDA)

    def timing_rows(self, check: str, variant: str, fit: Fit, base: Fit | None, note: str = "") -> None:
        """Step time, tokens/s and the device peak of ``fit``, with ratios to ``base``."""
        self.add(check, variant, "step_time_s", fit.step_time_s, ratio(fit.step_time_s, base and base.step_time_s), note)
        self.add(check, variant, "tokens_per_s", fit.tokens_per_s, ratio(fit.tokens_per_s, base and base.tokens_per_s))
        self.cuda_only(check, variant, "peak_device_bytes", fit.figures.get("peak_device_bytes"),
                       base and base.figures.get("peak_device_bytes"))

    def compare(self, check: str, variant: str, reference: dict[str, Tensor] | None, candidate: dict[str, Tensor] | None,
                exact: bool, what: str, control: str | None = None) -> None:
        """A numerical check: ``candidate`` against ``reference`` (exactly, or within ``GRAD_TOLERANCE``).

        ``control`` (``"check/variant"``, compared before) is the same run twice: when it was not
        bitwise, the platform itself is not, and an exact check that differs is ``inconclusive``
        (it does not fail), with the reason."""
        if reference is None or candidate is None:
            self.add(check, variant, what, None, None, "error: nothing to compare (see the error rows)")
            return
        if check in self.perturb and not variant.endswith("_rerun"):  # hidden --perturb: a failed comparison fails the run (controls stay)
            candidate = dict(candidate)
            name = next(iter(candidate))
            candidate[name] = candidate[name] + candidate[name].abs().max() * 0.5 + 1e-3
        worst_abs, worst_rel, bitwise = max_difference(reference, candidate)
        if bitwise:
            result = "pass (bitwise)"
        elif exact:
            result = "FAIL (not exact)"
            if control is not None:
                control_check, control_variant = control.split("/", 1)
                found = [r for r in self.rows if (r.check, r.variant) == (control_check, control_variant)
                         and r.metric.endswith("_max_abs_diff")]
                if not found or found[-1].result != "pass (bitwise)":
                    why = found[-1].result if found else "it did not run"
                    result = f"inconclusive (control {control} not bitwise: {why})"
        else:
            result = f"pass (<= {GRAD_TOLERANCE:.4g})" if worst_rel <= GRAD_TOLERANCE else f"FAIL (> {GRAD_TOLERANCE:.4g})"
        self.add(check, variant, f"{what}_max_abs_diff", worst_abs, worst_rel, result)

    def run_case(self, check: str, variant: str, case: Callable[[], Fit | None]) -> Fit | None:
        """Run one case, keeping its fit under ``check/variant``; an exception becomes an error row."""
        key = f"{check}/{variant}"
        print(f"gpu_check: {key} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            fit = case()
        except Exception as error:  # noqa: BLE001 - one failing case must not hide the others' figures
            text = f"error: {type(error).__name__}: {error}".splitlines()[0][:150]
            del error
            self.add(check, variant, "case", None, None, text)
            fit = None
            if self.on_cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.free(key)
        print(f"gpu_check: {key} done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        self.fits[key] = fit
        return fit

    def get(self, key: str) -> Fit | None:
        """The fit of case ``check/variant`` (None if it did not run or raised)."""
        return self.fits.get(key)


# -- the checks ----------------------------------------------------------------------------------
def moving(b: Bench, policy: str) -> dict[str, Any]:
    """ActivationMemory arguments for ``policy`` (offload, disk: the size threshold and a directory)."""
    kwargs: dict[str, Any] = {"policy": policy}
    if b.sizes["min_offload_bytes"] is not None:
        kwargs["min_offload_bytes"] = b.sizes["min_offload_bytes"]
    if policy == "disk":
        kwargs["offload_dir"] = str(b.workdir / "disk")
    return kwargs


def check_baseline(b: Bench) -> None:
    """The plain fit every other check compares with."""
    if "baseline/plain" in b.fits:
        return  # measured (or failed) once, for every check that compares with it
    fit = b.run_case("baseline", "plain", lambda: b.fit("baseline"))
    if fit is None:
        return
    b.timing_rows("baseline", "plain", fit, fit)
    b.add("baseline", "plain", "saved_for_backward_bytes", fit.saved_bytes, 1.0)
    b.cuda_only("baseline", "plain", "steady_device_bytes", fit.figures.get("steady_device_bytes"))


def check_activations(b: Bench) -> None:
    """ActivationMemory's policies beside the plain fit; host offload's share off the device and its overlap."""
    from lightning_efficient import ActivationMemory

    check_baseline(b)
    base = b.get("baseline/plain")
    variants = {
        "checkpoint": {"policy": "checkpoint"},
        "selective": {"policy": "selective"},
        "offload": moving(b, "offload"),
        "disk": moving(b, "disk"),
        f"auto_budget_{b.sizes['budget']}": {"policy": "auto", "budget": b.sizes["budget"]},
    }
    for variant, kwargs in variants.items():
        fit = b.run_case("activations", variant,
                         lambda kwargs=kwargs, variant=variant: b.fit(f"activations_{variant}", callbacks=[ActivationMemory(**kwargs)]))
        if fit is None:
            continue
        note = "cpu fallback: keep" if variant == "offload" and not b.on_cuda else ""
        b.timing_rows("activations", variant, fit, base, note)
        b.cuda_only("activations", variant, "pinned_host_peak_bytes", fit.figures.get("pinned_host_peak_bytes"))
        b.cuda_only("activations", variant, "peak_reserved_device_bytes", fit.figures.get("peak_reserved_device_bytes"),
                    base and base.figures.get("peak_reserved_device_bytes"))
        b.add("activations", variant, "saved_outside_inner_hooks_bytes", fit.saved_bytes,
              ratio(fit.saved_bytes, base and base.saved_bytes))
        if variant.startswith("auto"):
            planned, kept = fit.figures.get("activation_planned_bytes"), fit.figures.get("activation_all_kept_bytes")
            b.add("activations", variant, "auto_planned_bytes", planned, ratio(planned, kept))
            b.add("activations", variant, "auto_every_block_kept_bytes", kept, 1.0 if kept else None)
        if variant == "offload":
            b.cuda_only("activations", variant, "host_offload_bytes_per_step", fit.figures.get("host_offload_bytes_per_step"))
        if variant == "disk":
            steps = max(1, b.sizes["warm"] + b.sizes["timed"])
            for what in ("offloaded", "written"):  # taken out of memory; written (less what backward used first)
                moved = fit.figures.get(f"activation_disk_{what}_bytes")
                b.add("activations", variant, f"disk_{what}_bytes_per_step", None if moved is None else moved / steps)

    offload, checkpoint = b.get("activations/offload"), b.get("activations/checkpoint")
    if base is None or offload is None or checkpoint is None:
        return
    # what the blocks save: everything the plain fit saves minus what is saved outside the blocks
    # (under checkpoint the outer count sees only that: checkpointing packs the blocks' own tensors)
    blocks = None if base.saved_bytes is None or checkpoint.saved_bytes is None else base.saved_bytes - checkpoint.saved_bytes
    b.add("activations", "offload", "blocks_saved_bytes", blocks, ratio(blocks, base.saved_bytes))
    # of which autocast's low-precision weight copies (HostOffload leaves them in place, by design):
    # what offload can move is the rest
    copies = (None if base.weight_copy_bytes is None or checkpoint.weight_copy_bytes is None
              else base.weight_copy_bytes - checkpoint.weight_copy_bytes)
    movable = None if blocks is None or copies is None else blocks - copies
    b.add("activations", "offload", "blocks_weight_copy_bytes", copies, ratio(copies, blocks))
    b.add("activations", "offload", "blocks_movable_bytes", movable, ratio(movable, blocks))
    b.add("activations", "offload", "step_time_vs_checkpoint", ratio(offload.step_time_s, checkpoint.step_time_s))
    if not b.on_cuda:
        for metric in ("bytes_off_device", "share_of_movable_off_device", "blocks_copy_time_s", "added_step_s",
                       "copy_time_hidden_share"):
            b.add("activations", "offload", metric, None, None, NEEDS_CUDA)
        return
    # taken off the device: the plain fit's peak minus offload's (both after warm-up, same steps)
    off = base.figures["peak_device_bytes"] - offload.figures["peak_device_bytes"]
    b.add("activations", "offload", "bytes_off_device", off)
    b.add("activations", "offload", "share_of_movable_off_device", ratio(off, movable))
    from lightning_efficient.activations.profile import host_bandwidth

    # the copy time of the blocks' saved bytes, out in forward and back in backward, at the measured
    # device-to-host bandwidth, against the step time offload adds to keep
    copy_s = 2 * (movable or 0) / host_bandwidth(b.device)
    exposed = (offload.step_time_s or 0.0) - (base.step_time_s or 0.0)
    hidden = None if not copy_s else min(1.0, max(0.0, 1.0 - exposed / copy_s))
    b.add("activations", "offload", "blocks_copy_time_s", copy_s)
    b.add("activations", "offload", "added_step_s", exposed)
    b.add("activations", "offload", "copy_time_hidden_share", hidden)


def check_grads(b: Bench) -> None:
    """Two steps' gradients of every policy (and of a fit with MemoryReport) against keep: offload and
    disk bitwise at both steps (a second step reuses the stash and the host buffers), the others at
    the first step, within the bf16 tolerance."""
    from lightning_efficient import ActivationMemory, MemoryReport

    two_steps = {"steps": 2, "warm": 1, "count_saved": False, "grab_grads": True}
    exact = {"keep_rerun", "offload", "disk"}
    variants: dict[str, Callable[[], list]] = {
        "keep": lambda: [],
        "keep_rerun": lambda: [],
        "checkpoint": lambda: [ActivationMemory(policy="checkpoint")],
        "selective": lambda: [ActivationMemory(policy="selective")],
        "offload": lambda: [ActivationMemory(**moving(b, "offload"))],
        "disk": lambda: [ActivationMemory(**moving(b, "disk"))],
        "memory_report": lambda: [MemoryReport(print_table=False, log=False)],
    }
    with b.deterministic():
        for variant, callbacks in variants.items():
            b.run_case("grads", variant, lambda variant=variant, callbacks=callbacks:
                       b.fit(f"grads_{variant}", callbacks=callbacks(), **two_steps))
    reference = b.get("grads/keep")

    def first_step(grads: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        return None if grads is None else {k: v for k, v in grads.items() if k.startswith("step0/")}

    for variant in variants:
        if variant == "keep":
            continue
        fit = b.get(f"grads/{variant}")
        if variant in exact:
            b.compare("grads", variant, reference and reference.grads, fit and fit.grads, exact=True, what="grad",
                      control=None if variant == "keep_rerun" else "grads/keep_rerun")
        else:
            b.compare("grads", variant, first_step(reference and reference.grads), first_step(fit and fit.grads),
                      exact=False, what="grad")
        if variant == "offload" and not b.on_cuda:
            b.rows[-1].result += "; cpu fallback: keep"
    for variant in variants:
        if b.fits.get(f"grads/{variant}") is not None:
            b.fits[f"grads/{variant}"].grads = None  # free the host copies


def check_tokens(b: Bench) -> None:
    """SelectiveTokenLoss on the fused path beside the fused path alone and the plain baseline."""
    from lightning_efficient import SelectiveTokenLoss

    check_baseline(b)
    base = b.get("baseline/plain")
    fused = b.run_case("tokens", "fused_loss", lambda: b.fit("tokens_fused", module_kwargs={"fused_loss": True}))
    selected = b.run_case("tokens", "fused_eslm_keep_0.5", lambda: b.fit(
        "tokens_eslm", module_kwargs={"fused_loss": True}, callbacks=[SelectiveTokenLoss(method="eslm", keep_ratio=0.5)]))
    for variant, fit in (("fused_loss", fused), ("fused_eslm_keep_0.5", selected)):
        if fit is not None:
            b.timing_rows("tokens", variant, fit, base)
    if fused is not None and selected is not None:
        b.add("tokens", "fused_eslm_keep_0.5", "step_time_vs_fused_loss", ratio(selected.step_time_s, fused.step_time_s))
        b.cuda_only("tokens", "fused_eslm_keep_0.5", "peak_vs_fused_loss",
                    ratio(selected.figures.get("peak_device_bytes"), fused.figures.get("peak_device_bytes")))


def check_linear_ce(b: Bench) -> None:
    """The loss path alone (tokens x hidden x vocabulary): full logits + cross-entropy against the chunked
    ``linear_cross_entropy``, mean and per token with half the tokens kept: forward+backward time and peak."""
    measured = _measure_linear_ce(b)
    b.free("linear_ce")  # the inputs are gone with the function's frame
    base_time, base_peak = measured.get("full_logits", (None, None))
    for variant, (seconds, peak) in measured.items():
        b.add("linear_ce", variant, "fwd_bwd_time_s", seconds, ratio(seconds, base_time))
        b.cuda_only("linear_ce", variant, "peak_device_bytes", peak, base_peak)


def _measure_linear_ce(b: Bench) -> dict[str, tuple[float | None, int | None]]:
    import torch.nn.functional as F

    from lightning_efficient import linear_cross_entropy

    n, d, v = b.sizes["linear_ce"]
    dtype = torch.bfloat16 if b.on_cuda else torch.float32
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=generator).to(b.device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=generator) * 0.02).to(b.device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=generator).to(b.device)
    variants = {
        "full_logits": lambda: F.cross_entropy((hidden @ weight.t()).float(), labels),
        "chunked_mean": lambda: linear_cross_entropy(hidden, weight, labels, reduction="mean"),
        "chunked_per_token_keep_0.5": lambda: linear_cross_entropy(hidden, weight, labels)[::2].mean(),
    }
    measured: dict[str, tuple[float | None, int | None]] = {}
    for variant, loss in variants.items():
        def step(loss=loss) -> None:
            loss().backward()
            hidden.grad = weight.grad = None

        def case(step=step) -> Fit:
            step()  # warm-up
            synchronize(b.device)
            if b.on_cuda:
                torch.cuda.reset_peak_memory_stats(b.device)
            start = time.perf_counter()
            for _ in range(b.sizes["timed"]):
                step()
            synchronize(b.device)
            figures = {"peak_device_bytes": torch.cuda.max_memory_allocated(b.device)} if b.on_cuda else {}
            return Fit(step_time_s=(time.perf_counter() - start) / b.sizes["timed"], figures=figures)

        fit = b.run_case("linear_ce", variant, case)
        if fit is not None:
            measured[variant] = (fit.step_time_s, fit.figures.get("peak_device_bytes"))
    return measured


def check_memory_report(b: Bench) -> None:
    """MemoryReport beside the plain fit: its cost, its peak beside ours, its activation bytes against our count."""
    from lightning.pytorch import Callback

    from lightning_efficient import MemoryReport

    check_baseline(b)
    base = b.get("baseline/plain")
    report = MemoryReport(print_table=False, log=False)
    figures: dict[str, Any] = {}

    class KeepReport(Callback):  # read the report before the probe's end-of-fit bookkeeping frees anything
        def on_fit_end(self, trainer, pl_module) -> None:
            figures.update(report.report())

    fit = b.run_case("memory_report", "with_report",
                     lambda: b.fit("memory_report", callbacks=[report, KeepReport()], count_saved=False))
    if fit is None:
        return
    b.timing_rows("memory_report", "with_report", fit, base)
    b.cuda_only("memory_report", "with_report", "report_cuda_max_allocated_bytes",
                figures.get("cuda_max_allocated_bytes"), fit.figures.get("peak_device_bytes"))
    counted = figures.get("activation_bytes")
    reference = base and base.saved_bytes
    exact = counted is not None and reference is not None and counted == reference
    if "memory_report" in b.perturb and counted is not None:
        exact = False
    b.add("memory_report", "with_report", "report_activation_bytes", counted, ratio(counted, reference),
          "pass (equals the baseline's count)" if exact else "FAIL (differs from the baseline's count)")


def check_optim(b: Bench) -> None:
    """Fused AdamW, and EightBitOptimizer plain, paged and host-offloaded: speed and where the states are."""
    from lightning_efficient import EightBitOptimizer

    fused = b.run_case("optim", "torch_fused_adamw", lambda: b.fit("optim_fused", module_class=fused_adamw_gpt()))
    variants = {"8bit": {}, "8bit_paged": {"paged": True}, "8bit_offload": {"offload": "cpu"}}
    for variant, kwargs in variants.items():
        b.run_case("optim", variant, lambda kwargs=kwargs, variant=variant:
                   b.fit(f"optim_{variant}", callbacks=[EightBitOptimizer(**kwargs)]))
    for variant, fit in [("torch_fused_adamw", fused), *((v, b.get(f"optim/{v}")) for v in variants)]:
        if fit is None:
            continue
        note = "cpu fallback: plain 8-bit" if variant in ("8bit_paged", "8bit_offload") and not b.on_cuda else ""
        b.timing_rows("optim", variant, fit, fused, note)
        for place in ("device", "host", "paged"):
            value = fit.figures.get(f"optimizer_{place}_bytes")
            b.add("optim", variant, f"optimizer_state_{place}_bytes", value,
                  ratio(value, fused and fused.figures.get(f"optimizer_{place}_bytes")))
        b.cuda_only("optim", variant, "steady_device_bytes", fit.figures.get("steady_device_bytes"),
                    fused and fused.figures.get("steady_device_bytes"))
        b.cuda_only("optim", variant, "pinned_host_peak_bytes", fit.figures.get("pinned_host_peak_bytes"))
        b.cuda_only("optim", variant, "peak_reserved_device_bytes", fit.figures.get("peak_reserved_device_bytes"),
                    fused and fused.figures.get("peak_reserved_device_bytes"))
    # the allocator's view of the same (whatever the optimizer keeps where): between steps the device
    # holds the parameters and the device states, so a variant's device states are plain 8-bit's
    # plus the difference of the two steady figures
    plain = b.get("optim/8bit")
    for variant in ("8bit_paged", "8bit_offload"):
        fit = b.get(f"optim/{variant}")
        if plain is None or fit is None:
            continue
        steady, plain_steady = fit.figures.get("steady_device_bytes"), plain.figures.get("steady_device_bytes")
        plain_states = plain.figures.get("optimizer_device_bytes")
        derived = None if steady is None or plain_steady is None or plain_states is None else steady - plain_steady + plain_states
        b.cuda_only("optim", variant, "device_state_bytes_by_allocator", derived, plain_states)


def check_optim_exact(b: Bench) -> None:
    """Exactness of the 8-bit variants, and resumes: N steps with a checkpoint at N/2, then resumed from it."""
    from lightning_efficient import EightBitOptimizer

    steps = b.sizes["exact_steps"]
    half = steps // 2
    variants = {"8bit": {}, "8bit_paged": {"paged": True}, "8bit_offload": {"offload": "cpu"}}
    common = {"steps": steps, "steps_per_epoch": half, "warm": steps, "count_saved": False, "keep_params": True}
    with b.deterministic():
        for variant, kwargs in variants.items():
            b.run_case("optim_exact", variant, lambda kwargs=kwargs, variant=variant: b.fit(
                f"exact_{variant}", callbacks=[EightBitOptimizer(**kwargs)], save_at_epoch_end=True, **common))
        b.run_case("optim_exact", "8bit_rerun", lambda: b.fit("exact_8bit_rerun", callbacks=[EightBitOptimizer()], **common))
        for variant, kwargs in variants.items():
            uninterrupted = b.get(f"optim_exact/{variant}")
            if uninterrupted is None:
                continue
            b.run_case("resume", variant, lambda kwargs=kwargs, variant=variant, start=uninterrupted.checkpoint: b.fit(
                f"resume_{variant}", callbacks=[EightBitOptimizer(**kwargs)], resume_from=start, **common))
    plain = b.get("optim_exact/8bit")
    for variant in ("8bit_rerun", "8bit_paged", "8bit_offload"):
        fit = b.get(f"optim_exact/{variant}")
        b.compare("optim_exact", variant, plain and plain.params, fit and fit.params, exact=True, what="params",
                  control=None if variant == "8bit_rerun" else "optim_exact/8bit_rerun")
        if variant != "8bit_rerun" and not b.on_cuda:
            b.rows[-1].result += "; cpu fallback: plain 8-bit"
    for variant in variants:
        uninterrupted, resumed = b.get(f"optim_exact/{variant}"), b.get(f"resume/{variant}")
        b.compare("resume", variant, uninterrupted and uninterrupted.params, resumed and resumed.params, exact=True,
                  what="params_resumed_vs_uninterrupted", control="optim_exact/8bit_rerun")
    # where the states are after the resume, against the uninterrupted run of the same variant
    # (bitsandbytes keeps the states of tensors under 1e5 elements on the device even when paged)
    for variant, place in (("8bit_paged", "paged"), ("8bit_offload", "device")):
        metric = f"{place}_state_bytes_after_resume"
        uninterrupted, resumed = b.get(f"optim_exact/{variant}"), b.get(f"resume/{variant}")
        if not b.on_cuda:
            b.add("resume", variant, metric, None, None, NEEDS_CUDA)
        elif uninterrupted is not None and resumed is not None:
            before, after = (f.figures.get(f"optimizer_{place}_bytes") for f in (uninterrupted, resumed))
            same = after == before and (place != "paged" or (after or 0) > 0)
            b.add("resume", variant, metric, after, ratio(after, before),
                  "pass (as uninterrupted)" if same else f"FAIL (uninterrupted: {before} bytes)")
    for key, fit in b.fits.items():
        if fit is not None and key.split("/")[0] in ("optim_exact", "resume"):
            fit.params = None


def check_optim_twins(b: Bench) -> None:
    """The optimizer path alone: plain, paged and host-offloaded 8-bit AdamW twins fed the same gradients."""
    import bitsandbytes as bnb

    from lightning_efficient import DemoGPT
    from lightning_efficient.optim.offload import host_offloaded

    steps = b.sizes["exact_steps"]
    classes = {"8bit": bnb.optim.AdamW8bit, "8bit_rerun": bnb.optim.AdamW8bit,
               "8bit_paged": bnb.optim.PagedAdamW8bit if b.on_cuda else bnb.optim.AdamW8bit,
               "8bit_offload": host_offloaded(bnb.optim.AdamW8bit)}

    def case(cls: type) -> Fit:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(p.detach().to(b.device)) for p in DemoGPT(**b.sizes["model"]).parameters()]
        optimizer = cls(params, lr=1e-3, weight_decay=0.01)
        generator = torch.Generator(b.device).manual_seed(0)  # the same gradient sequence for every twin
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator, device=b.device) * 1e-2
            optimizer.step()
        synchronize(b.device)
        figures = {f"optimizer_{k}_bytes": v for k, v in state_bytes_by_place([optimizer]).items()}
        fit = Fit(figures=figures, params={str(i): p.detach().cpu().clone() for i, p in enumerate(params)})
        del optimizer, params
        return fit

    for variant, cls in classes.items():
        b.run_case("optim_twins", variant, lambda cls=cls: case(cls))
        b.free(f"optim_twins/{variant}")
    plain = b.get("optim_twins/8bit")
    for variant in ("8bit_rerun", "8bit_paged", "8bit_offload"):
        fit = b.get(f"optim_twins/{variant}")
        b.compare("optim_twins", variant, plain and plain.params, fit and fit.params, exact=True, what="params",
                  control=None if variant == "8bit_rerun" else "optim_twins/8bit_rerun")
        if variant == "8bit_paged" and not b.on_cuda:
            b.rows[-1].result += "; cpu fallback: plain 8-bit"
    offloaded = b.get("optim_twins/8bit_offload")
    if offloaded is not None:
        b.add("optim_twins", "8bit_offload", "optimizer_state_host_bytes", offloaded.figures.get("optimizer_host_bytes"))
    for key, fit in b.fits.items():
        if fit is not None and key.startswith("optim_twins/"):
            fit.params = None


def check_hetero(b: Bench) -> None:
    """hetero_ddp's CUDA probe (``max_micro_batch="auto"``) on one device under an allocator limit."""
    from lightning_efficient import HeterogeneousDDPStrategy

    check_baseline(b)
    base = b.get("baseline/plain")
    global_batch, headroom = b.sizes["probe_batch"], b.sizes["probe_headroom"]
    limit: dict[str, int] = {}

    def case() -> Fit:
        if b.on_cuda and headroom:
            from lightning_efficient import DemoGPT

            parameters = sum(p.numel() for p in DemoGPT(**b.sizes["model"]).parameters())
            limit["bytes"] = 16 * parameters + headroom  # weights, gradients, two AdamW moments + headroom
            total = torch.cuda.get_device_properties(b.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit["bytes"] / total), b.device)
        try:
            strategy = HeterogeneousDDPStrategy(global_batch_size=global_batch, max_micro_batch="auto")
            return b.fit("hetero", strategy=strategy, batch=global_batch, steps=b.sizes["probe_steps"], warm=1)
        finally:
            if b.on_cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, b.device)

    fit = b.run_case("hetero", "probe_auto", case)
    if fit is None:
        return
    b.add("hetero", "probe_auto", "max_micro_batch", fit.figures.get("micro_batch_cap"),
          ratio(fit.figures.get("micro_batch_cap"), global_batch))
    b.add("hetero", "probe_auto", "accumulation", fit.figures.get("accumulation"))
    b.add("hetero", "probe_auto", "fit_incl_probe_s", fit.wall_s)
    b.add("hetero", "probe_auto", "tokens_per_s", fit.tokens_per_s, ratio(fit.tokens_per_s, base and base.tokens_per_s))
    if b.on_cuda and "bytes" in limit:
        # a figure, not a check: under set_per_process_memory_fraction the allocator never exceeds the limit
        peak = fit.figures.get("peak_device_bytes")
        b.add("hetero", "probe_auto", "train_peak_after_probe_bytes", peak, ratio(peak, limit["bytes"]))
        b.add("hetero", "probe_auto", "limit_bytes", limit["bytes"], 1.0)
        # the check: with the probe's margin, training never ran at the edge (no allocation retried
        # after freeing the allocator's cache, let alone an out-of-memory)
        retries = fit.figures.get("alloc_retries_in_training")
        b.add("hetero", "probe_auto", "alloc_retries_in_training", retries, None,
              "error: not measured" if retries is None else "pass (none)" if retries == 0 else "FAIL (the allocator retried)")
    else:
        for metric in ("train_peak_after_probe_bytes", "alloc_retries_in_training"):
            b.add("hetero", "probe_auto", metric, None, None, NEEDS_CUDA)


def fsdp2_gpt() -> type:
    """``DemoGPT`` sharded by FSDP2 in ``configure_model``: ``fully_shard`` per block, then on the root.

    Its (unfused) ``training_step`` calls ``self(...)``, so FSDP2's root pre-forward hook gathers the
    root's parameters (embeddings, final norm, the tied head) before they are used.
    """
    from torch.distributed.fsdp import fully_shard

    from lightning_efficient import DemoGPT
    from lightning_efficient.memory import is_fsdp2

    class FSDP2GPT(DemoGPT):
        def configure_model(self) -> None:
            """Shard each block, then the root, over the data-parallel mesh (once)."""
            if is_fsdp2(self):
                return
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    return FSDP2GPT


def check_fsdp2(b: Bench) -> None:
    """FSDP2 on one device (see :func:`fsdp2_rows`); the process group Lightning set up for it is
    destroyed afterwards, so later fits start without one."""
    try:
        fsdp2_rows(b)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def fsdp2_rows(b: Bench) -> None:
    """FSDP2 on one device (``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)``, the
    model ``fully_shard`` per block and on the root) with each plugin, beside plain FSDP2 in the same run.

    Timing fits: plain FSDP2 (against the one-device baseline), ActivationMemory checkpoint and offload,
    EightBitOptimizer, ``hetero_fsdp`` with fixed shares, MemoryReport (against plain FSDP2): step time,
    tokens/s, device peak, saved bytes, optimizer-state bytes. Numerical fits (deterministic): gradients
    of checkpoint (first step, within ``GRAD_TOLERANCE``), offload and ``hetero_fsdp`` (both steps, and
    the parameters, exactly) against plain FSDP2 (``plain_rerun`` the control); plain FSDP2 against the
    plain one-device fit (one rank: the local shard is the whole tensor); and EightBitOptimizer's
    parameters after N steps under FSDP2 against plain 8-bit on one device, exactly (bitsandbytes runs
    on the local shard, here the whole tensor; inconclusive when FSDP2 itself is not bitwise one
    device). MemoryReport's activation bytes equal this script's count of plain FSDP2, and its
    parameter bytes the model's. The FSDP2 fits pass ``use_distributed_sampler=False`` (one rank:
    Lightning's DistributedSampler would only shuffle), so every fit here sees the same batches.
    """
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_efficient import ActivationMemory, DemoGPT, EightBitOptimizer, HeterogeneousFSDPStrategy, MemoryReport
    from lightning_efficient.memory import parameter_bytes

    check_baseline(b)
    base = b.get("baseline/plain")
    sharded = {"module_class": fsdp2_gpt(), "trainer_kwargs": {"use_distributed_sampler": False}}

    def fsdp2() -> ModelParallelStrategy:
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)

    def hetero() -> HeterogeneousFSDPStrategy:
        return HeterogeneousFSDPStrategy(global_batch_size=b.sizes["batch"], shares=[1.0], shuffle=False)

    variants: dict[str, tuple[Callable[[], Any], Callable[[], list]]] = {
        "plain": (fsdp2, lambda: []),
        "checkpoint": (fsdp2, lambda: [ActivationMemory(policy="checkpoint")]),
        "offload": (fsdp2, lambda: [ActivationMemory(**moving(b, "offload"))]),
        "8bit": (fsdp2, lambda: [EightBitOptimizer()]),
        "hetero_fsdp": (hetero, lambda: []),
    }
    for variant, (strategy, callbacks) in variants.items():
        b.run_case("fsdp2", variant, lambda variant=variant, strategy=strategy, callbacks=callbacks: b.fit(
            f"fsdp2_{variant}", strategy=strategy(), callbacks=callbacks(), **sharded))
    report = MemoryReport(print_table=False, log=False)
    figures: dict[str, Any] = {}

    class KeepReport(Callback):
        def on_fit_end(self, trainer, pl_module) -> None:
            figures.update(report.report())

    b.run_case("fsdp2", "memory_report", lambda: b.fit("fsdp2_memory_report", strategy=fsdp2(),
                                                       callbacks=[report, KeepReport()], count_saved=False, **sharded))
    plain = b.get("fsdp2/plain")
    for variant in [*variants, "memory_report"]:
        fit = b.get(f"fsdp2/{variant}")
        if fit is None:
            continue
        reference = base if variant == "plain" else plain
        note = "vs one-device baseline" if variant == "plain" else "vs plain fsdp2"
        if variant == "offload" and not b.on_cuda:
            note += "; cpu fallback: keep"
        b.timing_rows("fsdp2", variant, fit, reference, note)
        b.cuda_only("fsdp2", variant, "steady_device_bytes", fit.figures.get("steady_device_bytes"),
                    reference and reference.figures.get("steady_device_bytes"))
        b.cuda_only("fsdp2", variant, "pinned_host_peak_bytes", fit.figures.get("pinned_host_peak_bytes"))
        if variant == "offload":
            b.cuda_only("fsdp2", variant, "host_offload_bytes_per_step", fit.figures.get("host_offload_bytes_per_step"))
        if variant != "memory_report":
            b.add("fsdp2", variant, "saved_outside_inner_hooks_bytes", fit.saved_bytes,
                  ratio(fit.saved_bytes, reference and reference.saved_bytes))
        if variant in ("plain", "8bit"):
            states = sum(fit.figures.get(f"optimizer_{place}_bytes") or 0 for place in ("device", "host", "paged"))
            reference_states = plain and sum(plain.figures.get(f"optimizer_{place}_bytes") or 0
                                             for place in ("device", "host", "paged"))
            b.add("fsdp2", variant, "optimizer_state_bytes", states, ratio(states, reference_states))
    if b.get("fsdp2/memory_report") is not None:
        counted, reference = figures.get("activation_bytes"), plain and plain.saved_bytes
        same = counted is not None and counted == reference and "fsdp2" not in b.perturb
        b.add("fsdp2", "memory_report", "report_activation_bytes", counted, ratio(counted, reference),
              "pass (equals plain fsdp2's count)" if same else "FAIL (differs from plain fsdp2's count)")
        params = figures.get("parameter_bytes")
        expected = parameter_bytes(DemoGPT(**b.sizes["model"]))  # one rank: the local shards are the whole model
        b.add("fsdp2", "memory_report", "report_parameter_bytes", params, ratio(params, expected),
              "pass (the model's bytes)" if params == expected and "fsdp2" not in b.perturb else f"FAIL (the model has {expected} bytes)")
        b.cuda_only("fsdp2", "memory_report", "report_cuda_max_allocated_bytes",
                    figures.get("cuda_max_allocated_bytes"), b.get("fsdp2/memory_report").figures.get("peak_device_bytes"))

    # numerical: two steps' gradients (and the parameters after them) against plain FSDP2
    two_steps = {"steps": 2, "warm": 1, "count_saved": False, "grab_grads": True, "keep_params": True}
    numerical = {"plain": (fsdp2, lambda: []), "plain_rerun": (fsdp2, lambda: []),
                 "checkpoint": variants["checkpoint"], "offload": variants["offload"],
                 "hetero_fsdp": variants["hetero_fsdp"]}
    steps = b.sizes["exact_steps"]
    n_steps = {"steps": steps, "warm": steps, "count_saved": False, "keep_params": True}
    with b.deterministic():
        b.run_case("fsdp2_grads", "one_device", lambda: b.fit("fsdp2_grads_one_device", **two_steps))
        b.run_case("fsdp2_8bit", "one_device", lambda: b.fit(
            "fsdp2_8bit_one_device", callbacks=[EightBitOptimizer()], **n_steps))
        for variant, (strategy, callbacks) in numerical.items():
            b.run_case("fsdp2_grads", variant, lambda variant=variant, strategy=strategy, callbacks=callbacks: b.fit(
                f"fsdp2_grads_{variant}", strategy=strategy(), callbacks=callbacks(), **sharded, **two_steps))
        b.run_case("fsdp2_8bit", "fsdp2", lambda: b.fit(
            "fsdp2_8bit_fsdp2", strategy=fsdp2(), callbacks=[EightBitOptimizer()], **sharded, **n_steps))

    def grads(key: str, first: bool = False) -> dict[str, Tensor] | None:
        fit = b.get(key)
        if fit is None or fit.grads is None:
            return None
        return {k: v for k, v in fit.grads.items() if not first or k.startswith("step0/")}

    reference = "fsdp2_grads/plain"
    b.compare("fsdp2", "plain_rerun", grads(reference), grads("fsdp2_grads/plain_rerun"), exact=True, what="grad")
    b.compare("fsdp2", "plain_vs_one_device", grads("fsdp2_grads/one_device"), grads(reference), exact=False, what="grad")
    b.compare("fsdp2", "checkpoint", grads(reference, first=True), grads("fsdp2_grads/checkpoint", first=True),
              exact=False, what="grad")
    for variant in ("offload", "hetero_fsdp"):
        b.compare("fsdp2", variant, grads(reference), grads(f"fsdp2_grads/{variant}"), exact=True, what="grad",
                  control="fsdp2/plain_rerun")
        if variant == "offload" and not b.on_cuda:
            b.rows[-1].result += "; cpu fallback: keep"
        plain_fit, fit = b.get(reference), b.get(f"fsdp2_grads/{variant}")
        b.compare("fsdp2", variant, plain_fit and plain_fit.params, fit and fit.params, exact=True, what="params",
                  control="fsdp2/plain_rerun")
    one_device, sharded_8bit = b.get("fsdp2_8bit/one_device"), b.get("fsdp2_8bit/fsdp2")
    b.compare("fsdp2", "8bit", one_device and one_device.params, sharded_8bit and sharded_8bit.params, exact=True,
              what="params_vs_one_device_8bit", control="fsdp2/plain_vs_one_device")
    for key, fit in b.fits.items():
        if fit is not None and key.split("/")[0] in ("fsdp2_grads", "fsdp2_8bit"):
            fit.grads = fit.params = None


# -- AutoFit ---------------------------------------------------------------------------------------
#: AutoFit's budgets: bytes, or a fraction of the default configuration's (the baseline's) device peak
AUTOFIT_BUDGETS: dict[str, float] = {"2GiB": 2 * 2**30, "0.5x_default_peak": 0.5}
#: the issue's goal: AutoFit's predicted peak within this fraction of the measured one
AUTOFIT_PREDICTION_GOAL = 0.10
#: the issue's goal: planning costs at most this many training steps' time
AUTOFIT_PLANNING_STEPS_GOAL = 5.0


def autofit_fit(b: Bench, name: str, budget: int) -> Fit:
    """One fit of the demo GPT with ``AutoFit(budget=budget)`` (its whole space: micro-batch with
    accumulation keeping the global batch, every block's policy, the optimizer states' placement),
    through a data module whose ``batch_size`` AutoFit sets; measured by the same probe as every fit.

    AutoFit reports its measured peak after the warm-up steps (from the start of training, which it
    resets after planning), the probe the peak of the timed steps: their maximum is the peak of the
    whole training. An infeasible budget is a result (``figures["infeasible"]``), not an error."""
    import lightning

    from lightning_efficient import DemoGPT
    from lightning_efficient.autofit import AutoFit, BudgetTooSmall

    sizes = b.sizes
    warm = sizes["warm"]
    steps = warm + sizes["timed"]
    model_sizes = sizes["model"]
    rows = TokenRows(steps * sizes["batch"], model_sizes["seq_len"], model_sizes["vocab_size"])

    class Rows(lightning.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = sizes["batch"]

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(rows, batch_size=self.batch_size)

    torch.manual_seed(0)
    module = DemoGPT(**model_sizes)
    fitter = AutoFit(budget=budget, report_after_steps=warm)
    probe = make_probe(b.device, warm, count_saved=False, keep_params=False, grab_grads=False)
    trainer = lightning.Trainer(
        accelerator=b.device.type, devices=1, precision=PRECISION, max_steps=steps, max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=b.workdir, callbacks=[fitter, probe],
    )
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=Rows())
    except BudgetTooSmall as error:
        result = Fit(figures={"infeasible": str(error)})
    else:
        plan, measured = fitter.plan, fitter.measured
        mine = plan.ranks[0]
        figures = dict(probe.figures)
        figures.update(
            pick=(f"micro-batch {mine.micro_batch} x {plan.accumulation} accumulated, optimizer {plan.optimizer}, blocks "
                  + (", ".join(f"{mine.policies.count(p)} {p}" for p in dict.fromkeys(mine.policies)) or "all keep")),
            predicted_peak_bytes=mine.peak_bytes, predicted_tokens_per_s=plan.tokens_per_s, planning_s=fitter.planning_s,
            autofit_measured_peak_bytes=measured[0]["peak_bytes"] if measured else None,
        )
        result = Fit(probe.step_time_s, probe.tokens_per_s, figures=figures, wall_s=time.perf_counter() - start)
    del trainer, module, probe, fitter
    b.free(name)
    return result


def check_autofit(b: Bench) -> None:
    """AutoFit on the demo GPT at two budgets (2 GiB, half the default configuration's device peak):
    its pick, predicted peak against the ``max_memory_allocated`` peak of the whole training, tokens/s
    beside the default configuration's (the baseline), planning time; the issue's goals (peak within
    the budget, prediction within +-10%, planning within 5 steps). On the CPU (``--smoke``) the 2 GiB
    fit runs at toy sizes (its memory is RSS: the memory figures and goals need CUDA); the other budget,
    a fraction of a CUDA peak, is skipped."""
    check_baseline(b)
    base = b.get("baseline/plain")
    default_peak = base and base.figures.get("peak_device_bytes")
    for label, amount in AUTOFIT_BUDGETS.items():
        variant = f"budget_{label}"
        if amount < 1 and not b.on_cuda:
            b.add("autofit", variant, "case", None, None, NEEDS_CUDA)
            continue
        if amount < 1 and not default_peak:
            b.add("autofit", variant, "case", None, None, "error: the baseline's device peak is missing")
            continue
        budget = int(amount * default_peak) if amount < 1 else int(amount)
        fit = b.run_case("autofit", variant, lambda name=f"autofit_{label}", budget=budget: autofit_fit(b, name, budget))
        b.add("autofit", variant, "budget_bytes", budget, ratio(budget, default_peak))
        if fit is None:
            continue
        if "infeasible" in fit.figures:
            b.add("autofit", variant, "pick", None, None, "infeasible: " + fit.figures["infeasible"][:150])
            continue
        figures = fit.figures
        b.add("autofit", variant, "pick", None, None, figures["pick"])
        b.timing_rows("autofit", variant, fit, base)
        b.add("autofit", variant, "default_tokens_per_s", base and base.tokens_per_s, 1.0 if base else None)
        b.add("autofit", variant, "predicted_tokens_per_s", figures["predicted_tokens_per_s"],
              ratio(figures["predicted_tokens_per_s"], fit.tokens_per_s))
        predicted = figures["predicted_peak_bytes"]
        b.cuda_only("autofit", variant, "predicted_peak_bytes", predicted, budget)
        measured = None
        if b.on_cuda and figures.get("autofit_measured_peak_bytes") is not None:
            measured = max(figures["autofit_measured_peak_bytes"], figures.get("peak_device_bytes") or 0)
        b.cuda_only("autofit", variant, "measured_peak_bytes", measured, budget)
        if not b.on_cuda:
            for metric in ("prediction_error", "peak_within_budget"):
                b.add("autofit", variant, metric, None, None, NEEDS_CUDA)
        elif measured is None:
            b.add("autofit", variant, "prediction_error", None, None, "goal not evaluated: no measured peak")
        else:
            error = (predicted - measured) / measured
            b.add("autofit", variant, "prediction_error", error, None,
                  "goal met" if abs(error) <= AUTOFIT_PREDICTION_GOAL else "goal not met")
            b.add("autofit", variant, "peak_within_budget", measured / budget, None,
                  "goal met" if measured <= budget else "goal not met")
        steps = figures["planning_s"] / fit.step_time_s if fit.step_time_s else None
        b.add("autofit", variant, "planning_s", figures["planning_s"])
        # the goal is for the GPU sizes: at the smoke's toy sizes a step costs next to nothing
        goal = "" if steps is None or not b.on_cuda else "goal met" if steps <= AUTOFIT_PLANNING_STEPS_GOAL else "goal not met"
        b.add("autofit", variant, "planning_steps", steps, None, goal)


def check_cleanup(b: Bench) -> None:
    """What the cases left allocated on the device once freed (the next case starts from it)."""
    if not b.on_cuda:
        b.add("cleanup", "-", "device_bytes_left_after_a_case_max", None, None, NEEDS_CUDA)
    elif b.leftover:
        name, most = max(b.leftover, key=lambda item: item[1])
        b.add("cleanup", name, "device_bytes_left_after_a_case_max", most)


def check_goals(b: Bench) -> None:
    """The issue's goals, from the figures above (they do not change the exit code)."""

    def goal(name: str, value: float | None, met: bool | None) -> None:
        if not b.on_cuda:
            b.add("goals", name, "value", None, None, NEEDS_CUDA)
        elif met is None:
            b.add("goals", name, "value", None, None, "goal not evaluated: a case is missing")
        else:
            b.add("goals", name, "value", value, None, "goal met" if met else "goal not met")

    share = next((r.value for r in b.rows if r.check == "activations" and r.metric == "share_of_movable_off_device"), None)
    offload, base = b.get("activations/offload"), b.get("baseline/plain")
    time_ratio = ratio(offload and offload.step_time_s, base and base.step_time_s)
    goal(f"offload_share_off_device>={OFFLOAD_SHARE_GOAL:.2f}", share, None if share is None else share >= OFFLOAD_SHARE_GOAL)
    goal(f"offload_step_time<={OFFLOAD_TIME_GOAL:.2f}x_keep", time_ratio,
         None if time_ratio is None else time_ratio <= OFFLOAD_TIME_GOAL)
    fused, plain = b.get("optim/torch_fused_adamw"), b.get("optim/8bit")
    speed = ratio(plain and plain.tokens_per_s, fused and fused.tokens_per_s)
    goal(f"8bit_tokens_per_s>={EIGHT_BIT_SPEED_GOAL:.2f}x_fused_adamw", speed, None if speed is None else speed >= EIGHT_BIT_SPEED_GOAL)
    offloaded = b.get("optim/8bit_offload")
    device_share = ratio(offloaded and offloaded.figures.get("optimizer_device_bytes"),
                         plain and plain.figures.get("optimizer_device_bytes"))
    goal(f"offloaded_states_device_bytes<={OFFLOADED_STATE_DEVICE_GOAL:.2f}x_plain_8bit", device_share,
         None if device_share is None else device_share <= OFFLOADED_STATE_DEVICE_GOAL)
    failed = sum(1 for r in b.rows if r.result.startswith(RESULTS_THAT_FAIL))
    b.add("goals", "every_numerical_check_passes", "failed_checks", failed, None, "goal met" if failed == 0 else "goal not met")


CHECKS: dict[str, Callable[[Bench], None]] = {
    "baseline": check_baseline,
    "activations": check_activations,
    "grads": check_grads,
    "tokens": check_tokens,
    "linear_ce": check_linear_ce,
    "memory_report": check_memory_report,
    "optim": check_optim,
    "optim_twins": check_optim_twins,
    "optim_exact": check_optim_exact,  # its rows are under optim_exact and resume
    "hetero": check_hetero,
    "fsdp2": check_fsdp2,
    "autofit": check_autofit,
    "cleanup": check_cleanup,
    "goals": check_goals,
}
#: the table's ``check`` names (``resume`` rows come from ``optim_exact``)
TABLE_CHECKS = ("baseline", "activations", "grads", "tokens", "linear_ce", "memory_report", "optim", "optim_twins",
                "optim_exact", "resume", "hetero", "fsdp2", "autofit", "cleanup", "goals")


# -- the table -----------------------------------------------------------------------------------
def shown(metric: str, value: float | None) -> str:
    """A value with its unit: MiB for bytes, ms for seconds."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if "bytes" in metric:
        return f"{value / 2**20:,.1f} MiB"
    if metric.endswith("_s") and "per_s" not in metric:
        return f"{value * 1e3:,.2f} ms"
    if "max_abs_diff" in metric:
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{value:,}"


def table(rows: list[Row]) -> str:
    """The rows as one Markdown table."""
    cells = [("check", "variant", "metric", "value", "ratio", "result")]
    cells += [(r.check, r.variant, r.metric, shown(r.metric, r.value),
               "-" if r.ratio is None else (f"{r.ratio:.3g}" if math.isfinite(r.ratio) else str(r.ratio)), r.result or "-")
              for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(6)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print the table; 1 when a check failed or a case raised, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script itself)")
    parser.add_argument("--only", action="append", choices=list(CHECKS), help="run this check only (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="keep Lightning's and the plugins' info lines")
    parser.add_argument("--out", type=Path, help="also write the table (Markdown) and its notes to this file")
    parser.add_argument("--perturb", action="append", default=[], help=argparse.SUPPRESS)  # tests: make a check fail
    args = parser.parse_args(argv)
    if args.smoke:
        device, sizes = torch.device("cpu"), SIZES["smoke"]
        torch.set_num_threads(1)  # toy tensors: threads only contend (the tests share a few cores)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured (--smoke runs the checks at toy sizes on the CPU).")
        return 0
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        device, sizes = torch.device("cuda", torch.cuda.current_device()), SIZES["gpu"]
    if not args.verbose:
        for name in ("lightning.pytorch", "lightning.fabric", "lightning_efficient"):
            logging.getLogger(name).setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*(GPU|TPU|HPU) available.*")
    import lightning  # noqa: F401 - imported before the freeze below

    import lightning_efficient  # noqa: F401

    gc.collect()
    gc.freeze()  # the libraries' objects are never garbage: each case's collection skips them
    header = (f"gpu_check on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "gpu_check --smoke on CPU")
    header += f" (torch {torch.__version__}, precision {PRECISION}, model {sizes['model']}, batch {sizes['batch']})"
    print(header)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
        bench = Bench(device, sizes, set(args.perturb), Path(workdir))
        selected = [name for name in CHECKS if not args.only or name in args.only]
        for done, name in enumerate(selected, 1):
            try:
                CHECKS[name](bench)
            except Exception as error:  # noqa: BLE001 - a failure while making rows is a failure, not a crash
                bench.add(name, "-", "rows", None, None, f"error: {type(error).__name__}: {error}".splitlines()[0][:150])
            if args.out is not None and done < len(selected):  # a run cut short still leaves the rows it made
                write_table(args.out, header, bench, start, f"partial: {done} of {len(selected)} checks")
    lines = write_table(args.out, header, bench, start)
    print("\n".join(lines[2:]))
    return 1 if any(r.result.startswith(RESULTS_THAT_FAIL) for r in bench.rows) else 0


def write_table(out: Path | None, header: str, bench: Bench, start: float, status: str = "") -> list[str]:
    """The table with its notes as lines, also written to ``out`` when given."""
    failed = [r for r in bench.rows if r.result.startswith(RESULTS_THAT_FAIL)]
    lines = [header, "", table(bench.rows), ""]
    lines += [f"not deterministic during the numerical fits: {text}" for text in sorted(bench.nondeterministic)]
    lines.append(f"gpu_check: {len(failed)} failed check(s) or error(s); {time.perf_counter() - start:.0f} s"
                 + (f" ({status})" if status else ""))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
