"""Case ``balance``: samples/s of 2 CPU processes with rank 1 made 2x slower, plain DDP against
``hetero_ddp``, beside plain DDP without the slowdown (and the ideal a balanced split would reach)."""

from __future__ import annotations

import functools
import json
import os
import statistics
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
    """The ideal (plain DDP without slowdown x 1.5 / 2) and hetero_ddp's fraction of it. With several
    rounds every ratio is taken within a round (variants measured minutes apart, not a round
    apart) and the table shows the median of those ratios."""
    lines = [
        "## Against the ideal", "",
        "Ratios are taken within each round, then the median over rounds (the speed of this machine drifts "
        "between rounds; see the `_min`/`_max` spread above).", "",
        "| model | ideal samples/s | hetero_ddp | fraction of ideal | vs plain DDP slowed | hetero_ddp unslowed vs plain DDP |",
        "|---|---|---|---|---|---|",
    ]

    def per_round(label: str) -> list[float]:
        figures = results.get(label, {})
        return figures.get("samples_per_s_rounds") or ([figures["samples_per_s"]] if "samples_per_s" in figures else [])

    for model in ("mlp", "demo"):
        base, slowed, hetero, hetero_fast = (per_round(f"{model}/{v}") for v in VARIANTS)
        if not (base and slowed and hetero and hetero_fast) or len({len(base), len(slowed), len(hetero), len(hetero_fast)}) != 1:
            continue
        ideal = [b * (1 + 1 / 2) / 2 for b in base]
        fraction = statistics.median(h / i for h, i in zip(hetero, ideal))
        gain = statistics.median(h / s for h, s in zip(hetero, slowed))
        unslowed = statistics.median(f / b for f, b in zip(hetero_fast, base))
        lines.append(f"| {model} | {statistics.median(ideal):,.0f} | {statistics.median(hetero):,.0f} | {fraction:.2f} | "
                     f"{gain:.2f}x | {unslowed:.3f}x |")
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
            "(2 layers, d_model 128, seq 64) at global batch 64. Samples/s after a warm-up (which includes "
            "hetero_ddp's re-balancing)."
        ),
        baseline="mlp/ddp_no_slowdown",
        variants={f"{m}/{label}": functools.partial(run, s, f, m) for m in ("mlp", "demo") for label, (s, f) in VARIANTS.items()},
        timeout_s=1500.0,
        extra_report=report,
        rounds=3,
    )
)
