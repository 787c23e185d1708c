"""Case ``autofit``: AutoFit's pick against the exhaustive grid over the same space, and against
Lightning's batch-size finder, at three memory budgets, for the demo GPT and a transformers Llama.

Per model:

* the grid: every micro-batch dividing the global batch (gradient accumulation keeps it), optimizer
  states 32-bit or 8-bit (:class:`EightBitOptimizer`), one block policy for every block (keep,
  checkpoint, selective, disk; :class:`ActivationMemory`), each point a fit in its own process: the
  median optimizer-step time after warm-up (as tokens/s) and the peak memory as AutoFit counts it on
  CPU, the peak RSS above the RSS at the fit's start (:class:`~lightning_efficient.memory.PeakMemory`,
  reset when training starts, read when it ends);
* the budgets: ``loose``, ``medium`` and ``tight`` are 1.5x, 0.6x and 0.35x the peak of the default
  configuration (the whole global batch in one micro-batch, 32-bit states, every block kept), the grid
  point measured first in the same run (a variant run alone measures it again in a fresh process);
  for each budget the best grid point is the fastest whose measured peak is within it;
* ``AutoFit(budget=B)`` over the same space, in its own process per budget: its pick, its predicted
  and measured peak, tokens/s measured as for the grid, its planning seconds and their worth in
  training steps; also the peak while it planned (before the first step, outside AutoFit's own
  measured window). It runs :data:`RUNS` times per budget, each run followed by a fresh fit of the
  best grid point within the budget (every other run preceded by it instead): the grid's best is the
  fastest of 40 noisy readings (a reading flattered by the noise between processes), so the speed ratio
  is also taken against it measured again, interleaved with AutoFit's runs;
* speed under glibc's default allocator: every fit above runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (the
  harness's setting, so that RSS counts what is held), under which each allocation over 128 KiB is a fresh
  mapping faulted in page by page: fits run 1.2-2x slower than under glibc's default, and micro-batch 1
  reads fastest where under the default it is the slowest. So every grid point is timed again in a fresh
  process under the default allocator (its peak is still the setting's), and each AutoFit run's plan is
  fitted by hand under it, followed by the best point within the budget by those timings: the speed goal
  is reported under both;
* Lightning's ``Tuner.scale_batch_size`` (power mode, its defaults) at the same budget: there is no
  out-of-memory on CPU at a budget, so it runs in a child process whose address space is limited to
  its size when the fit starts plus the budget (``RLIMIT_AS``; Lightning's ``is_oom_error`` knows the CPU
  allocator's "can't allocate memory"), then the fit at its pick in a fresh process — which changes the
  global batch: it does not accumulate. An address-space limit is not the RSS budget (pages mapped
  before it and touched after it are not counted, reserved pages never touched are), so the pick's
  RSS peak is measured and set against the budget.
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO_ROOT, RESULT_PREFIX, Case, panels, register, worker_env

SEQ_LEN, VOCAB, GLOBAL_BATCH = 128, 4096, 16
QUICK_SEQ_LEN, QUICK_VOCAB, QUICK_GLOBAL_BATCH = 32, 512, 4
MODELS: dict[str, dict[str, Any]] = {
    "demo": {"vocab_size": VOCAB, "n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": SEQ_LEN, "fused_loss": False},
    "llama": {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": SEQ_LEN,
              "tie_word_embeddings": True},
}
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "demo": {"vocab_size": QUICK_VOCAB, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": QUICK_SEQ_LEN,
             "fused_loss": False},
    "llama": {"vocab_size": QUICK_VOCAB, "hidden_size": 32, "intermediate_size": 86, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": QUICK_SEQ_LEN,
              "tie_word_embeddings": True},
}
MAX_FILES, QUICK_MAX_FILES = 200, 60
OPTIMIZERS = ("32-bit", "8-bit")
POLICIES = ("keep", "checkpoint", "selective", "disk")
#: budget name -> its multiple of the default configuration's measured peak
BUDGETS = {"loose": 1.5, "medium": 0.6, "tight": 0.35}
QUICK_BUDGETS = ("loose",)


def _budget_names(quick: bool) -> tuple[str, ...]:
    return QUICK_BUDGETS if quick else tuple(BUDGETS)
#: optimizer steps per fit: warm-up steps (not timed), then timed steps (their median is the step time)
WARMUP, TIMED = 2, 8
QUICK_WARMUP, QUICK_TIMED = 1, 2
#: AutoFit's runs per budget, each followed by a fresh fit of the best grid point within it (interleaved): the
#: grid's best is the fastest of 40 noisy readings, so it is measured again beside AutoFit's
RUNS, QUICK_RUNS = 3, 1
#: a grid point's tokens/s in a fit under glibc's default allocator (its peak is the harness setting's)
DEFAULT_ALLOCATOR = "default_allocator_tokens_per_s"
#: the issue's goals
SPEED_GOAL, PREDICTION_GOAL, PLANNING_STEPS_GOAL = 0.95, 0.10, 5.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grid_points(quick: bool, model: str = "demo") -> list[tuple[int, str, str]]:
    """``(micro-batch, optimizer, policy)`` of every grid point, the default configuration first.

    ``--quick`` measures the default and one other point per model, which between the two models turn
    every knob (its "best grid point" is the better of two, so its ratios mean nothing)."""
    if quick:
        g = QUICK_GLOBAL_BATCH
        other = (g // 2, "8-bit", "selective") if model == "demo" else (1, "32-bit", "disk")
        return [(g, "32-bit", "keep"), other]
    points = [(m, o, p) for m in reversed(_divisors(GLOBAL_BATCH)) for o in OPTIMIZERS for p in POLICIES]
    return points  # (16, "32-bit", "keep") first


def point_name(micro: int, optimizer: str, policy: str) -> str:
    """The grid label's last part: ``mb16-32bit-keep``."""
    return f"mb{micro}-{optimizer.replace('-', '')}-{policy}"


