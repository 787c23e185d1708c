"""The matrix's multi-process cases in one launch: ``python multi_run.py OUT_DIR CASES_JSON``.

The parent starts two gloo processes (rank, world size and a free port in their environment, so every
Trainer in them joins the same process group instead of launching its own) that run every case in
turn and each write ``OUT_DIR/rank{r}.pt``; then the parent, on one process, resumes the ``resize``
cases from their two-process checkpoints and writes ``OUT_DIR/parent.pt``. A case that fails records
its error (the others still run): the test reports it against its cell.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from tests.ddp import launch_ranks


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])


def main(out: Path, cases_json: Path) -> None:
    from tests.conformance import harness

    torch.set_num_threads(1)
    with harness.quiet():
        _run(harness, out, cases_json)


def _run(harness, out: Path, cases_json: Path) -> None:
    cases = [harness.Case(**c) for c in json.loads(cases_json.read_text())]
    rank = os.environ.get("LOCAL_RANK")
    if rank is None:
        codes = launch_ranks(__file__, out, cases_json)
        results = {}
        for case in cases:
            if case.strategy != "resize":
                continue
            workdir = out / case.name
            if not (workdir / "resume.ckpt").exists():
                continue
            try:
                results[case.name] = harness.resume(case, workdir, world=1)
            except Exception as exc:  # noqa: BLE001 (reported against the cell)
                results[case.name] = {"error": _error(exc)}
        torch.save({"codes": codes, "resumed": results}, out / "parent.pt")
        return
    traces = {}
    for case in cases:
        workdir = out / case.name
        try:
            traces[case.name] = harness.fit(case, workdir, world=2, resume_world=1 if case.strategy == "resize" else 2)
        except Exception as exc:  # noqa: BLE001 (reported against the cell; the ranks stay in step)
            traces[case.name] = {"case": asdict(case), "error": _error(exc)}
    torch.save(traces, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
