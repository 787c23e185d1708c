"""Runs one benchmark variant in this (fresh) process and prints its metrics as one JSON line."""

from __future__ import annotations

import argparse
import json
import random

from benchmarks.harness import CASES, RESULT_PREFIX


def main() -> None:
    """``python -m benchmarks.worker CASE VARIANT [--quick]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("variant")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    import numpy as np
    import torch

    import benchmarks.cases  # noqa: F401  (registers the cases)

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    metrics = CASES[args.case].variants[args.variant](args.quick)
    print(RESULT_PREFIX + json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main()