def _global_batch(quick: bool) -> int:
    return QUICK_GLOBAL_BATCH if quick else GLOBAL_BATCH


def _steps(quick: bool) -> tuple[int, int]:
    return (QUICK_WARMUP, QUICK_TIMED) if quick else (WARMUP, TIMED)


def _threads(quick: bool) -> None:
    """``--quick``: one thread (toy tensors: on a busy machine two threads only wait for each other);
    the full run keeps torch's default (every core)."""
    if quick:
        import torch

        torch.set_num_threads(1)


# -- building one fit ----------------------------------------------------------------------------
def _module(model: str, quick: bool):
    import torch

    torch.manual_seed(0)
    settings = (QUICK_MODELS if quick else MODELS)[model]
    if model == "demo":
        from lightning_efficient import DemoGPT

        return DemoGPT(**settings)
    from lightning_efficient.hf import HFCausalLM

    return HFCausalLM("llama", settings)


def _data(quick: bool, batch_size: int):
    from lightning_efficient import CorpusDataModule

    data = CorpusDataModule(vocab_size=QUICK_VOCAB if quick else VOCAB, seq_len=QUICK_SEQ_LEN if quick else SEQ_LEN,
                            batch_size=batch_size, max_files=QUICK_MAX_FILES if quick else MAX_FILES)
    data.prepare_data()  # the tokenizer is trained once (cached): not inside any fit
    return data


def _trainer(steps: int, root: str, callbacks: list, accumulation: int = 1):
    import lightning

    return lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulation, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
    )


def _meter(warmup: int, eight_bit: bool):
    """A callback measuring a fit as AutoFit does (built here so Lightning is imported only in a worker).

    Its ``setup`` reads the RSS the peaks are counted above (bitsandbytes loaded first when the fit may
    use it, as AutoFit does: a library's import is not training memory) and opens a peak meter; at the
    start of training it reads the peak so far (the planning or the batch-size search before the first
    step: a meter keeps what AutoFit's own readings reset), then opens another; at the end of training it reads
    it. Each optimizer step's time runs from the end of the previous one (the first from its first micro-batch's
    start), as AutoFit times them; the step time is the median after ``warmup``.
    """
    from lightning.pytorch import Callback

    from benchmarks.common import OptimizerStepClock  # (Lightning is imported in a worker only)
    from lightning_efficient.memory import PeakMemory, fit_start_rss_bytes
    from lightning_efficient.optim._bnb import bitsandbytes

    class Meter(Callback):
        def __init__(self) -> None:
            self.start_rss = 0
            self.before_training_peak = 0
            self.peak = 0
            self.step_s: list[float] = []
            self._meter: PeakMemory | None = None
            self._clock = OptimizerStepClock()

        def setup(self, trainer, pl_module, stage) -> None:
            if eight_bit:
                bitsandbytes()
            self.start_rss = fit_start_rss_bytes()  # as AutoFit and MemoryReport read the fit's start
            # a meter, not the process's one peak, which AutoFit resets for each of its readings
            self._before = PeakMemory(pl_module.device, self.start_rss)
            self._before.reset(release=False)

        def on_train_start(self, trainer, pl_module) -> None:
            self.before_training_peak = self._before.read()
            self._meter = PeakMemory(pl_module.device, self.start_rss)
            self._meter.reset()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._clock.batch_started()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seconds = self._clock.batch_ended(trainer)
            if seconds is not None:
                self.step_s.append(seconds)

        def on_train_end(self, trainer, pl_module) -> None:
            self.peak = self._meter.read()

        @property
        def median_step_s(self) -> float:
            return statistics.median(self.step_s[warmup:] or self.step_s)

    return Meter()


def _measured(meter, samples_per_step: int, quick: bool) -> dict[str, float]:
    seq = QUICK_SEQ_LEN if quick else SEQ_LEN
    step = meter.median_step_s
    return {"tokens_per_s": samples_per_step * seq / step, "step_time_s": step, "peak_bytes": meter.peak,
            "steps_timed": len(meter.step_s[_steps(quick)[0]:])}


