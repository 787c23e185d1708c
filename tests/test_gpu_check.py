"""benchmarks/gpu_check.py: its ``--smoke`` run on the CPU, its exit code, and its comparisons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import GRAD_TOLERANCE, RESULTS_THAT_FAIL, TABLE_CHECKS, Bench


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=dict(os.environ, **(env or {})))


def _rows(stdout: str) -> list[list[str]]:
    """The table's rows as lists of cells (the header and the rule left out)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ")]
    return rows[1:]


def test_without_a_gpu_it_says_so_and_exits_zero():
    done = _run(env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no CUDA device" in done.stdout
    assert not _rows(done.stdout)


def test_smoke_runs_every_check_on_cpu_and_every_numerical_check_passes(tmp_path):
    done = _run("--smoke", "--out", str(tmp_path / "table.md"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert _rows((tmp_path / "table.md").read_text()) == _rows(done.stdout)  # the same table, in a file
    rows = _rows(done.stdout)
    assert all(len(row) == 6 for row in rows), rows[:3]
    checks = {row[0] for row in rows}
    assert set(TABLE_CHECKS) <= checks, set(TABLE_CHECKS) - checks
    results = {(row[0], row[1]): row[5] for row in rows if row[5].startswith(("pass", "FAIL", "error"))}
    # every numerical check runs on the CPU (CUDA-only variants in their fallback) and passes
    expected = {("grads", v) for v in ("keep_rerun", "checkpoint", "selective", "offload", "disk", "memory_report")}
    expected |= {("optim_exact", v) for v in ("8bit_rerun", "8bit_paged", "8bit_offload")}
    expected |= {("optim_twins", v) for v in ("8bit_rerun", "8bit_paged", "8bit_offload")}
    expected |= {("resume", v) for v in ("8bit", "8bit_paged", "8bit_offload")}
    expected |= {("memory_report", "with_report")}
    assert expected <= set(results), expected - set(results)
    assert all(result.startswith("pass") for result in results.values()), results
    assert not [row for row in rows if row[5].startswith(("error", "FAIL"))]
    # FSDP2 on one device (ModelParallelStrategy, fully_shard per block and the root): every variant
    # measured beside plain FSDP2, and every numerical check of it passes (the exact ones bitwise)
    fsdp2 = {(row[1], row[2]): row for row in rows if row[0] == "fsdp2"}
    for variant in ("plain", "checkpoint", "offload", "8bit", "hetero_fsdp", "memory_report"):
        time_row = fsdp2.get((variant, "step_time_s"))
        assert time_row and time_row[3] != "-" and time_row[4] != "-", (variant, time_row)
    assert fsdp2[("8bit", "optimizer_state_bytes")][3] != "-"
    exact = {("plain_rerun", "grad_max_abs_diff"), ("offload", "grad_max_abs_diff"), ("offload", "params_max_abs_diff"),
             ("hetero_fsdp", "grad_max_abs_diff"), ("hetero_fsdp", "params_max_abs_diff"),
             ("8bit", "params_vs_one_device_8bit_max_abs_diff")}
    tolerant = {("plain_vs_one_device", "grad_max_abs_diff"), ("checkpoint", "grad_max_abs_diff")}
    for key in exact:
        assert key in fsdp2 and fsdp2[key][5].startswith("pass (bitwise)"), (key, fsdp2.get(key))
    for key in tolerant:
        assert key in fsdp2 and fsdp2[key][5].startswith("pass"), (key, fsdp2.get(key))
    assert fsdp2[("memory_report", "report_activation_bytes")][5] == "pass (equals plain fsdp2's count)"
    assert fsdp2[("memory_report", "report_parameter_bytes")][5] == "pass (the model's bytes)"
    # the disk policy really moved bytes at toy sizes (the size threshold is 0 in --smoke)
    moved = [row for row in rows if row[:3] == ["activations", "disk", "disk_offloaded_bytes_per_step"]]
    assert moved and moved[0][3] not in ("-", "0.0 MiB"), moved
    # offload's share is of the bytes it can move: the blocks' saved bytes less autocast's weight copies
    # (bf16-mixed on CPU casts the weights too)
    share = {row[2]: row[4] for row in rows if row[:2] == ["activations", "offload"]}  # of blocks_saved_bytes
    assert 0 < float(share["blocks_weight_copy_bytes"]) < 1, share
    assert abs(float(share["blocks_weight_copy_bytes"]) + float(share["blocks_movable_bytes"]) - 1) < 0.01, share
    # hetero's check that can fail (no allocation retried in training after the probe) needs CUDA
    assert ["hetero", "probe_auto", "alloc_retries_in_training", "-", "-", "skipped: needs CUDA"] in rows
    # AutoFit's 2 GiB fit runs at toy sizes on the CPU (a pick, tokens/s); its CUDA figures and the
    # budget that is a fraction of a CUDA peak say they were skipped
    autofit = {(row[1], row[2]): row for row in rows if row[0] == "autofit"}
    assert autofit[("budget_2GiB", "pick")][5].startswith("micro-batch "), autofit.get(("budget_2GiB", "pick"))
    assert autofit[("budget_2GiB", "tokens_per_s")][3] != "-"
    assert autofit[("budget_2GiB", "measured_peak_bytes")][5] == "skipped: needs CUDA"
    assert autofit[("budget_0.5x_default_peak", "case")][5] == "skipped: needs CUDA"
    # CUDA-only figures and goals say they were skipped, they are not made up
    assert any(row[0] == "goals" and row[5] == "skipped: needs CUDA" for row in rows)
    assert "gpu_check: 0 failed check(s)" in done.stdout


def test_a_failed_numerical_check_makes_the_run_fail():
    done = _run("--smoke", "--only", "grads", "--only", "fsdp2", "--perturb", "grads", "--perturb", "fsdp2")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    results = {row[1]: row[5] for row in _rows(done.stdout) if row[0] == "grads"}
    assert results.pop("keep_rerun") == "pass (bitwise)"  # the control is left alone
    assert results and all(result.startswith("FAIL") for result in results.values()), results
    # FSDP2's comparisons and MemoryReport's figures fail too when perturbed (its control stays)
    fsdp2 = {(row[1], row[2]): row[5] for row in _rows(done.stdout)
             if row[0] == "fsdp2" and row[5].startswith(("pass", "FAIL", "error", "inconclusive"))}
    assert fsdp2.pop(("plain_rerun", "grad_max_abs_diff")) == "pass (bitwise)"
    # the 8-bit check's control (FSDP2 bitwise one device) failed too: it cannot tell, and says so
    assert fsdp2.pop(("8bit", "params_vs_one_device_8bit_max_abs_diff")).startswith(
        "inconclusive (control fsdp2/plain_vs_one_device not bitwise")
    assert len(fsdp2) == 8 and all(result.startswith("FAIL") for result in fsdp2.values()), fsdp2
    # --only ran those checks alone (and the baseline fsdp2 compares with)
    assert {row[0] for row in _rows(done.stdout)} == {"grads", "fsdp2", "baseline"}


def _bench(tmp_path, perturb=()) -> Bench:
    return Bench(torch.device("cpu"), {}, set(perturb), tmp_path)


def test_exact_comparisons_fail_on_one_ulp_and_tolerant_ones_on_more_than_the_tolerance(tmp_path):
    reference = {"w": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.25])}
    one_ulp = {"w": torch.tensor([1.0, -2.0, torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)).item()]),
               "b": torch.tensor([0.25])}
    beyond = {"w": reference["w"] + torch.tensor([0.0, 0.0, 2.0 * 2 * GRAD_TOLERANCE]), "b": torch.tensor([0.25])}
    bench = _bench(tmp_path)
    bench.compare("resume", "a", reference, dict(reference), exact=True, what="params")
    bench.compare("resume", "b", reference, one_ulp, exact=True, what="params")
    bench.compare("grads", "c", reference, one_ulp, exact=False, what="grad")
    bench.compare("grads", "d", reference, beyond, exact=False, what="grad")
    bench.compare("grads", "e", reference, {"w": reference["w"]}, exact=False, what="grad")  # a gradient missing
    bench.compare("grads", "f", None, reference, exact=False, what="grad")  # the reference fit failed
    results = [row.result for row in bench.rows]
    assert results[0] == "pass (bitwise)"
    assert results[1].startswith("FAIL")
    assert results[2].startswith("pass (<=")
    assert results[3].startswith("FAIL") and results[4].startswith("FAIL")
    assert results[5].startswith("error")
    assert bench.rows[1].value == 2.0**-24  # one float32 ulp at 0.5


