"""Case ``balance``: samples/s of 2 CPU processes with rank 1 made 2x slower, plain DDP against
``hetero_ddp`` and plain FSDP2 against ``hetero_fsdp``, beside the plain strategy without the slowdown
(and the ideal a balanced split would reach)."""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import Case, model_groups, panels, register

SCRIPT = Path(__file__).resolve().parent.parent / "balance_run.py"


def run(strategy: str, slow: float, model: str, quick: bool) -> dict[str, float]:
    """One 2-process fit; samples/s after the warm-up, and the final shares under hetero_ddp / hetero_fsdp."""
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
    """hetero_ddp (hetero_fsdp) against the ideal: the issue's (plain DDP (FSDP2) without slowdown x
    (1 + 1/2) / 2, rank 1 assumed exactly 2x slower) and the same at the slowdown the plain strategy
    actually measured (``f`` = unslowed / slowed samples/s; ideal = unslowed x (1 + 1/f) / 2). With
    several rounds every ratio is taken within a round and the table shows the median of those ratios."""
    lines = [
        "## Against the ideal", "",
        "Ratios are taken within each round, then the median over rounds (the speed of this machine drifts "
        "between rounds; see the `_min`/`_max` spread above). The sleep makes rank 1's forward and backward 2x "
        "slower, but its whole step (with optimizer, data and communication, which are not slowed) by the "
        "measured factor f: the 2x ideal overstates what balancing can reach when f < 2, and the ideal at f, "
        "which treats the whole step as per-sample work, understates it when fixed per-step costs are large.", "",
        "| model | strategy | balanced | ideal (2x) | fraction | measured slowdown f | ideal at f | fraction "
        "| vs plain slowed | balanced unslowed vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def per_round(label: str) -> list[float]:
        figures = results.get(label, {})
        return figures.get("samples_per_s_rounds") or ([figures["samples_per_s"]] if "samples_per_s" in figures else [])

    median = statistics.median
    for model, family in ((m, f) for m in ("mlp", "demo") for f in ("ddp", "fsdp")):
        labels = [f"{family}_no_slowdown", f"{family}_slowed", f"hetero_{family}_slowed", f"hetero_{family}_no_slowdown"]
        base, slowed, hetero, hetero_fast = (per_round(f"{model}/{v}") for v in labels)
        if not (base and slowed and hetero and hetero_fast) or len({len(base), len(slowed), len(hetero), len(hetero_fast)}) != 1:
            continue
        ideal = [b * (1 + 1 / 2) / 2 for b in base]
        factor = [b / s for b, s in zip(base, slowed)]
        ideal_at_f = [b * (1 + 1 / f) / 2 for b, f in zip(base, factor)]
        lines.append(
            f"| {model} | hetero_{family} | {median(hetero):,.0f} | {median(ideal):,.0f} | {median(h / i for h, i in zip(hetero, ideal)):.2f} "
            f"| {median(factor):.2f} | {median(ideal_at_f):,.0f} | {median(h / i for h, i in zip(hetero, ideal_at_f)):.2f} "
            f"| {median(h / s for h, s in zip(hetero, slowed)):.2f}x | {median(f / b for f, b in zip(hetero_fast, base)):.3f}x |"
        )
    return "\n".join(lines)


def chart(case: Case, results: dict, path: Path) -> None:
    """Per model, samples/s of each variant, with the ideal of a balanced split under rank 1's 2x
    slowdown (plain DDP unslowed x 3/4) as a dashed line."""
    groups = model_groups(results)
    plt, fig, axes = panels(len(groups))
    for ax, (model, variants) in zip(axes, groups.items()):
        labels = [label for label in VARIANTS if "samples_per_s" in variants.get(label, {})]
        values = [variants[label]["samples_per_s"] for label in labels]
        palette = ["#999999", "#d62728", "#2ca02c", "#1f77b4", "#bbbbbb", "#ff9896", "#98df8a", "#aec7e8"]
        ax.bar(range(len(labels)), values, color=palette[: len(labels)])
        for family, style in (("ddp", "--"), ("fsdp", ":")):
            if f"{family}_no_slowdown" in labels:
                ideal = variants[f"{family}_no_slowdown"]["samples_per_s"] * (1 + 1 / 2) / 2
                ax.axhline(ideal, color="black", linestyle=style, linewidth=1, label=f"{family}: ideal with rank 1 at 2x")
                ax.legend(fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("samples/s")
        ax.set_title(f"balance: {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


VARIANTS = {
    "ddp_no_slowdown": ("ddp", 1.0),
    "ddp_slowed": ("ddp", 2.0),
    "hetero_ddp_slowed": ("hetero_ddp", 2.0),
    "hetero_ddp_no_slowdown": ("hetero_ddp", 1.0),
    "fsdp_no_slowdown": ("fsdp", 1.0),
    "fsdp_slowed": ("fsdp", 2.0),
    "hetero_fsdp_slowed": ("hetero_fsdp", 2.0),
    "hetero_fsdp_no_slowdown": ("hetero_fsdp", 1.0),
}

register(
    Case(
        name="balance",
        description=(
            "2 CPU processes (gloo, one thread each), rank 1 made 2x slower by sleeping its own calibrated "
            "forward and backward compute time per sample (in its forward and its backward); plain DDP and "
            "hetero_ddp, plain FSDP2 (ModelParallelStrategy, fully_shard per layer/block) and hetero_fsdp; an MLP of "
            "2.4 M parameters at global batch 2,048 and the small demo GPT "
            "(2 layers, d_model 128, seq 64) at global batch 64. Samples/s after a warm-up (which includes "
            "the balanced strategies' re-balancing)."
        ),
        baseline="mlp/ddp_no_slowdown",
        variants={f"{m}/{label}": functools.partial(run, s, f, m) for m in ("mlp", "demo") for label, (s, f) in VARIANTS.items()},
        timeout_s=1500.0,
        extra_report=report,
        rounds=3,
        chart=chart,
    )
)