def _fit_point(model: str, quick: bool, micro: int, optimizer: str, policy: str | list[str], root: str,
               global_batch: int | None = None) -> dict[str, float]:
    """A fit at ``micro`` samples (accumulated to the global batch), ``optimizer`` states and ``policy`` for every
    block (or one per block, as a plan gives them), measured by :func:`_meter`."""
    from lightning_efficient import ActivationMemory, EightBitOptimizer

    warmup, timed = _steps(quick)
    meter = _meter(warmup, optimizer == "8-bit")
    callbacks = [meter]
    if any(p != "keep" for p in ([policy] if isinstance(policy, str) else policy)):
        callbacks.append(ActivationMemory(policy=policy))
    if optimizer == "8-bit":
        callbacks.append(EightBitOptimizer())
    global_batch = global_batch or _global_batch(quick)
    data = _data(quick, micro)
    trainer = _trainer(warmup + timed, root, callbacks, accumulation=global_batch // micro)
    trainer.fit(_module(model, quick), datamodule=data)
    return _measured(meter, global_batch, quick)


# -- child processes -----------------------------------------------------------------------------
def _child(entry: str, *args: Any, timeout_s: float = 600.0, default_allocator: bool = False) -> dict[str, Any]:
    """Run ``entry(*args)`` of this module in a fresh Python process (the harness's environment: its
    mmap threshold for honest RSS; with ``default_allocator`` glibc's default instead, for speed as users
    train) and return the metrics it printed (or ``{"error": ...}``)."""
    code = f"import json, sys; from benchmarks.cases.autofit import {entry}; {entry}(*json.loads(sys.argv[1]))"
    command = [sys.executable, "-c", code, json.dumps(list(args))]
    env = worker_env()
    if default_allocator:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {done.returncode}: " + " | ".join(tail)}


def _print_result(metrics: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(metrics), flush=True)


def point_main(model: str, micro: int, optimizer: str, policy: str | list[str], quick: bool) -> None:
    """One grid point (or a plan: one policy per block) in this (fresh) process; prints its figures."""
    import numpy as np

    random.seed(0)
    np.random.seed(0)
    _threads(quick)
    with tempfile.TemporaryDirectory() as root:
        _print_result(_fit_point(model, quick, micro, optimizer, policy, root))


# -- the reference peak the budgets are multiples of -----------------------------------------------
def _run_key() -> str:
    """This run of ``benchmarks.run``: its process id and start time (a worker's parent)."""
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return f"{parent}-{started}"


def _reference_file(model: str, quick: bool) -> Path:
    return Path(tempfile.gettempdir()) / f"lightning_efficient-autofit-reference-{_run_key()}-{model}-{int(quick)}.json"


def reference_peak(model: str, quick: bool) -> int:
    """The default configuration's measured peak in this run: the one the ``grid`` variant measured,
    or, when this run has not run it, measured now in a fresh process (and kept for this run's other variants)."""
    path = _reference_file(model, quick)
    if path.exists():
        return int(json.loads(path.read_text())["peak_bytes"])
    metrics = _child("point_main", model, *grid_points(quick, model)[0], quick)
    if "peak_bytes" not in metrics:
        raise RuntimeError(f"the default configuration's fit failed: {metrics.get('error')}")
    path.write_text(json.dumps({"peak_bytes": metrics["peak_bytes"]}))
    return int(metrics["peak_bytes"])


def _budget(model: str, name: str, quick: bool) -> int:
    return int(BUDGETS[name] * reference_peak(model, quick))


# -- the variants --------------------------------------------------------------------------------
def grid(model: str, quick: bool) -> dict[str, Any]:
    """Every grid point, each in its own fresh process: tokens/s and peak (``points``, by name)."""
    points: dict[str, dict[str, Any]] = {}
    for index, (micro, optimizer, policy) in enumerate(grid_points(quick, model)):
        name = point_name(micro, optimizer, policy)
        print(f"[autofit] {model}/grid/{name} ...", file=sys.stderr, flush=True)
        points[name] = {**_child("point_main", model, micro, optimizer, policy, quick), "micro_batch": micro,
                        "accumulation": _global_batch(quick) // micro}
        as_users_train = _child("point_main", model, micro, optimizer, policy, quick, default_allocator=True)
        if "tokens_per_s" in as_users_train:
            points[name][DEFAULT_ALLOCATOR] = as_users_train["tokens_per_s"]
        if index == 0 and "peak_bytes" in points[name]:  # the default configuration: this run's budgets' reference
            _reference_file(model, quick).write_text(json.dumps({"peak_bytes": points[name]["peak_bytes"]}))
    if _reference_file(model, quick).exists():  # the whole grid, for the autofit variant's re-measured best points
        reference = json.loads(_reference_file(model, quick).read_text())
        _reference_file(model, quick).write_text(json.dumps({**reference, "points": points}))
    default = points[point_name(*grid_points(quick, model)[0])]
    failed = [name for name, r in points.items() if "error" in r]
    figures: dict[str, Any] = {"points": points, "points_measured": len(points) - len(failed)}
    if failed:
        figures["failed_points"] = ", ".join(f"{name}: {points[name]['error'][:120]}" for name in failed)
    if "peak_bytes" in default:
        figures.update(default_tokens_per_s=default["tokens_per_s"], default_peak_bytes=default["peak_bytes"])
    fastest = max((r for r in points.values() if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"], default=None)
    if fastest is not None:
        figures["fastest_tokens_per_s"] = fastest["tokens_per_s"]
    return figures


def _counts(policies: list[str]) -> str:
    return "+".join(f"{policies.count(p)} {p}" for p in dict.fromkeys(policies)) or "every block kept"


def autofit_main(model: str, budget: int, quick: bool) -> None:
    """AutoFit over the grid's space at ``budget`` in this (fresh) process: prints its pick, predictions and
    the fit measured like the grid's points (or ``{"infeasible": AutoFit's message}``)."""
    from lightning_efficient.autofit import AutoFit, BudgetTooSmall

    _threads(quick)
    warmup, timed = _steps(quick)
    meter = _meter(warmup, True)
    fitter = AutoFit(budget=budget, activation_policies=list(POLICIES), optimizer_options=list(OPTIMIZERS),
                     report_after_steps=warmup + timed)  # measured over the same window as the grid's peak
    global_batch = _global_batch(quick)
    data = _data(quick, global_batch)
    trained = _plan_at_start(fitter)
    with tempfile.TemporaryDirectory() as root:
        trainer = _trainer(warmup + timed, root, [meter, fitter, trained])
        try:
            trainer.fit(_module(model, quick), datamodule=data)
        except BudgetTooSmall as error:
            _print_result({"infeasible": str(error)[:400]})
            return
    # the figures are the plan the measured steps ran: a re-plan after them (a measured peak above its prediction)
    # changes the plan the fit goes on with, reported beside it
    plan, measured, final = trained.plan, fitter.measured, fitter.plan
    mine = plan.ranks[0]
    figures = _measured(meter, global_batch, quick)
    policies = list(mine.policies) or ["keep"]  # no block planned: every block kept
    uniform = len(set(policies)) == 1
    _print_result({
        **figures,
        "micro_batch": mine.micro_batch,
        "accumulation": plan.accumulation,
        "optimizer": plan.optimizer,
        "policies": _counts(list(mine.policies)),
        "policy_list": policies,
        "grid_point": point_name(mine.micro_batch, plan.optimizer, policies[0]) if uniform else "",
        "predicted_peak_bytes": mine.peak_bytes,
        "predicted_tokens_per_s": plan.tokens_per_s,
        "measured_peak_bytes": measured[0]["peak_bytes"] if measured else None,
        "planning_peak_bytes": meter.before_training_peak,
        "planning_s": fitter.planning_s,
        "planning_steps": fitter.planning_s / figures["step_time_s"],
        "notes": "; ".join(final.notes),
        "replanned_policies": _counts(list(final.ranks[0].policies)) if final is not plan else "",
    })


def _plan_at_start(fitter):
    """A callback recording AutoFit's plan when training starts: the one the measured steps run (built here so
    Lightning is imported only in a worker)."""
    from lightning.pytorch import Callback

    class PlanAtStart(Callback):
        plan = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.plan = fitter.plan

    return PlanAtStart()


def _grid_points_of_this_run(model: str, quick: bool) -> dict[str, dict[str, Any]]:
    """The grid this run measured (empty when the grid variant has not run in it)."""
    path = _reference_file(model, quick)
    points = json.loads(path.read_text()).get("points", {}) if path.exists() else {}
    return {name: r for name, r in points.items() if "tokens_per_s" in r}


def autofit(model: str, quick: bool) -> dict[str, Any]:
    """AutoFit at each budget, :data:`RUNS` times, each in its own fresh process, each followed by a fresh fit of
    the best grid point within the budget when this run measured the grid (``budgets``, by name: the first run's
    figures, ``runs_tokens_per_s`` and ``best_again_tokens_per_s`` with every run's)."""
    runs: dict[str, dict[str, Any]] = {}
    grid_points_measured = _grid_points_of_this_run(model, quick)
    for name in _budget_names(quick):
        budget = _budget(model, name, quick)
        best = best_within(grid_points_measured, budget)
        best_as_users_train = best_within(grid_points_measured, budget, speed=DEFAULT_ALLOCATOR)
        again, tokens, picks, first = [], [], [], None
        by_hand, again_as_users_train = [], []
        for index in range(QUICK_RUNS if quick else RUNS):
            print(f"[autofit] {model}/autofit/{name} run {index + 1} ...", file=sys.stderr, flush=True)
            # every other run measures the best point first: neither side always runs right after the other
            best_first = index % 2 == 1
            if best is not None and best_first:
                again.extend(_tokens_per_s_of(_child("point_main", model, *_parse_point(best[0]), quick)))
            run = _child("autofit_main", model, budget, quick)
            if first is None or ("tokens_per_s" in run and "tokens_per_s" not in first):  # the first that trained
                first = run
            if "tokens_per_s" in run:
                tokens.append(run["tokens_per_s"])
                picks.append(f"mb{run['micro_batch']}x{run['accumulation']} {run['optimizer']} {run['policies']}")
            if best is not None and not best_first:
                again.extend(_tokens_per_s_of(_child("point_main", model, *_parse_point(best[0]), quick)))
            # under glibc's default allocator: this run's plan fitted by hand and the best point by those timings (in
            # the same alternating order)
            if "tokens_per_s" in run and best_as_users_train is not None:
                fits = {"plan": ("point_main", model, run["micro_batch"], run["optimizer"], run["policy_list"], quick),
                        "point": ("point_main", model, *_parse_point(best_as_users_train[0]), quick)}
                done = {key: _child(*fits[key], default_allocator=True)
                        for key in (("point", "plan") if best_first else ("plan", "point"))}
                plan, point = done["plan"], done["point"]
                if "tokens_per_s" in plan and "tokens_per_s" in point:
                    by_hand.append(plan["tokens_per_s"])
                    again_as_users_train.append(point["tokens_per_s"])
        runs[name] = {"budget_bytes": budget, **(first or {}), "picks": picks, "runs_tokens_per_s": tokens,
                      "best_again_tokens_per_s": again, "best_point": best[0] if best else None,
                      "plan_default_allocator_tokens_per_s": by_hand, "best_again_default_allocator_tokens_per_s": again_as_users_train,
                      "best_point_default_allocator": best_as_users_train[0] if best_as_users_train else None}
    figures: dict[str, Any] = {"budgets": runs}
    for name, run in runs.items():
        for key in ("tokens_per_s", "predicted_peak_bytes", "measured_peak_bytes", "planning_steps", "error", "infeasible"):
            if key in run:
                figures[f"{name}_{key}"] = run[key]
        if run.get("runs_tokens_per_s") and run.get("best_again_tokens_per_s"):
            figures[f"{name}_ratio_same_run"] = statistics.median(run["runs_tokens_per_s"]) / statistics.median(
                run["best_again_tokens_per_s"])
        if run.get("plan_default_allocator_tokens_per_s"):
            figures[f"{name}_ratio_same_run_default_allocator"] = statistics.median(
                run["plan_default_allocator_tokens_per_s"]) / statistics.median(run["best_again_default_allocator_tokens_per_s"])
    return figures


def _tokens_per_s_of(measured: dict[str, Any]) -> list[float]:
    """A fit's tokens/s as a list of one (none where it failed)."""
    return [measured["tokens_per_s"]] if "tokens_per_s" in measured else []


def _parse_point(name: str) -> tuple[int, str, str]:
    """The inverse of :func:`point_name`."""
    micro, optimizer, policy = name.split("-")
    return int(micro[2:]), optimizer.replace("bit", "-bit"), policy


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def tune_main(model: str, budget: int, quick: bool) -> None:
    """Lightning's batch-size finder in this (fresh) process under an address-space limit of its size at
    the fit's start plus ``budget``; prints ``{"batch_size": ...}`` or ``{"error": ...}``."""
    import resource

    import torch
    from lightning.pytorch import Callback
    from lightning.pytorch.tuner import Tuner

    _threads(quick)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    torch.ones(256, 256) @ torch.ones(256, 256)  # torch's threads (and their stacks) exist before the limit

    class AddressSpaceLimit(Callback):
        def setup(self, trainer, pl_module, stage) -> None:  # where AutoFit reads the fit's start
            resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + budget, hard))

    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as root:
            trainer = _trainer(10, root, [AddressSpaceLimit()])
            picked = Tuner(trainer).scale_batch_size(_module(model, quick), datamodule=_data(quick, 2), mode="power")
        result: dict[str, Any] = {"batch_size": picked, "seconds": time.perf_counter() - started}
    except BaseException as error:  # noqa: BLE001 - the finder's outcome, reported
        result = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    _print_result(result)


def pick_main(model: str, batch_size: int, quick: bool) -> None:
    """A fit at the finder's pick in this (fresh) process: ``batch_size`` samples a step, no accumulation,
    32-bit states, every block kept; prints its figures."""
    _threads(quick)
    with tempfile.TemporaryDirectory() as root:
        _print_result(_fit_point(model, quick, batch_size, "32-bit", "keep", root, global_batch=batch_size))


def tuner(model: str, quick: bool) -> dict[str, Any]:
    """Lightning's batch-size finder at each budget (in an address-space-limited process), then a fit at its
    pick in a fresh process, measured like the grid (``budgets``, by name)."""
    runs: dict[str, dict[str, Any]] = {}
    for name in _budget_names(quick):
        budget = _budget(model, name, quick)
        print(f"[autofit] {model}/tuner/{name} ...", file=sys.stderr, flush=True)
        found = _child("tune_main", model, budget, quick)
        if "error" in found or not found.get("batch_size"):
            runs[name] = {"budget_bytes": budget, "tuner_error": found.get("error", f"picked {found.get('batch_size')!r}")}
            continue
        picked = int(found["batch_size"])
        figures = _child("pick_main", model, picked, quick)
        runs[name] = {"budget_bytes": budget, **figures, "batch_size": picked, "global_batch": picked, "tuner_s": found["seconds"]}
        if "peak_bytes" in figures:
            runs[name]["fits_budget"] = int(figures["peak_bytes"] <= budget)
    figures = {"budgets": runs}
    for name, run in runs.items():
        for key in ("batch_size", "tokens_per_s", "peak_bytes", "fits_budget", "tuner_error", "error"):
            if key in run:
                figures[f"{name}_{key}"] = run[key]
    return figures


# -- the report ----------------------------------------------------------------------------------
def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _grid_of(results: dict[str, dict[str, Any]], model: str) -> dict[str, dict[str, Any]]:
    """The model's measured grid points by name."""
    points = results.get(f"{model}/grid", {}).get("points") or {}
    return {name: r for name, r in points.items() if "tokens_per_s" in r}


def _runs(results: dict[str, dict[str, Any]], model: str, kind: str) -> dict[str, dict[str, Any]]:
    """The model's AutoFit (``kind="autofit"``) or finder (``"tuner"``) runs by budget name."""
    variant = results.get(f"{model}/{kind}", {})
    runs = dict(variant.get("budgets") or {})
    if "error" in variant:  # the variant itself failed: every budget says so
        runs = {name: {"error": variant["error"]} for name in BUDGETS}
    return runs


def best_within(points: dict[str, dict[str, Any]], budget: float, speed: str = "tokens_per_s") -> tuple[str, dict[str, Any]] | None:
    """The fastest grid point (by ``speed``: the fit's own tokens/s, or :data:`DEFAULT_ALLOCATOR`'s) whose
    measured peak is within ``budget`` (None when none is)."""
    fitting = [(name, r) for name, r in points.items() if r["peak_bytes"] <= budget and speed in r]
    return max(fitting, key=lambda item: item[1][speed], default=None)


def report(results: dict[str, dict[str, Any]], out_dir: Path, quick: bool) -> str:
    """Per model and budget: the grid's best point, AutoFit's pick, Lightning's finder; then the grids."""
    models = [m for m in MODELS if any(label.startswith(f"{m}/") for label in results)]
    budgets = _budget_names(quick)
    lines = ["## AutoFit against the exhaustive grid", ""]
    if quick:
        lines += ["`--quick`: tiny models, the loose budget only, and two grid points per model: the ratios below mean nothing.", ""]
    lines += [
        f"Budgets are multiples of the default configuration's measured peak ({', '.join(f'{n} {BUDGETS[n]}x' for n in budgets)}); "
        "memory is the peak RSS above the fit's start, measured over the whole training (warm-up steps included). "
        f"Goals: AutoFit's tokens/s >= {SPEED_GOAL:.2f}x the best grid point's; measured peak <= budget; predicted peak "
        f"within +-{PREDICTION_GOAL:.0%} of measured; planning <= {PLANNING_STEPS_GOAL:g} training steps. "
        "`pick's grid ratio`: the grid's own tokens/s at AutoFit's pick (when it is a grid point: one policy for every "
        "block) over the best's — the pick's quality without the noise between processes. `same-run ratio`: the median "
        f"tokens/s of AutoFit's {RUNS} runs over the median of the best grid point's fits made again, each right after "
        "or, every other run, right before one of them (fresh processes, interleaved): the grid's best is the fastest of 40 noisy readings, which "
        "flatters it; the speed goal is judged on this ratio where it was measured. `planning peak`: the peak "
        "while AutoFit planned (before the first step; outside its measured window; every reading counted, though each "
        "resets the process's peak RSS). Predictions and planning are of "
        "the first run.",
        "",
        "| model | budget | budget MiB | best grid point | its tokens/s | its peak MiB | AutoFit pick | AutoFit tokens/s "
        "| ratio | pick's grid ratio | AutoFit runs (picks; tokens/s) | best again tokens/s | same-run ratio "
        "| predicted MiB | measured MiB | prediction error | peak <= budget "
        "| planning peak MiB | planning s | planning steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    goals: dict[str, list[bool]] = {"speed": [], "fits": [], "prediction": [], "planning": []}
    for model in models:
        points = _grid_of(results, model)
        for name in budgets:
            run = _runs(results, model, "autofit").get(name, {})
            budget = run.get("budget_bytes")
            best = best_within(points, budget) if budget else None
            best_cells = [f"`{best[0]}`", f"{best[1]['tokens_per_s']:,.0f}", _mib(best[1]["peak_bytes"])] if best else \
                ["no grid" if not points else "none fits" if budget else "-", "-", "-"]
            if "tokens_per_s" not in run:
                why = run.get("infeasible") or run.get("error") or "not run"
                lines.append(f"| {model} | {name} | {_mib(budget)} | " + " | ".join(best_cells)
                             + f" | {why[:160]} |" + " |" * 13)
                continue
            pick = (f"mb{run['micro_batch']}x{run['accumulation']} {run['optimizer']} {run['policies']}")
            if run.get("replanned_policies"):  # planned again after the measured steps: what the fit went on with
                pick += f" (then {run['replanned_policies']})"
            ratio = run["tokens_per_s"] / best[1]["tokens_per_s"] if best else None
            at_pick = points.get(run.get("grid_point") or "")
            pick_ratio = at_pick["tokens_per_s"] / best[1]["tokens_per_s"] if best and at_pick else None
            measured = run.get("measured_peak_bytes")
            error = (run["predicted_peak_bytes"] - measured) / measured if measured else None
            fits = measured is not None and measured <= budget
            steps = run["planning_steps"]
            runs_tokens, again = run.get("runs_tokens_per_s") or [], run.get("best_again_tokens_per_s") or []
            same_run = statistics.median(runs_tokens) / statistics.median(again) if runs_tokens and again else None
            judged = same_run if same_run is not None else ratio
            if judged is not None:
                goals["speed"].append(judged >= SPEED_GOAL)
            if error is not None:
                goals["prediction"].append(abs(error) <= PREDICTION_GOAL)
            goals["fits"].append(fits)
            goals["planning"].append(steps <= PLANNING_STEPS_GOAL)
            lines.append(
                f"| {model} | {name} | {_mib(budget)} | " + " | ".join(best_cells) + f" | {pick} | {run['tokens_per_s']:,.0f} "
                f"| {'-' if ratio is None else f'{ratio:.3f}'} | {'-' if pick_ratio is None else f'{pick_ratio:.3f}'} "
                f"| {'; '.join(run.get('picks') or [])}; {', '.join(f'{t:,.0f}' for t in runs_tokens)} "
                f"| {', '.join(f'{t:,.0f}' for t in again) or '-'} | {'-' if same_run is None else f'{same_run:.3f}'} "
                f"| {_mib(run['predicted_peak_bytes'])} | {_mib(measured)} | {'-' if error is None else f'{error:+.1%}'} "
                f"| {'yes' if fits else 'NO'} | {_mib(run['planning_peak_bytes'])}"
                f"{'' if run['planning_peak_bytes'] <= budget else ' (over)'} | {run['planning_s']:.2f} | {steps:.1f} |"
            )
    lines += ["", "Goals met: " + "; ".join(f"{name} {sum(v)}/{len(v)}" for name, v in goals.items()), ""]
    lines += _default_allocator_section(results, models, budgets)
    lines += [
        "## Lightning's batch-size finder at the same budgets",
        "",
        "`Tuner.scale_batch_size` (mode `power`, its defaults) in a child process whose address space is limited to "
        "its size at the fit's start plus the budget — the nearest to an out-of-memory at the budget a CPU has, but not "
        "the RSS budget: it counts address space reserved and never touched, and misses pages mapped before the limit "
        "and touched after it (library code, the memory-mapped corpus, heap reserved earlier) —; then a fit at its pick "
        "in a fresh process, measured like the grid (`peak <= budget` is of that RSS peak). It searches the batch alone "
        "and does not accumulate: its pick is the global batch.",
        "",
        "| model | budget | budget MiB | finder's batch (= global batch) | tokens/s | peak MiB | peak <= budget | finder s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        for name in budgets:
            run = _runs(results, model, "tuner").get(name, {})
            if "tokens_per_s" not in run:
                why = run.get("tuner_error") or run.get("error") or "not run"
                lines.append(f"| {model} | {name} | {_mib(run.get('budget_bytes'))} | {why[:200]} | | | | |")
                continue
            lines.append(f"| {model} | {name} | {_mib(run['budget_bytes'])} | {run['batch_size']} | {run['tokens_per_s']:,.0f} "
                         f"| {_mib(run['peak_bytes'])} | {'yes' if run['fits_budget'] else 'NO'} | {run['tuner_s']:.1f} |")
    for model in models:
        points = _grid_of(results, model)
        if not points:
            continue
        if any(DEFAULT_ALLOCATOR in r for r in points.values()):
            lines += ["", f"## The grid: {model}, tokens/s under glibc's default allocator", "",
                      "| micro-batch x accumulation | optimizer | " + " | ".join(POLICIES) + " |",
                      "|---|---|" + "---|" * len(POLICIES)]
            for micro, optimizer in dict.fromkeys((m, o) for m, o, _ in grid_points(quick, model)):
                cells = [f"{r[DEFAULT_ALLOCATOR]:,.0f}" if (r := points.get(point_name(micro, optimizer, policy))) and DEFAULT_ALLOCATOR in r
                         else "-" for policy in POLICIES]
                lines.append(f"| {micro} x {_global_batch(quick) // micro} | {optimizer} | " + " | ".join(cells) + " |")
        lines += ["", f"## The grid: {model} (tokens/s, peak MiB)", "",
                  "| micro-batch x accumulation | optimizer | " + " | ".join(POLICIES) + " |",
                  "|---|---|" + "---|" * len(POLICIES)]
        rows = dict.fromkeys((m, o) for m, o, _ in grid_points(quick, model))
        for micro, optimizer in rows:
            cells = []
            for policy in POLICIES:
                r = points.get(point_name(micro, optimizer, policy))
                cells.append("-" if r is None else f"{r['tokens_per_s']:,.0f}, {_mib(r['peak_bytes'])}")
            lines.append(f"| {micro} x {_global_batch(quick) // micro} | {optimizer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _default_allocator_section(results: dict[str, dict[str, Any]], models: list[str], budgets: tuple[str, ...]) -> list[str]:
    """The speed goal under glibc's default allocator: AutoFit's plans fitted by hand against the best grid point
    within each budget by the grid's timings under it (peaks as above)."""
    lines = [
        "## Speed as users train: glibc's default allocator",
        "",
        "Every fit above runs with `MALLOC_MMAP_THRESHOLD_=131072`, so that RSS counts what is held; each allocation "
        "over 128 KiB is then a fresh mapping, faulted in page by page, which slows fits 1.2-2x and changes their order "
        "(micro-batch 1 reads fastest under it, slowest under the default). Here every grid point was timed again in a "
        "fresh process under glibc's default allocator (its peak is still the one above), and after each AutoFit run "
        "its plan was fitted by hand under the default, followed by the best grid point within the budget by these "
        "timings (interleaved). AutoFit itself planned under the setting.",
        "",
        "| model | budget | best grid point (default allocator) | its tokens/s in the grid | its peak MiB "
        "| AutoFit's plans by hand, tokens/s | best again tokens/s | same-run ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    met: list[bool] = []
    for model in models:
        points = _grid_of(results, model)
        for name in budgets:
            run = _runs(results, model, "autofit").get(name, {})
            best = run.get("best_point_default_allocator")
            plans, again = run.get("plan_default_allocator_tokens_per_s") or [], run.get("best_again_default_allocator_tokens_per_s") or []
            if not best or not plans or not again:
                lines.append(f"| {model} | {name} | not measured | | | | | |")
                continue
            ratio = statistics.median(plans) / statistics.median(again)
            met.append(ratio >= SPEED_GOAL)
            point = points.get(best, {})
            lines.append(f"| {model} | {name} | `{best}` | {point.get(DEFAULT_ALLOCATOR, 0):,.0f} | {_mib(point.get('peak_bytes'))} "
                         f"| {', '.join(f'{t:,.0f}' for t in plans)} | {', '.join(f'{t:,.0f}' for t in again)} | {ratio:.3f} |")
    return [*lines, "", f"Speed goal under the default allocator: {sum(met)}/{len(met)}", ""]


def chart(case: Case, results: dict[str, dict[str, Any]], path: Path) -> None:
    """Per model: every grid point (peak against tokens/s), the budgets, AutoFit's and the finder's fits."""
    models = [m for m in MODELS if any(label.startswith(f"{m}/") for label in results)] or ["demo"]
    plt, fig, axes = panels(len(models), width=6.0, height=4.5)
    markers = {"32bit": "o", "8bit": "s"}
    colours = dict(zip(POLICIES, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    for ax, model in zip(axes, models):
        for name, r in _grid_of(results, model).items():
            _, optimizer, policy = name.split("-")
            ax.scatter(r["peak_bytes"] / 2**20, r["tokens_per_s"], marker=markers[optimizer], color=colours[policy],
                       alpha=0.6, s=20)
        for policy, colour in colours.items():
            ax.scatter([], [], color=colour, label=policy, s=20)
        for kind, marker, colour in (("autofit", "*", "black"), ("tuner", "^", "red")):
            for name, r in _runs(results, model, kind).items():
                if "tokens_per_s" in r:
                    ax.scatter(r["peak_bytes"] / 2**20, r["tokens_per_s"], marker=marker, color=colour, s=90)
                    ax.annotate(f"{kind} {name}", (r["peak_bytes"] / 2**20, r["tokens_per_s"]), fontsize=7)
                if r.get("budget_bytes") and kind == "autofit":
                    ax.axvline(r["budget_bytes"] / 2**20, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("peak RSS above the fit's start (MiB)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"autofit: {model} (o 32-bit, s 8-bit; dashed: budgets)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _variants() -> dict[str, Any]:
    variants: dict[str, Any] = {}
    for model in MODELS:
        variants[f"{model}/grid"] = functools.partial(grid, model)
        variants[f"{model}/autofit"] = functools.partial(autofit, model)
        variants[f"{model}/tuner"] = functools.partial(tuner, model)
    return variants


CASE = register(
    Case(
        name="autofit",
        description=(
            "AutoFit against the exhaustive grid over the same space (micro-batch dividing the global batch of 16 "
            "with accumulation, 32-bit or 8-bit optimizer states, one block policy of keep / checkpoint / selective / "
            "disk for every block: 40 points, each its own process) and against Lightning's Tuner.scale_batch_size, at "
            "budgets of 1.5x, 0.6x and 0.35x the default configuration's peak RSS, for the demo GPT (vocab 4096, 4 "
            "layers, d_model 128, seq 128, full logits) and a transformers Llama (hidden 128, 4 layers, vocab 4096, "
            "fused loss), on the standard library corpus (200 files). Duration of the full run, measured on 2 cores: "
            "32 to 75 minutes (232 fresh processes: 104 grid fits, half of them timed again under glibc's default "
            "allocator, 18 AutoFit runs each with its plan by hand and the best point again, 6 finder searches); "
            "--quick: 23 processes, about 3-4 minutes."
        ),
        baseline="demo/grid",
        variants=_variants(),
        timeout_s=1800.0,
        extra_report=report,
        chart=chart,
    )
)
