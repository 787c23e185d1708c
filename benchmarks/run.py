"""``python -m benchmarks.run [--only NAME ...] [--variant GLOB ...] [--quick] [--out DIR] [--redraw]``: run the
registered cases (``--variant``: only the variants matching a glob, and always the baseline beside them)."""

from __future__ import annotations

import argparse
import fnmatch
from pathlib import Path

from benchmarks.harness import CASES, RESULTS_DIR, median_over_rounds, redraw, run_variant, write_results


def main(argv: list[str] | None = None) -> int:
    """Run the selected cases, print each table and write the result files; exit status 1 on errors."""
    import benchmarks.cases  # noqa: F401  (registers the cases)

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="run only this case (repeatable)")
    parser.add_argument("--variant", action="append", metavar="GLOB",
                        help="run only the variants matching this glob, and the baseline (repeatable)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few steps")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where result files go")
    parser.add_argument("--redraw", action="store_true", help="draw the charts again from the saved JSON, measure nothing")
    args = parser.parse_args(argv)
    if args.redraw:
        for name in args.only or list(CASES):
            print(redraw(name, args.out))
        return 0
    failed = False
    for name in args.only or list(CASES):
        case = CASES[name]
        rounds = 1 if args.quick else case.rounds
        labels = [label for label in case.variants if label == case.baseline or not args.variant
                  or any(fnmatch.fnmatch(label, pattern) for pattern in args.variant)]
        measured: dict[str, list] = {label: [] for label in labels}
        for round_index in range(rounds):
            for label in labels:
                print(f"[{name}] {label} ..." + (f" (round {round_index + 1}/{rounds})" if rounds > 1 else ""), flush=True)
                measured[label].append(run_variant(case, label, args.quick))
        results = {label: median_over_rounds(values) for label, values in measured.items()}
        failed |= any("error" in metrics for metrics in results.values())
        paths = write_results(case, results, args.quick, args.out)
        print(paths[0].read_text(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
