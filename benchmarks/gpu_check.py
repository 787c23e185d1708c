"""Every GPU measurement in one go: ``python benchmarks/gpu_check.py``.

Prints one table (check, variant, metric, value, ratio to the baseline of the same check). With no
CUDA device it says so and exits 0. Each check is a function below, registered in ``CHECKS``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

Rows = list[tuple[str, str, str, float, float | None]]


def _timed_steps(step: Callable[[], None], steps: int) -> tuple[float, int]:
    """Mean seconds per step after one warm-up step, and the peak allocated bytes of those steps."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated()


def check_demo_baseline() -> Rows:
    """The demo GPT at GPU scale (12 layers, d_model 768, seq 1024, vocab 32768, bf16 autocast), no plugin."""
    from lightning_efficient import DemoGPT

    model = DemoGPT(vocab_size=32768, n_layers=12, d_model=768, n_heads=12, seq_len=1024).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = {
        "input_ids": torch.randint(0, 32768, (8, 1024), device="cuda"),
        "labels": torch.randint(0, 32768, (8, 1024), device="cuda"),
    }

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.token_losses(batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, peak = _timed_steps(step, 10)
    return [("demo", "baseline", "step_time_s", seconds, 1.0), ("demo", "baseline", "peak_bytes", peak, 1.0)]


CHECKS: list[Callable[[], Rows]] = [check_demo_baseline]


def main() -> int:
    """Run every check and print the table; exit 0 without a GPU."""
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured.")
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    rows: Rows = []
    for check in CHECKS:
        try:
            rows += check()
        except Exception as error:  # one failing check must not hide the others' figures
            rows.append((check.__name__, "-", f"error: {error!r}"[:120], float("nan"), None))
        torch.cuda.empty_cache()
    print(f"| {'check':<12} | {'variant':<16} | {'metric':<24} | {'value':>14} | ratio |")
    for name, variant, metric, value, ratio in rows:
        shown = f"{value / 2**20:,.1f} MiB" if metric.endswith("bytes") else f"{value:.4g}"
        print(f"| {name:<12} | {variant:<16} | {metric:<24} | {shown:>14} | {'-' if ratio is None else f'{ratio:.3f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
