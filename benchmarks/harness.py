"""The benchmark registry, the per-variant subprocess runner and the result writers.

A *case* is a named group of *variants*, one of which is the baseline. Each variant is a function
``fn(quick: bool) -> dict[str, float]`` that runs in a fresh Python process (``benchmarks.worker``),
with fixed seeds and ``MALLOC_MMAP_THRESHOLD_`` set so that peak RSS reflects freed tensors.
Results go to ``benchmarks/results/NAME.{md,json,png}`` with every metric's ratio to the baseline.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Metrics = dict[str, float]
Variant = Callable[[bool], Metrics]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCHMARK-RESULT "


@dataclass
class Case:
    """A benchmark case: variants measured side by side against ``baseline``.

    Attributes:
        name: the case's name (``--only NAME``; the results' file name).
        description: one sentence for the results page.
        baseline: the label of the variant every ratio is taken against.
        variants: label -> function ``fn(quick) -> metrics``, run in this order.
        timeout_s: the most seconds one variant may take.
        extra_report: optional ``fn(results, out_dir, quick) -> markdown`` appended to the results
            page (for derived tables and charts of its own).
        chart: optional ``fn(case, results, path)`` drawing the case's own PNG (what the case is about);
            the default draws one panel per model with each variant's ratios to that model's baseline.
        rounds: full runs are repeated this many times, the variants interleaved (all of them, then
            all again), and each figure is the median over rounds — for timings on a machine whose
            speed drifts; ``--quick`` runs one round.
    """

    name: str
    description: str
    baseline: str
    variants: dict[str, Variant] = field(default_factory=dict)
    timeout_s: float = 900.0
    extra_report: Callable[[dict[str, Metrics], Path, bool], str] | None = None
    rounds: int = 1
    chart: Callable[[Case, dict[str, Metrics], Path], None] | None = None


CASES: dict[str, Case] = {}


def register(case: Case) -> Case:
    """Add ``case`` to the registry (its module is imported by ``benchmarks.cases``)."""
    if case.baseline not in case.variants:
        raise ValueError(f"case {case.name!r}: baseline {case.baseline!r} is not one of its variants")
    CASES[case.name] = case
    return case


def worker_env() -> dict[str, str]:
    """The environment of a variant's process: mmap threshold for honest RSS, fixed hash seed."""
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_variant(case: Case, label: str, quick: bool) -> Metrics:
    """Run one variant in a fresh process and return its metrics (or ``{"error": ...}``)."""
    command = [sys.executable, "-m", "benchmarks.worker", case.name, label] + (["--quick"] if quick else [])
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True, timeout=case.timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {case.timeout_s:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {done.returncode}: " + " | ".join(tail)}


def median_over_rounds(rounds: list[Metrics]) -> Metrics:
    """One variant's figures over rounds: the median of each number (and, when there are several
    rounds, its spread as ``NAME_min``/``NAME_max`` and every round's value in order as the list
    ``NAME_rounds``, for ratios between variants of the same round); anything else from the last
    round. A round with an error makes the result that error."""
    errors = [r for r in rounds if "error" in r]
    if errors:
        return errors[0]
    merged: Metrics = {}
    for name, value in rounds[-1].items():
        values = [r[name] for r in rounds if isinstance(r.get(name), (int, float))]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or len(values) < 2:
            merged[name] = value
            continue
        merged[name] = statistics.median(values)
        merged[f"{name}_min"], merged[f"{name}_max"] = min(values), max(values)
        merged[f"{name}_rounds"] = values
    return merged


def ratios(results: dict[str, Metrics], baseline: str) -> dict[str, dict[str, float | None]]:
    """Each variant's metrics divided by the baseline's (None where the baseline has no value)."""
    base = results.get(baseline, {})
    out: dict[str, dict[str, float | None]] = {}
    for label, metrics in results.items():
        out[label] = {}
        for name, value in metrics.items():
            reference = base.get(name)
            spread = name.endswith(("_min", "_max"))  # not a figure of its own: no ratio
            ok = not spread and isinstance(value, (int, float)) and isinstance(reference, (int, float)) and reference != 0
            if ok or not isinstance(value, (list, dict)):
                out[label][name] = value / reference if ok else None
    return out


def _format_value(name: str, value: object) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    if name.endswith("_bytes"):
        return f"{value / 2**20:,.2f} MiB"
    if name.endswith("_time_s") or (name.endswith("_s") and not name.endswith("per_s")):
        return f"{value * 1e3:,.2f} ms"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return f"{value:,}"


def write_results(case: Case, results: dict[str, Metrics], quick: bool, out_dir: Path = RESULTS_DIR) -> list[Path]:
    """Write ``NAME.md``, ``NAME.json`` and ``NAME.png``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rel = ratios(results, case.baseline)
    command = f"python -m benchmarks.run --only {case.name}" + (" --quick" if quick else "")
    lines = [
        f"# {case.name}",
        "",
        case.description,
        "",
        f"Produced by `{command}`; baseline: `{case.baseline}`; each variant in a fresh process"
        + (f"; the median of {case.rounds} interleaved rounds (spread in `_min`/`_max`)." if case.rounds > 1 and not quick else "."),
        "",
        "| variant | metric | value | ratio to baseline |",
        "|---|---|---|---|",
    ]
    for label, metrics in results.items():
        for name, value in metrics.items():
            if isinstance(value, (list, dict)):
                continue
            ratio = rel[label].get(name)
            lines.append(
                f"| {label} | {name} | {_format_value(name, value)} | {'-' if ratio is None else f'{ratio:.3f}x'} |"
            )
    md, js, png = (out_dir / f"{case.name}.{ext}" for ext in ("md", "json", "png"))
    if case.extra_report is not None:
        lines += ["", case.extra_report(results, out_dir, quick)]
    md.write_text("\n".join(lines) + "\n")
    payload = {"case": case.name, "baseline": case.baseline, "quick": quick, "results": results, "ratios": rel}
    js.write_text(json.dumps(payload, indent=2, sort_keys=True))
    (case.chart or ratio_chart)(case, results, png)
    return [md, js, png]


def model_groups(results: dict[str, Metrics]) -> dict[str, dict[str, Metrics]]:
    """Variants grouped by model: ``"demo/keep"`` goes to ``"demo"`` as ``"keep"`` (no ``/``: group ``""``)."""
    groups: dict[str, dict[str, Metrics]] = {}
    for label, metrics in results.items():
        model, _, variant = label.rpartition("/")
        groups.setdefault(model, {})[variant] = metrics
    return groups


def panels(count: int, width: float = 5.0, height: float = 3.8):
    """A figure with ``count`` side-by-side axes (matplotlib on the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return plt, fig, list(axes[0])


def ratio_chart(case: Case, results: dict[str, Metrics], path: Path) -> None:
    """One panel per model: each variant's figures as ratios to that model's own baseline (the
    variant named like the case's baseline), so models of different sizes never share a scale."""
    groups = model_groups(results)
    base_variant = case.baseline.rpartition("/")[2]
    plt, fig, axes = panels(len(groups))
    for ax, (model, variants) in zip(axes, groups.items()):
        baseline = base_variant if base_variant in variants else next(iter(variants))
        rel = ratios(variants, baseline)
        metrics = sorted({n for values in rel.values() for n, r in values.items() if isinstance(r, float)})
        labels = [label for label in variants if "error" not in variants[label]]
        width = 0.8 / max(1, len(labels))
        colours = plt.get_cmap("tab20").colors
        for i, label in enumerate(labels):
            heights = [rel[label].get(m) or 0.0 for m in metrics]
            ax.bar([x + i * width for x in range(len(metrics))], heights, width, label=label, color=colours[i % 20])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(metrics))])
        ax.set_xticklabels(metrics, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"ratio to {baseline}")
        ax.set_title(f"{case.name}: {model}" if model else case.name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def redraw(name: str, out_dir: Path = RESULTS_DIR) -> Path:
    """Draw ``NAME.png`` again from ``NAME.json`` (after a change to a chart, without re-measuring)."""
    from benchmarks import cases  # noqa: F401  (registers the cases)

    case = CASES[name]
    results = json.loads((out_dir / f"{name}.json").read_text())["results"]
    path = out_dir / f"{name}.png"
    (case.chart or ratio_chart)(case, results, path)
    return path
