"""Every plugin under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` per block), on two gloo
processes in one launch of ``plugins_run.py``, against plain FSDP2 in the same launch (bitwise: the
same math) and against one-device fits run here.

Before FSDP2 support, ActivationMemory and MemoryReport crashed at fit start ("Attempted to access the
data pointer on an invalid python storage": FSDP2 parameters are DTensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conformance.harness import quiet
from tests.ddp import run_script
from tests.fsdp import plugins_run

POLICIES = ["activations-keep", "activations-checkpoint", "activations-selective-by-class", "activations-offload",
            "activations-disk", "activations-auto", "activations-checkpoint-reentrant"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    """Each rank's results of every case in ``plugins_run.CASES`` (one launch)."""
    out = tmp_path_factory.mktemp("fsdp")
    run_script(Path(plugins_run.__file__), out, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> Any:
    """One-device fits of ``plugins_run``'s cases, cached: ``one_device(case, batch)``."""
    root = tmp_path_factory.mktemp("one_device")
    cache: dict[tuple[str, int], dict[str, Any]] = {}

    def run(case: str, batch: int) -> dict[str, Any]:
        if (case, batch) not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with quiet():
                    cache[case, batch] = plugins_run.fit(case, root / f"{case}-{batch}", world=1, batch=batch)
            finally:
                torch.set_num_threads(threads)
        return cache[case, batch]

    return run


def _ok(result: dict[str, Any], case: str) -> dict[str, Any]:
    assert "error" not in result, f"{case} failed under FSDP2:\n{result['error']}"
    return result


@pytest.mark.parametrize("case", POLICIES)
def test_activation_policy_under_fsdp2_trains_as_plain_fsdp2_bitwise(case: str, ranks) -> None:
    """Every policy composed with the blocks' own fully_shard (checkpoint recomputes through FSDP2's
    all-gather): the same losses, local gradient shards at every step and final parameters as plain
    FSDP2; the blocks are found through FSDP2's FSDPBlock class; nothing left hooked after fit."""
    for rank in ranks:
        mine, plain = _ok(rank[case], case), _ok(rank["plain"], "plain")
        assert mine["block_classes"] == ["FSDPBlock"]
        assert mine["plan"] is not None and len(mine["plan"]) == 2
        assert mine["losses"] == plain["losses"]
        assert len(mine["grads"]) == len(plain["grads"]) == plugins_run.STEPS
        for step, (grads, plain_grads) in enumerate(zip(mine["grads"], plain["grads"])):
            assert grads.keys() == plain_grads.keys()
            for name in grads:
                assert torch.equal(grads[name], plain_grads[name]), (case, step, name)
        for name, value in plain["params"].items():
            assert torch.equal(mine["params"][name], value), (case, name)
        assert mine["hooks_left"] == plain["hooks_left"]  # only FSDP2's own hooks


def test_activation_bytes_under_fsdp2_count_no_weights(ranks, one_device) -> None:
    """What ActivationMemory profiles and writes to disk, and what MemoryReport counts as activations,
    per rank under FSDP2 equals the one-device figures of the rank's micro-batch: the all-gathered
    (unsharded) parameters autograd saves are recognised as weights, not activations."""
    per_rank = plugins_run.BATCH // 2
    auto = one_device("activations-auto", per_rank)
    disk = one_device("activations-disk", per_rank)
    report = one_device("report", per_rank)
    for rank in ranks:
        assert _ok(rank["activations-auto"], "auto")["profiles"] == auto["profiles"]
        assert rank["activations-auto"]["baseline_bytes"] == auto["baseline_bytes"] > 0
        assert rank["activations-auto"]["plan"] == auto["plan"]
        figures = _ok(rank["activations-disk"], "disk")["figures"]
        # what it took out of memory (what it wrote leaves out the files backward released before the writer's turn)
        assert figures["activation_disk_offloaded_bytes"] == disk["figures"]["activation_disk_offloaded_bytes"] > 0
        assert figures["activation_disk_written_bytes"] <= figures["activation_disk_offloaded_bytes"]
        assert _ok(rank["report"], "report")["report"]["activation_bytes"] == report["report"]["activation_bytes"] > 0


def test_a_root_weight_used_after_the_forward_is_not_counted_as_an_activation(ranks, one_device) -> None:
    """The root's weights stay gathered after its forward (FSDP2 reshards the root only after backward):
    a loss on ``self.head.weight`` outside the forward saves that gathered weight for backward, and it
    is a weight, so MemoryReport's activation bytes per rank equal the one-device figure of the rank's
    micro-batch (the same model's, which does not count the head either)."""
    per_rank = plugins_run.BATCH // 2
    expected = one_device("report-head-outside", per_rank)["report"]["activation_bytes"]
    assert expected > 0
    for rank in ranks:
        assert _ok(rank["report-head-outside"], "report-head-outside")["report"]["activation_bytes"] == expected


def test_memory_report_under_fsdp2_gives_local_shard_bytes_and_totals(ranks, one_device) -> None:
    """Parameters, gradients and optimizer states: each rank's local shard bytes (from shapes), each
    rank's as rank<i>/, their sum as all_ranks/ — for parameters and gradients the whole model's bytes."""
    whole = one_device("report", plugins_run.BATCH)["report"]
    reports = [_ok(rank["report"], "report")["report"] for rank in ranks]
    for rank, result in enumerate(ranks):
        shapes = result["report"]["shape_bytes"]
        for name in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
            assert reports[rank][name] == shapes[name] > 0, (rank, name)
            for other in reports:
                assert other[f"rank{rank}/{name}"] == shapes[name]
    for name in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert reports[0][f"all_ranks/{name}"] == sum(r["report"]["shape_bytes"][name] for r in ranks)
    assert reports[0]["all_ranks/parameter_bytes"] == whole["parameter_bytes"]
    assert reports[0]["parameter_bytes"] < whole["parameter_bytes"]  # sharded: a rank holds part of it
    assert reports[0]["all_ranks/gradient_bytes"] == whole["gradient_bytes"]
    assert reports[0]["world_size"] == 2


def test_selective_token_loss_under_fsdp2_equals_the_one_device_fit(ranks, one_device) -> None:
    """Global normalisation under FSDP2 (float64): every step's loss is the mean over the global batch's
    valid tokens and the final parameters are the one-device fit's on the whole global batch; plain
    FSDP2 (a rank-mean of rank-means, with per-rank token counts that differ) is not."""
    reference = one_device("tokens64", plugins_run.BATCH)
    tokens = [_ok(rank["tokens64"], "tokens64") for rank in ranks]
    for step, (total, count) in enumerate(reference["losses"]):
        sums = [t["losses"][step] for t in tokens]
        assert sum(c for _, c in sums) == count
        assert sum(s for s, _ in sums) / count == pytest.approx(total / count, rel=1e-12, abs=0)
    assert {c for t in tokens for _, c in t["losses"]} != {count // 2 for _, count in reference["losses"]}
    worst = max(float((tokens[0]["params"][k] - v).abs().max()) for k, v in reference["params"].items())
    assert worst <= 1e-10
    plain = _ok(ranks[0]["plain64"], "plain64")
    apart = max(float((plain["params"][k] - v).abs().max()) for k, v in reference["params"].items())
    assert apart > 1e-6


def test_selective_token_loss_is_refused_under_tensor_parallelism(ranks) -> None:
    """tensor_parallel_size > 1: ranks of a tensor-parallel group share a batch, but random draws are
    seeded by the global rank (peers would keep different tokens) and scope="global" gathers each batch
    once per peer; refused before the first step, with that reason (not the token count, whose
    tensor-parallel factor cancels against the world size)."""
    for rank in ranks:
        error = rank["tokens-tp2"].get("error", "")
        assert "ValueError: SelectiveTokenLoss is refused with tensor_parallel_size=2" in error, error[:2000]
        assert "seeded by the global rank, so tensor-parallel peers would keep different tokens" in error, error[:2000]
        assert "scope='global' gathers each batch's scores once per tensor-parallel rank" in error
        assert "that many times too small" not in error


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_cpu_offload"])
def test_lightnings_own_refusal_of_fsdp1_on_cpu_is_not_masked(strategy: str) -> None:
    """Lightning's FSDPStrategy (FSDP1) needs a GPU: with every plugin on, a CPU Trainer still fails with
    Lightning's own message, before anything of ours runs."""
    from lightning.pytorch import Trainer

    from lightning_efficient import ActivationMemory, EightBitOptimizer, MemoryReport, SelectiveTokenLoss

    callbacks = [SelectiveTokenLoss(method="none"), ActivationMemory("checkpoint"), EightBitOptimizer(),
                 MemoryReport(log=False, print_table=False)]
    with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
        Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks, logger=False)
