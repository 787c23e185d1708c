"""The conformance matrix: each plugin (and all together) against the same fit in plain Lightning.

One test per cell (see ``harness.cases()`` and MATRIX.md). Checked against the plain reference
(``Case.reference``): the lr and momentum/betas trajectory of the optimizer the trainer steps is
identical; every step trains the same samples and every epoch each sample exactly once; losses and
final parameters agree (exactly for exact plugins on the reference's own strategy, within a float
tolerance per precision where the batch is split differently, within the 8-bit tolerance below for
EightBitOptimizer); a fit that raised left nothing behind and the second fit trains normally; a
resumed fit continues the uninterrupted one. The streaming cells (SelectiveTokenLoss's streaming
threshold on the fused head) check besides: every step streams, keeps the scheduled fraction within a
tolerance and logs it, and a resumed fit streams as the uninterrupted one (``streaming_problems``).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_efficient.tokens.selection import KeepRatioSchedule
from tests.conformance import harness
from tests.conformance.harness import Case
from tests.ddp import run_script

CASES = harness.cases()
SINGLE = [c for c in CASES if not c.multi_process]
MULTI = [c for c in CASES if c.multi_process]

# Relative tolerance on a step's token-mean loss, and absolute on the final parameters (which are O(1)),
# when the plugin run and its reference split the step's samples differently (ranks, micro-batches, one
# batch): only the order of float sums differs, amplified by the precision's rounding.
# Under 32-true the largest parameter difference is checked; under 16-bit precisions the mean one (Adam
# turns rounding noise in a near-zero gradient into a full-size step of either sign on single elements).
SPLIT_LOSS_RTOL = {"32-true": 1e-5, "16-mixed": 2e-3, "bf16-mixed": 3e-2, "bf16-true": 5e-2}
SPLIT_PARAM_ATOL = {"32-true": 1e-4, "16-mixed": 2e-3, "bf16-mixed": 5e-3, "bf16-true": 5e-3}
# EightBitOptimizer is not exact: its moments are quantized blockwise. Over 18 steps of this model the
# loss stays within 2% (relative) of 32-bit AdamW's, and the parameters within 0.01 of its on average
# (a single parameter whose gradient is mostly noise can move up to ~0.1 apart under 16-bit precisions).
EIGHT_BIT_LOSS_RTOL, EIGHT_BIT_PARAM_MEAN_ATOL = 2e-2, 1e-2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run ~20x faster on one intra-op thread on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with harness.quiet():
        yield
    torch.set_num_threads(threads)


_TRACES: dict[Case, dict[str, Any]] = {}


def single_trace(case: Case, root: Path) -> dict[str, Any]:
    """The trace of a one-process case (cached: references are shared between cells)."""
    if case not in _TRACES:
        try:
            _TRACES[case] = harness.fit(case, root / case.name)
        except Exception as exc:  # noqa: BLE001 (a refusal or a crash is reported against the cell)
            _TRACES[case] = {"case": asdict(case), "error": f"{type(exc).__name__}: {exc}"}
    return _TRACES[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conformance")


MULTI_WANTED = list(dict.fromkeys([*MULTI, *(c.reference() for c in MULTI if c.reference().multi_process)]))


@pytest.fixture(scope="module", autouse=True)
def _multi_launch(root):
    """Every multi-process case (and multi-process reference) in one launch of two gloo processes,
    started in a thread at the first test so that it runs while the one-device cells do."""
    out = root / "multi"
    out.mkdir()
    (out / "cases.json").write_text(json.dumps([asdict(c) for c in MULTI_WANTED]))
    outcome: dict[str, BaseException] = {}

    def launch() -> None:
        try:
            run_script(Path(__file__).parent / "multi_run.py", out, out / "cases.json", timeout=900)
        except BaseException as exc:  # noqa: BLE001 (re-raised by multi_traces in the main thread)
            outcome["error"] = exc

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    yield thread, out, outcome
    thread.join()


@pytest.fixture(scope="module")
def multi_traces(_multi_launch) -> dict[str, dict[str, Any]]:
    """The merged traces of the multi-process launch, by case name."""
    thread, out, outcome = _multi_launch
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    wanted = MULTI_WANTED
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    parent = torch.load(out / "parent.pt", weights_only=False)
    merged: dict[str, dict[str, Any]] = {}
    for case in wanted:
        per_rank = [r[case.name] for r in ranks]
        if any("error" in t for t in per_rank):
            merged[case.name] = next(t for t in per_rank if "error" in t)
            continue
        trace = {"case": per_rank[0]["case"]}
        for part in ("raised", "main", "resumed"):
            if part in per_rank[0]:
                trace[part] = harness.merge_ranks([t[part] for t in per_rank])
        if case.strategy == "resize" and case.resume != "none":
            trace["resumed"] = parent["resumed"].get(case.name, {"error": "no checkpoint was written"})
        merged[case.name] = trace
    return merged


# -- the checks --------------------------------------------------------------------------------------
def _exact(case: Case) -> bool:
    """Same strategy and batch split as the reference, and a plugin that must not change a number."""
    ref = case.reference()
    return case.plugin in ("activations", "report") and ref.strategy == case.strategy and not ref.single_batch


def _tolerances(case: Case) -> tuple[float, float] | None:
    """(loss rtol, parameter atol), or None where only schedule and samples are compared."""
    if case.plugin in ("tokens_select", harness.STREAMING):
        return None
    if case.eight_bit:
        return EIGHT_BIT_LOSS_RTOL, EIGHT_BIT_PARAM_MEAN_ATOL
    if _exact(case) and case.strategy != "resize":
        return 0.0, 0.0
    return SPLIT_LOSS_RTOL[case.precision], SPLIT_PARAM_ATOL[case.precision]


def _schedule(fit: dict[str, Any], from_step: int = 0) -> list[tuple]:
    return [(s["step"], s["lr"], s["betas"], s["momentum"]) for s in fit["steps"] if s["step"] >= from_step]


def compare_fit(case: Case, fit: dict[str, Any], ref: dict[str, Any], what: str, from_step: int = 0) -> list[str]:
    """Differences between a plugin fit and the reference fit from ``from_step`` on (empty: conforms)."""
    problems: list[str] = []
    if fit.get("error") and not ref.get("error"):
        return [f"{what}: {fit['error']}"]
    mine, theirs = _schedule(fit, from_step), _schedule(ref, from_step)
    if mine != theirs:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        problems.append(f"{what}: lr/betas trajectory differs from step {first + from_step}: "
                        f"{mine[first:first + 2]} vs plain {theirs[first:first + 2]} ({len(mine)} vs {len(theirs)} steps)")
    samples, ref_samples = harness.step_samples(fit), harness.step_samples(ref)
    samples = {s: v for s, v in samples.items() if s >= from_step}
    ref_samples = {s: v for s, v in ref_samples.items() if s >= from_step}
    if samples != ref_samples:
        diff = sorted(set(samples) ^ set(ref_samples)) or [s for s in samples if samples[s] != ref_samples.get(s)]
        problems.append(f"{what}: steps train different samples from plain at steps {diff[:6]} "
                        f"({len(samples)} steps vs {len(ref_samples)})")
    tolerance = _tolerances(case)
    if tolerance is not None:
        rtol, atol = tolerance
        losses, ref_losses = harness.step_losses(fit), harness.step_losses(ref)
        bad = [(s, round(losses[s], 6), round(ref_losses[s], 6)) for s in losses
               if s >= from_step and s in ref_losses and not math.isclose(losses[s], ref_losses[s], rel_tol=rtol, abs_tol=0)]
        if bad:
            problems.append(f"{what}: step losses differ beyond rtol {rtol} at (step, plugin, plain) {bad[:3]}")
        diffs = torch.cat([(fit["params"][k] - ref["params"][k]).abs().flatten() for k in ref["params"]])
        mean = case.eight_bit or (atol > 0 and case.precision != "32-true")
        worst = float(diffs.mean() if mean else diffs.max())
        if worst > atol:
            problems.append(f"{what}: final parameters differ by {worst:.3g} ({'mean' if mean else 'max'}) > {atol}")
    return problems


def _each_epoch_once(micro: list[dict[str, Any]], what: str) -> list[str]:
    problems = []
    for epoch, ids in harness.epoch_samples(micro).items():
        if ids != list(range(harness.N_SAMPLES)):
            missing = sorted(set(range(harness.N_SAMPLES)) - set(ids))
            twice = sorted({i for i in ids if ids.count(i) > 1})
            problems.append(f"{what}: epoch {epoch} trained {len(ids)} samples (missing {missing[:8]}, twice {twice[:8]})")
    if len(harness.epoch_samples(micro)) != harness.EPOCHS:
        problems.append(f"{what}: trained epochs {sorted(harness.epoch_samples(micro))}, expected {harness.EPOCHS}")
    return problems


def _nothing_left(raised: dict[str, Any]) -> list[str]:
    before, after = raised["before"], raised["after"]
    problems = []
    if raised.get("error") is None:
        problems.append("the first fit did not raise")
    for key, label in (("wrapped", "instance wrappers"), ("temp", "temporary files/dirs")):
        left = sorted(set(after[key]) - set(before[key]))
        if left:
            problems.append(f"after the raised fit, {label} left behind: {left[:6]}")
    threads = sorted(set(after["threads"]) - set(before["threads"]))
    if threads:
        problems.append(f"after the raised fit, threads left running: {threads[:6]}")
    if after["overrides"] > before["overrides"]:
        problems.append(f"after the raised fit, {after['overrides']} bitsandbytes overrides left in pid2config")
    return problems


def unfreeze_problems(case: Case, trace: dict[str, Any]) -> list[str]:
    """The unfreeze cells' own check: the plugin planned for both sets of trainable parameters (frozen, then unfrozen
    at epoch 1), and a fit resumed before the unfreeze planned for the unfrozen set too (ActivationMemory keeps the
    plans it profiled, not the checkpoint's it restored; AutoFit both)."""
    expected = {"main": 2}
    if case.resume == "epoch" and "resumed" in trace:
        expected["resumed"] = 2 if case.plugin == harness.AUTOFIT else 1
    return [f"the {'resumed ' if part == 'resumed' else ''}fit planned for {trace[part].get('trainable_sets_planned')} sets "
            f"of trainable parameters, not {count}" for part, count in expected.items()
            if trace[part].get("trainable_sets_planned") != count]


def check(case: Case, trace: dict[str, Any], ref: dict[str, Any]) -> None:
    if case.name in harness.REFUSED:
        assert "error" in trace, f"{case.name} should be refused before the first step"
        assert harness.REFUSED[case.name] in trace["error"]
        return
    assert "error" not in trace, f"{case.name} failed:\n{trace['error']}"
    assert "error" not in ref, f"the plain reference {case.reference().name} failed:\n{ref['error']}"
    problems: list[str] = []
    if case.raises:
        problems += _nothing_left(trace["raised"])
        problems += compare_fit(case, trace["raised"], ref["raised"], "raised fit")
    problems += compare_fit(case, trace["main"], ref["main"], "fit")
    problems += _each_epoch_once(trace["main"]["micro"], "fit")
    if case.resume != "none":
        resumed = trace.get("resumed", {"error": "no resumed fit"})
        start = harness.resume_step(case)
        # against plain Lightning resumed the same way (plain Lightning itself does not resume a
        # ReduceLROnPlateau exactly: see test_plain_lightning_resumes_exactly_with_the_harness_loader)
        ref_resumed = ref.get("resumed", {"error": "the plain reference has no resumed fit"})
        problems += compare_fit(case, resumed, ref_resumed, f"resumed at step {start}", from_step=start)
        if not resumed.get("error"):
            stitched = [m for m in trace["main"]["micro"] if m["step"] < start] + resumed["micro"]
            problems += _each_epoch_once(stitched, f"resumed at step {start}")
    if case.plugin == harness.STREAMING:
        problems += streaming_problems(case, trace, ref)
    if case.loop == harness.UNFREEZE:
        problems += unfreeze_problems(case, trace)
    assert not problems, f"{case.name}:\n  " + "\n  ".join(problems)


# -- what the streaming cells check besides schedule and samples ---------------------------------------
# A step's realised keep ratio (kept / valid tokens of all its micro-batches and ranks) where the schedule
# selects, against the schedule's ratio. A step holds about 26 valid tokens (78 with accumulation): one token
# is 0.04 of it, the sampling noise alone (sqrt(r (1 - r) / n) at r = 0.7) 0.09, and the estimate from the
# previous steps lags a shift of the losses (at the first step of epoch 1 the model meets samples it has
# trained on: their losses fall below the estimate, and that step keeps 0.26-0.37). So a step is only held
# to a gross bound (nothing kept, a threshold far off), and the full fit's mean over its selecting steps
# (realised - scheduled) to STREAM_MEAN_TOLERANCE: measured -0.01 over the 16 selecting steps of the
# one-device and ddp cells, -0.08 and -0.07 over the 4 of the accumulating cells (the lag behind falling
# losses, not yet corrected); an estimate read at the wrong level (1 - r) would be 0.4 off.
STREAM_STEP_TOLERANCE, STREAM_MEAN_TOLERANCE = 0.5, 0.12


def _finite(value: float) -> float | str:
    """A logged number made comparable (nan, the threshold of a keep-all step, equals nan)."""
    return "nan" if math.isnan(value) else value


def _selection(m: dict[str, Any]) -> list[tuple]:
    """One micro-batch's selection on every rank: kept positions, logged threshold and correction."""
    return [(r["kept_positions"], _finite(r["logged"].get("threshold", math.nan)),
             _finite(r["logged"].get("threshold_correction", math.nan))) for r in m["selection"]]


def _selection_problems(case: Case, fit: dict[str, Any], what: str, mean: bool) -> list[str]:
    """Every micro-batch streamed and logged its kept fraction; each step kept the schedule's ratio (exactly
    every valid token at 1.0, within STREAM_STEP_TOLERANCE below it) and, with ``mean``, the mean over the
    selecting steps within STREAM_MEAN_TOLERANCE; under scope "global" every rank used one threshold."""
    schedule = KeepRatioSchedule(harness.STREAMING_KEEP, 1.0, harness.STREAMING_WARMUP, harness.STREAMING_RAMP)
    logged_rtol = 1e-2 if case.precision == "bf16-true" else 1e-6  # bf16-true logs its floats in bfloat16
    problems: list[str] = []
    steps: dict[int, list[int]] = {}
    for m in fit["micro"]:
        records = m.get("selection", [])
        if not records:
            problems.append(f"{what}: step {m['step']}: no selection recorded")
            continue
        for rank, r in enumerate(records):
            if r["logged"].get("streamed") != 1.0:
                problems.append(f"{what}: step {m['step']} rank {rank}: did not stream (selection/streamed "
                                f"{r['logged'].get('streamed')})")
            fraction = r["logged"].get("kept_fraction")
            if fraction is None or not math.isclose(fraction, r["kept"] / max(r["valid"], 1), rel_tol=logged_rtol, abs_tol=0):
                problems.append(f"{what}: step {m['step']} rank {rank}: logged kept_fraction {fraction}, but it kept "
                                f"{r['kept']} of {r['valid']} valid tokens")
        if case.scope == "global" and len({t for _, t, _ in _selection(m)}) > 1:
            problems.append(f"{what}: step {m['step']}: the ranks used different thresholds {[t for _, t, _ in _selection(m)]}")
        entry = steps.setdefault(m["step"], [0, 0])
        entry[0] += sum(r["kept"] for r in records)
        entry[1] += sum(r["valid"] for r in records)
    errors = []  # realised - scheduled, per selecting step
    for step, (kept, valid) in sorted(steps.items()):
        ratio, realised = schedule(step), kept / max(valid, 1)
        if ratio == 1.0 and kept != valid:
            problems.append(f"{what}: step {step} (keep ratio 1.0) kept {kept} of {valid} valid tokens")
        elif ratio < 1.0:
            errors.append(realised - ratio)
            if abs(realised - ratio) > STREAM_STEP_TOLERANCE:
                problems.append(f"{what}: step {step} kept {realised:.3f} of its tokens at keep ratio {ratio} "
                                f"(tolerance {STREAM_STEP_TOLERANCE})")
    if mean and (not errors or abs(sum(errors) / len(errors)) > STREAM_MEAN_TOLERANCE):
        problems.append(f"{what}: the realised keep ratio is off the schedule's by {sum(errors) / max(len(errors), 1):+.3f} "
                        f"on average over {len(errors)} selecting steps (tolerance {STREAM_MEAN_TOLERANCE})")
    return problems


def streaming_problems(case: Case, trace: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """The streaming cells' own checks (empty: conforms).

    - Every fit (the raised one, the full one, the resumed one): :func:`_selection_problems` (the mean
      keep ratio on the full fit, the one with every step).
    - The steps trained on full-loss updates only (up to the first that selects) have the plain
      reference's losses, within the split tolerance: the streamed keep-all gradient is the step's token mean.
    - Resumed: its first step streams at the threshold and correction of the uninterrupted fit's same
      step (the running estimate is in the checkpoint; without it that step takes the exact path, and
      with another estimate another threshold). Where the batch split is deterministic (not hetero_ddp,
      whose shares follow measured speeds) every later micro-batch keeps the same tokens at the same
      threshold, with the same losses and final parameters, bit for bit.
    """
    problems: list[str] = []
    main = trace["main"]
    parts = [("fit", main)] + ([("raised fit", trace["raised"])] if case.raises else [])
    resumed = trace.get("resumed") if case.resume != "none" else None
    if resumed is not None and not resumed.get("error"):
        parts.append(("resumed fit", resumed))
    for what, fit in parts:
        problems += _selection_problems(case, fit, what, mean=fit is main)
    schedule = KeepRatioSchedule(harness.STREAMING_KEEP, 1.0, harness.STREAMING_WARMUP, harness.STREAMING_RAMP)
    first = next(s for s in range(100) if schedule(s) < 1.0)
    losses, ref_losses = harness.step_losses(main), harness.step_losses(ref["main"])
    rtol = SPLIT_LOSS_RTOL[case.precision]
    bad = [(s, losses.get(s), ref_losses.get(s)) for s in range(first + 1)
           if s not in losses or s not in ref_losses or not math.isclose(losses[s], ref_losses[s], rel_tol=rtol, abs_tol=0)]
    if bad:
        problems.append(f"fit: the losses of the steps after full-loss steps only differ from plain's beyond rtol {rtol} "
                        f"at (step, streamed, plain) {bad[:3]}")
    if resumed is None or resumed.get("error"):
        return problems
    start = harness.resume_step(case)
    mine = [m for m in resumed["micro"] if m["step"] >= start]
    theirs = [m for m in main["micro"] if m["step"] >= start]
    first_mine = [_selection(m) for m in mine if m["step"] == start]
    first_theirs = [_selection(m) for m in theirs if m["step"] == start]
    thresholds = [[t[1:] for t in sel] for sel in first_mine]
    if not first_mine or thresholds != [[t[1:] for t in sel] for sel in first_theirs]:
        problems.append(f"resumed fit: step {start} streamed at (threshold, correction) {thresholds[:1]}, the "
                        f"uninterrupted fit at {[[t[1:] for t in sel] for sel in first_theirs][:1]}")
    if case.hetero:
        return problems
    differ = [m["step"] for m, n in zip(mine, theirs) if _selection(m) != _selection(n)]
    if differ or len(mine) != len(theirs):
        problems.append(f"resumed fit: kept other tokens or thresholds than the uninterrupted fit at steps {differ[:4]} "
                        f"({len(mine)} vs {len(theirs)} micro-batches)")
    losses, straight = harness.step_losses(resumed), harness.step_losses(main)
    bad = [(s, losses[s], straight.get(s)) for s in losses if s >= start and losses[s] != straight.get(s)]
    if bad:
        problems.append(f"resumed fit: step losses differ from the uninterrupted fit's at (step, resumed, straight) {bad[:3]}")
    worst = max(float((resumed["params"][k] - main["params"][k]).abs().max()) for k in main["params"])
    if worst > 0:
        problems.append(f"resumed fit: final parameters differ from the uninterrupted fit's by {worst:.3g} (max)")
    return problems


# -- the cells ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c.name)
def test_one_device_cell(case: Case, root: Path) -> None:
    check(case, single_trace(case, root), single_trace(case.reference(), root))


@pytest.mark.parametrize("case", MULTI, ids=lambda c: c.name)
def test_multi_process_cell(case: Case, root: Path, multi_traces) -> None:
    ref_case = case.reference()
    ref = multi_traces[ref_case.name] if ref_case.multi_process else single_trace(ref_case, root)
    check(case, multi_traces[case.name], ref)


# -- the harness itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("resume", ["epoch", "mid"])
def test_plain_lightning_resumes_exactly_with_the_harness_loader(resume: str, root: Path) -> None:
    """Plain Lightning with the harness's loader (lightning_efficient.resumable) resumes exactly, with
    a step-wise scheduler. (With ReduceLROnPlateau it does not: Lightning skips the plateau step of
    the epoch it resumes in, so resumed cells are compared with plain Lightning resumed the same way.)"""
    case = Case("plain", resume=resume)
    trace = single_trace(case, root)
    assert "error" not in trace, trace.get("error")
    start = harness.resume_step(case)
    problems = compare_fit(Case("activations"), trace["resumed"], trace["main"], "plain resumed", from_step=start)
    assert not problems, problems


def test_the_cases_cover_every_value_of_every_axis_with_every_plugin() -> None:
    axes = {"precision": harness.PRECISIONS, "resume": harness.RESUMES, "scheduler": harness.SCHEDULERS,
            "loop": harness.LOOPS, "raises": harness.RAISES, "strategy": harness.STRATEGIES}
    for plugin in harness.PLUGINS:
        mine = [c for c in CASES if c.plugin == plugin]
        for axis, values in axes.items():
            allowed = [v for v in values if axis != "strategy" or harness._allowed(plugin, v)]
            assert {getattr(c, axis) for c in mine} >= set(allowed), (plugin, axis)
    assert {c.activation_policy for c in CASES if c.plugin == "activations"} == set(harness.ACTIVATION_POLICIES)
    assert harness.cases() == CASES  # deterministic


def test_the_hand_picked_cells_come_after_the_others_and_cover_what_they_must_meet() -> None:
    unfreeze = [c for c in CASES if c.loop == harness.UNFREEZE]
    assert unfreeze == list(harness.UNFREEZE_CASES) == CASES[-len(unfreeze):]  # every other cell as it was
    cases = CASES[:-len(unfreeze)]
    streaming = [c for c in cases if c.plugin == harness.STREAMING]
    autofit = [c for c in cases if c.plugin == harness.AUTOFIT]
    assert autofit == list(harness.AUTOFIT_CASES) == cases[-len(autofit):]
    assert streaming == list(harness.STREAMING_CASES) == cases[-len(streaming) - len(autofit):-len(autofit)]
    assert {c.plugin for c in unfreeze} == {harness.AUTOFIT, "activations"} and {c.resume for c in unfreeze} == {"mid", "epoch"}
    assert {c.precision for c in streaming if c.strategy == "single"} >= {"32-true", "bf16-mixed"}
    assert {c.strategy for c in streaming} >= {"single", "ddp", "hetero_ddp"}
    assert any(c.loop == "accumulate" for c in streaming) and any(c.resume == "mid" for c in streaming)