def test_an_exact_check_is_inconclusive_not_failed_when_its_rerun_control_is_not_bitwise(tmp_path):
    reference = {"w": torch.tensor([1.0, -2.0, 0.5])}
    noisy = {"w": torch.tensor([1.0, -2.0, 0.5 + 2.0**-20])}
    bench = _bench(tmp_path)
    bench.compare("optim_exact", "8bit_rerun", reference, dict(reference), exact=True, what="params")
    bench.compare("optim_exact", "8bit_offload", reference, noisy, exact=True, what="params",
                  control="optim_exact/8bit_rerun")
    assert bench.rows[-1].result.startswith("FAIL")  # a bitwise control: a difference is a failure
    bench = _bench(tmp_path)
    bench.compare("optim_exact", "8bit_rerun", reference, noisy, exact=True, what="params")
    bench.compare("optim_exact", "8bit_offload", reference, noisy, exact=True, what="params",
                  control="optim_exact/8bit_rerun")
    bench.compare("resume", "8bit", reference, dict(reference), exact=True, what="params",
                  control="optim_exact/8bit_rerun")
    results = [row.result for row in bench.rows]
    assert results[0].startswith("FAIL")  # the control itself
    assert results[1].startswith("inconclusive (control optim_exact/8bit_rerun not bitwise")
    assert not results[1].startswith(RESULTS_THAT_FAIL)
    assert results[2] == "pass (bitwise)"  # equal is equal, whatever the control
