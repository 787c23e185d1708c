"""Case ``balance``: samples/s of 2 CPU processes with rank 1 made 2x slower, plain DDP against
``hetero_ddp``, beside plain DDP without the slowdown (and the ideal a balanced split would reach)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import Case, register

SCRIPT = Path(__file__).resolve().parent.parent / "balance_run.py"


def run(strategy: str, slow: float, model: str, quick: bool) -> dict[str, float]:
    """One 2-process fit; samples/s after the warm-up, and the final shares under hetero_ddp."""
    steps = (8 if model == "mlp" else 6) if quick else (60 if model == "mlp" else 40)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, str(SCRIPT), strategy, str(slow), model, str(steps), str(out)],
                              env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        result = json.loads(out.read_text())
    figures = {"samples_per_s": result["samples_per_s"]}
    if result.get("shares"):
        figures["share_rank0"], figures["share_rank1"] = result["shares"]
    return figures


def report(results: dict, out_dir: Path, quick: bool) -> str:
    """The ideal (plain DDP without slowdown x 1.5 / 2) and hetero_ddp's fraction of it."""
    lines = ["## Against the ideal", "", "| model | ideal samples/s | hetero_ddp | fraction of ideal | vs plain DDP slowed | hetero_ddp unslowed vs plain DDP |", "|---|---|---|---|---|---|"]
    for model in ("mlp", "demo"):
        base = results.get(f"{model}/ddp_no_slowdown", {}).get("samples_per_s")
        slowed = results.get(f"{model}/ddp_slowed", {}).get("samples_per_s")
        hetero = results.get(f"{model}/hetero_ddp_slowed", {}).get("samples_per_s")
        hetero_fast = results.get(f"{model}/hetero_ddp_no_slowdown", {}).get("samples_per_s")
        if not (base and slowed and hetero and hetero_fast):
            continue
        ideal = base * (1 + 1 / 2) / 2
        lines.append(f"| {model} | {ideal:,.0f} | {hetero:,.0f} | {hetero / ideal:.2f} | {hetero / slowed:.2f}x | {hetero_fast / base:.3f}x |")
    return "\n".join(lines)


VARIANTS = {
    "ddp_no_slowdown": ("ddp", 1.0),
    "ddp_slowed": ("ddp", 2.0),
    "hetero_ddp_slowed": ("hetero_ddp", 2.0),
    "hetero_ddp_no_slowdown": ("hetero_ddp", 1.0),
}

register(
    Case(
        name="balance",
        description=(
            "2 CPU processes (gloo, one thread each), rank 1 made 2x slower by sleeping its own calibrated "
            "compute time per sample; an MLP of 2.4 M parameters at global batch 2,048 and the small demo GPT "
            "(2 layers, d_model 128, seq 64) at global batch 64. Samples/s after a warm-up."
        ),
        baseline="mlp/ddp_no_slowdown",
        variants={f"{m}/{label}": functools.partial(run, s, f, m) for m in ("mlp", "demo") for label, (s, f) in VARIANTS.items()},
        timeout_s=1500.0,
        extra_report=report,
    )
)
