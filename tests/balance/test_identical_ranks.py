"""hetero_fsdp and hetero_ddp on two identical CPU processes started by Lightning's own launcher: the
shares stay about equal (identical_ranks.py runs the fit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.ddp import run_script

SCRIPT = Path(__file__).resolve().parent / "identical_ranks.py"


@pytest.mark.parametrize("strategy", ["hetero_fsdp", "hetero_ddp"])
def test_identical_ranks_run_with_the_same_threads_and_keep_about_equal_shares(tmp_path, strategy):
    """Lightning's launcher sets the thread count (cpus // processes) in rank 0 only; rank 1 kept every
    core, oversubscribed the CPU, measured several times slower and the shares ran off to [7, 1]. With
    equal threads, a fixed cost per micro-step and timing noise must not move them far either."""
    assert "OMP_NUM_THREADS" not in os.environ  # as a user who never set it
    done = run_script(SCRIPT, tmp_path, strategy, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    threads = [set(rank["threads"]) for rank in ranks]
    assert threads[0] == threads[1] and len(threads[0]) == 1, threads
    shares = ranks[0]["shares"]
    assert len(shares) == 12 and shares == ranks[1]["shares"]
    assert all(3 <= s[0] <= 5 and sum(s) == 8 for s in shares), f"{shares}\n{done.stdout}{done.stderr[-3000:]}"
