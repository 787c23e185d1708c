"""AutoFit under DDP, hetero_ddp, FSDP2 and hetero_fsdp: 2 gloo CPU processes, one launch of ddp_run.py.

Each strategy runs a tiny demo GPT with budget ``[512 MiB, B]``, ``B`` being what rank 1's leanest
block policies are predicted to need at micro-batch 4 (from what AutoFit measured in an infeasible
fit just before, budget ``[512 MiB, 64 KiB]``), and the same fit in plain Lightning with the plan set
by hand; under DDP and FSDP2 also a resume. Memory is each process's peak RSS above its RSS when the fit started
(what AutoFit plans for on CPU), with glibc made to hand freed memory back (one arena, large blocks
mapped). The ``replan`` case: a measured peak above the prediction on one rank.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from tests.ddp import run_script

HERE = Path(__file__).parent
MODES = ("ddp", "hetero_ddp", "fsdp2", "hetero_fsdp")
EXTRA = ("replan", "out_of_memory", "estimated_steps")  # ddp_run.py's other modes
RESUMED = ("ddp", "fsdp2")  # as in ddp_run.py
GLOBAL_BATCH, LOADER_BATCH, ACCUMULATE, STEPS = 16, 4, 2, 4  # as in ddp_run.py
BIG, TINY = 512 * 2**20, 64 * 2**10
PREDICTION_TOLERANCE = 0.10  # |measured - predicted| peak <= this fraction of the prediction + 1 MiB (see the test)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("autofit_distributed")
    # MKL's memory manager off: it caches work buffers per matrix shape, sized by the kernels it picks for this CPU
    # (tens of MiB beside these models' few); with it off the readings are the steps' own on any CPU
    env = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}
    run_script(HERE / "ddp_run.py", out, *MODES, *EXTRA, timeout=600, env=env)
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        for mode in (*MODES, *EXTRA):
            assert "error" not in result.get(mode, {"error": "missing"}), f"rank {rank}, {mode}: {result.get(mode)}"
    return {mode: [result[mode] for result in results] for mode in (*MODES, *EXTRA)}


def _samples_per_step(ranks, key):
    counted = defaultdict(int)
    for rank in ranks:
        for step, size, _ in rank[key]["micro"]:
            counted[step] += size
    return dict(counted)


@pytest.mark.parametrize("mode", MODES)
def test_the_plan_is_the_same_on_every_rank_and_each_rank_applies_its_own_part(results, mode):
    ranks = results[mode]
    applied = [rank["autofit"]["during"]["plan"] for rank in ranks]  # when training starts
    assert applied[0] == applied[1]
    final = [rank["autofit"]["plan"] for rank in ranks]  # also after a re-plan from the measured peaks
    assert final[0] == final[1]
    plan = applied[0]
    assert plan["budgets"] == ranks[0]["budget"] == ranks[1]["budget"]
    caps = [choice["micro_batch"] for choice in plan["ranks"]]
    for rank, result in enumerate(ranks):
        run = result["autofit"]
        assert run["profiles"] == 2
        during, after, mine = run["during"], run["after"], plan["ranks"][rank]
        if mode.startswith("hetero"):
            # each rank its own cap, in force during the fit (the balancer splits larger shares) and restored after
            assert plan["accumulation"] is None
            assert during["caps"] == during["max_micro_batch"] == caps
            assert after["max_micro_batch"] is None
            assert all(size <= caps[rank] for _, size, _ in run["micro"])
        else:
            # one micro-batch for every rank, accumulation keeping 4 x 2 samples a rank per step; restored after
            assert caps[0] == caps[1] and caps[0] * plan["accumulation"] == LOADER_BATCH * ACCUMULATE
            assert during["batch_size"] == caps[0] and during["accumulate_grad_batches"] == plan["accumulation"]
            assert {size for _, size, _ in run["micro"]} == {caps[0]}
            assert after["batch_size"] == LOADER_BATCH and after["accumulate_grad_batches"] == ACCUMULATE
        # this rank's block policies (an ActivationMemory is added only where one is not kept), the plan's optimizer
        if any(policy != "keep" for policy in mine["policies"]):
            assert during["policies"] == mine["policies"]
        else:
            assert during["policies"] is None
        assert during["eight_bit"] == [plan["optimizer"] == "8-bit"]
    if mode.startswith("hetero"):
        # rank 1's budget holds about 4 samples, rank 0's the whole global batch: rank 1's cap is budget-bound, rank 0's
        # is its fastest per sample (which the timed sizes decide: on a CPU not always the largest)
        assert caps[1] < GLOBAL_BATCH and plan["ranks"][1]["peak_bytes"] <= plan["budgets"][1] * (1 - plan["margin"]), caps


@pytest.mark.parametrize("mode", MODES)
def test_every_optimizer_step_trains_the_global_batch(results, mode):
    ranks = results[mode]
    for key in ("autofit", "reference"):
        assert _samples_per_step(ranks, key) == dict.fromkeys(range(STEPS), GLOBAL_BATCH), key


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_measured_peak_is_within_its_budget_and_near_the_prediction(results, mode):
    ranks = results[mode]
    # Measured after 2 optimizer steps: each process's peak RSS above its RSS at the start of fit. At these
    # sizes (a few MiB) what the loop, the collectives and the allocator add outside the measured steps
    # weighs: the prediction is held to 10% + 1 MiB either way (the benchmark reports the error on
    # realistic sizes). Under hetero a rank whose share splits into micro-batches below its cap runs
    # smaller ones than planned for: its peak is held to the upper bound only.
    measured = ranks[0]["autofit"]["measured"]
    assert measured == ranks[1]["autofit"]["measured"]
    plan = ranks[0]["autofit"]["during"]["plan"]  # the predictions the steps ran under
    for rank, (figures, choice, budget) in enumerate(zip(measured, plan["ranks"], plan["budgets"])):
        peak, predicted = figures["peak_bytes"], choice["peak_bytes"]
        assert 0 < peak <= budget, (rank, figures, budget, plan, ranks[rank]["autofit"]["measured_lines"])
        tolerance = PREDICTION_TOLERANCE * predicted + 2**20
        assert peak <= predicted + tolerance, (rank, peak, choice)
        if max(size for _, size, _ in ranks[rank]["autofit"]["micro"]) == choice["micro_batch"]:
            assert peak >= predicted - tolerance, (rank, peak, choice)


@pytest.mark.parametrize("mode", MODES)
def test_losses_equal_a_plain_lightning_fit_with_the_plan_set_by_hand(results, mode):
    ranks = results[mode]
    for rank in ranks:
        assert rank["autofit"]["micro"] == rank["reference"]["micro"]  # each micro-batch's step, size and loss, bitwise
        assert rank["reference"]["during"]["policies"] == rank["autofit"]["during"]["policies"]
        assert rank["reference"]["during"]["eight_bit"] == rank["autofit"]["during"]["eight_bit"]


@pytest.mark.parametrize("mode", MODES)
def test_a_budget_infeasible_on_one_rank_fails_on_every_rank_before_the_first_step(results, mode):
    ranks = results[mode]
    errors = [rank["infeasible"] for rank in ranks]
    assert errors[0]["error"] == errors[1]["error"]
    message = errors[0]["error"]
    assert message.startswith("BudgetTooSmall: AutoFit: no configuration fits the budget. rank 1: budget 0.1 MiB"), message
    assert "rank 0" not in message
    needed = int(re.search(r"need a budget of at least [0-9.,]+ MiB \(([0-9,]+) bytes\)", message).group(1).replace(",", ""))
    assert TINY < needed < BIG
    for error in errors:
        assert error["budget_too_small"]  # a ValueError
        assert error["profiles"] == 2  # measured on both ranks first
        assert error["batches"] == 0
        assert error["batch_size_after"] == LOADER_BATCH and error["max_micro_batch_after"] is None


@pytest.mark.parametrize("mode", RESUMED)
def test_a_resume_reuses_the_checkpoint_plan_and_continues_the_run(results, mode):
    # DDP resumes from a checkpoint file, restored before on_fit_start; FSDP2 (ModelParallelStrategy) from a
    # distributed-checkpoint directory, restored after it, where AutoFit reads its plan from the directory itself
    ranks = results[mode]
    for rank in ranks:
        resumed, straight = rank["resumed"], rank["autofit"]
        assert resumed["profiles"] == 0  # not measured again
        # saved at the end of step 2, after the measured figures (and any re-plan they led to): the plan in force then
        assert resumed["plan"] == resumed["during"]["plan"] == straight["plan"]
        # the same settings applied: micro-batch and accumulation, this rank's block policies, the optimizer states
        settings = ("batch_size", "accumulate_grad_batches", "eight_bit")
        assert {k: resumed["during"][k] for k in settings} == {k: straight["during"][k] for k in settings}
        assert resumed["during"]["policies"] == straight["during"]["policies_at_end"]
        # Lightning found every callback the checkpoint holds state for (the ActivationMemory AutoFit adds included)
        assert resumed["missing"] == []
        # the end of epoch 0 is step 2: the resumed fit trains steps 2 and 3 as plain Lightning resumed from the
        # same moment of the plain fit does (plain Lightning's resume from that checkpoint does not draw the
        # uninterrupted run's samples for step 3 under DDP, with or without AutoFit), bitwise; its first
        # micro-batch is the uninterrupted run's
        assert resumed["micro"] == resumed["reference_micro"]
        assert resumed["micro"][0] == next(entry for entry in straight["micro"] if entry[0] == 2)
    assert any("the checkpoint's plan is reused" in line for line in ranks[0]["resumed"]["lines"])


def test_a_resume_where_one_rank_read_no_plan_goes_on_with_the_other_ranks_plan_on_every_rank(results):
    # rank 0 alone reusing the checkpoint's plan would train while rank 1 measured: each waiting in collectives the
    # other never joins (a gloo timeout here, a hang on NCCL); rank 1 takes the state rank 0 read
    ranks = results["ddp"]
    for rank in ranks:
        resumed = rank["resumed_unread"]
        assert resumed["error"] is None
        assert resumed["profiles"] == 0  # measured on no rank: the checkpoint's plan reused on both
        assert resumed["plan"] == rank["resumed"]["plan"]
        assert resumed["during"] == rank["resumed"]["during"]  # the same settings as the resume where both read it
        assert resumed["micro"] == rank["resumed"]["micro"]  # and the same losses, bitwise
    lines = ranks[0]["resumed_unread"]["lines"]
    assert any("rank(s) [1] read no AutoFit state from the checkpoint; the state the other ranks read" in line
               for line in lines)
    assert any("the checkpoint's plan is reused" in line for line in lines)


def test_a_resume_whose_plan_is_reusable_on_one_rank_only_plans_again_on_every_rank_and_trains_to_the_end(results):
    # rank 1 sets a budget of its own, so the checkpoint's settings (rank 0's) match on rank 0 alone
    ranks = results["ddp"]
    for rank in ranks:
        resumed = rank["resumed_own_budget"]
        assert resumed["error"] is None
        assert resumed["profiles"] == 2  # measured on every rank
        assert sorted({step for step, _, _ in resumed["micro"]}) == [2, 3]  # the steps after the checkpoint's
    assert any("rank(s) [1] cannot reuse the checkpoint's plan; planning again on every rank" in line
               for line in ranks[0]["resumed_own_budget"]["lines"])


def test_an_fsdp2_resume_with_other_settings_and_optimizer_states_measures_again_and_continues_as_plain_lightning(results):
    # FSDP2 loads the checkpoint after on_fit_start, where AutoFit measures: measuring must leave nothing the load
    # trips on (gradients left on the sharded parameters made torch's distributed checkpoint skip the optimizer
    # states: the resumed fit restarted Adam from nothing)
    for rank in results["fsdp2"]:
        resumed = rank["measured_resume"]
        assert resumed["profiles"] == 2  # measured again (another margin)
        assert resumed["plan"]["margin"] == 0.15
        # the other optimizer states than the checkpoint's, converted shard by shard as they load (an 8-bit
        # checkpoint resumed 32-bit only failed with "Missing key in checkpoint state_dict: ...exp_avg")
        assert resumed["plan"]["optimizer"] != resumed["checkpointed_optimizer"]
        assert resumed["eight_bit"] == [resumed["plan"]["optimizer"] == "8-bit"]
        assert resumed["micro"] == resumed["reference_micro"]  # each micro-batch's step, size and loss, bitwise


@pytest.mark.parametrize("mode", RESUMED)
def test_an_8bit_checkpoint_resumed_by_a_32bit_only_autofit_trains_on_as_plain_lightning_dequantizing(results, mode):
    # saved with min_8bit_size=1024 (AutoFit's is 4096): under FSDP2 the load template is given in the saved layout;
    # which parameters were 8-bit was guessed from the converter's own settings, and the states loaded wrong, silently
    # (a distributed checkpoint recording no settings, as older ones: read from its keys; a full-state file: from the
    # settings it records)
    for rank in results[mode]:
        variants = rank["resumed_32bit_only"]
        assert sorted(variants) == (["distributed", "full-state file"] if mode == "fsdp2" else ["file"])
        for resumed in variants.values():
            assert resumed["plan"]["optimizer"] == "32-bit" and resumed["eight_bit"] == [False]
            assert sorted({step for step, _, _ in resumed["micro"]}) == [2, 3]  # the steps after the checkpoint's
            assert resumed["micro"] == resumed["reference_micro"]  # each micro-batch's step, size and loss, bitwise


def test_an_fsdp2_8bit_checkpoint_resumed_8bit_with_other_settings_is_refused_before_anything_trains(results):
    # saved with min_8bit_size=1024, resumed with 4096: the attention's weights were 8-bit and would be 32-bit; their
    # codes loaded into the 32-bit states, silently (a new user's trial)
    for rank in results["fsdp2"]:
        refused = rank["resumed_8bit_other_settings"]
        assert refused["micro"] == []
        assert refused["error"] is not None and "another state precision" in refused["error"]
        assert "blocks.0.attn.qkv.weight (8-bit in the checkpoint)" in refused["error"]
        assert "this run: min_8bit_size=4096" in refused["error"]  # (the checkpoint records no settings: read from its keys)


def test_a_measured_peak_above_the_prediction_on_one_rank_re_plans_the_block_policies_on_every_rank(results):
    # DDP, every block kept at micro-batch 8 within the budget; rank 1 then holds 15% of its budget
    # more during every micro-step than AutoFit measured: after 3 steps the block policies are planned
    # again with a wider margin, the same plan on every rank, each rank switching to its own part
    ranks = results["replan"]
    applied, final = ranks[0]["applied"], ranks[0]["plan"]
    assert [rank["applied"] for rank in ranks] == [applied] * 2 and [rank["plan"] for rank in ranks] == [final] * 2
    assert final["margin"] > applied["margin"], ranks[0]["lines"]
    # only the block policies change: micro-batch, accumulation and optimizer stay
    assert [r["micro_batch"] for r in final["ranks"]] == [r["micro_batch"] for r in applied["ranks"]]
    assert (final["accumulation"], final["optimizer"]) == (applied["accumulation"], applied["optimizer"])
    assert any(policy != "keep" for choice in final["ranks"] for policy in choice["policies"])  # leaner than before
    for rank, result in enumerate(ranks):
        policies = final["ranks"][rank]["policies"]
        assert result["policies_at_end"] == (policies if any(p != "keep" for p in policies) else None)
    assert any("planned again" in line for line in ranks[0]["lines"]), ranks[0]["lines"]


@pytest.mark.parametrize(("mode", "none_from"), [
    ("ddp", 6),  # rank 1 holds 5: the sizes measured (2, 4) fit, the pick beyond them (8) runs out on rank 1 only when
                 # read: no plan there goes half way or more from 4 to 8
    ("hetero_ddp", 4),  # rank 1 holds 3: the second size measured runs out there
])
def test_a_rank_whose_device_runs_out_of_memory_while_measuring_gets_a_plan_it_can_run_and_every_step_trains(
        results, mode, none_from):
    ranks = [rank[mode] for rank in results["out_of_memory"]]
    assert [rank["out_of_memory_at"] for rank in ranks] == [[None, none_from]] * 2  # every rank gathered the same profiles
    plan = ranks[0]["plan"]
    assert ranks[1]["plan"] == plan
    assert f"rank 1: no micro-batch of {none_from} or more (a reading at or above it ran out of memory while measuring)" in plan["notes"]
    caps = [choice["micro_batch"] for choice in plan["ranks"]]
    if mode == "ddp":  # one micro-batch for every rank: rank 1's
        assert caps == [4, 4] and plan["accumulation"] == 2
    else:  # rank 1's cap bound by its device, rank 0's not
        assert caps[1] <= 3 < caps[0]
    assert all(size < none_from for _, size, _ in ranks[1]["micro"])
    assert _samples_per_step(results["out_of_memory"], mode) == dict.fromkeys(range(STEPS), GLOBAL_BATCH)


def test_a_re_plan_keeps_each_rank_micro_batch_and_plans_its_blocks_for_it():
    # what every rank computes when a measured peak is above its prediction (pure: the same on every rank);
    # under hetero, rank 1 (budget 50 MiB) keeps its cap of 2 and checkpoints what margin 0.3 needs
    # there, rather than being planned at rank 0's cap of 8, where nothing fits it
    from lightning_efficient.activations.planner import BlockProfile
    from lightning_efficient.autofit.model import BudgetTooSmall, FitPlan, OptimizerOption, RankChoice, RankProfile, choose_rank, replan

    mib, policies = 2**20, ("keep", "checkpoint")

    def profile(budget):  # 20 MiB + 8 MiB a sample, 6 blocks of 0.75 MiB a sample (1/16 of it under checkpoint)
        return RankProfile(
            sizes=(4, 8), peak_bytes=(20 * mib + 4 * 8 * mib, 20 * mib + 8 * 8 * mib), step_s=(0.09, 0.13), run_state_bytes=4 * mib,
            blocks=[BlockProfile(f"b{i}", {"keep": 6 * mib, "checkpoint": mib // 2}, {"keep": 0.0, "checkpoint": 0.01}) for i in range(6)],
            blocks_size=8, options=[OptimizerOption("32-bit", 4 * mib, 0.01, 12 * mib)], budget_bytes=budget)

    profiles = [profile(10**10), profile(50 * mib)]
    kept = ["keep"] * 6
    for caps, accumulation in (([8, 2], None), ([2, 2], 4)):
        plan = FitPlan("32-bit", [RankChoice(m, kept, 0, 0.1, 0.1) for m in caps], accumulation, 0.1, 1.0, 16, 0.1,
                       [p.budget_bytes for p in profiles])
        again = replan(plan, profiles, margin=0.3, policies=policies)
        assert (again.micro_batches, again.accumulation, again.optimizer, again.margin) == (caps, accumulation, "32-bit", 0.3)
        for profile_, choice, micro in zip(profiles, again.ranks, caps):
            alone = choose_rank(profile_, micro, profile_.options[0], policies, 0.3)
            assert (choice.policies, choice.peak_bytes) == (alone.policies, alone.peak_bytes)
            assert choice.peak_bytes <= profile_.budget_bytes * 0.7
        assert again.ranks[0].policies == kept and again.ranks[1].policies != kept
        with pytest.raises(BudgetTooSmall, match=r"with margin 0\.6 no block policies fit"):
            replan(plan, profiles, margin=0.6, policies=policies)


def test_a_dataloader_built_while_the_optimizers_are_configured_trains_at_the_plan_from_the_first_step(results):
    # estimated_stepping_batches in configure_optimizers built the DataLoader before AutoFit planned: under DDP it kept
    # the old batch size (AutoFit refused it), under hetero_ddp the shares' micro-batches until the first re-balance
    ddp = [rank["ddp"] for rank in results["estimated_steps"]]
    hetero = [rank["hetero_ddp"] for rank in results["estimated_steps"]]
    plan = ddp[0]["plan"]
    micro = plan["ranks"][0]["micro_batch"]
    assert micro != LOADER_BATCH and ddp[1]["plan"] == plan
    assert all(size == micro for rank in ddp for _, size, _ in rank["micro"])
    assert set(_samples_per_step(results["estimated_steps"], "ddp").values()) == {GLOBAL_BATCH}
    caps = [r["micro_batch"] for r in hetero[0]["plan"]["ranks"]]
    assert caps[1] <= 3 < caps[0]
    assert all(size <= caps[1] for _, size, _ in hetero[1]["micro"]) and hetero[1]["micro"]
    assert set(_samples_per_step(results["estimated_steps"], "hetero_ddp").values()) == {GLOBAL_BATCH}
    # the scheduler's total steps: the epoch's optimizer steps at the kept global batch, on every rank
    assert {rank["total_steps"] for rank in ddp + hetero} == {len(_samples_per_step(results["estimated_steps"], "ddp"))}


def test_caps_under_hetero_ddp_with_an_accumulation_set_get_the_micro_batches_they_need(results):
    # a new user's trial: hetero_ddp with accumulate_grad_batches=2 refused AutoFit's own caps ("cannot be split ... with
    # accumulation=2") where 2 micro-batches at the caps hold less than the global batch; the accumulation set is the
    # fewest micro-batches a step, the strategy takes as many as the caps need, and the user's is back after the fit
    ranks = [rank["hetero_ddp_accumulating"] for rank in results["estimated_steps"]]
    caps = [r["micro_batch"] for r in ranks[0]["plan"]["ranks"]]
    assert max(caps) <= 3 and 2 * sum(caps) < GLOBAL_BATCH, caps
    assert ranks[0]["during"]["accumulate_grad_batches"] > ACCUMULATE
    for rank, run in enumerate(ranks):
        assert run["micro"] and all(size <= caps[rank] for _, size, _ in run["micro"])
        assert run["accumulation_after"] == ACCUMULATE
    assert set(_samples_per_step(results["estimated_steps"], "hetero_ddp_accumulating").values()) == {GLOBAL_BATCH}


def test_a_cap_the_user_set_under_hetero_ddp_stays_the_plans_upper_limit(results):
    # a new user's trial: max_micro_batch=[2, None] beside AutoFit was replaced by the plan's caps, rank 0 trained 12 a
    # micro-batch where the user's device held 2; the issue: a setting the user made explicitly is kept, and said so
    ranks = [rank["hetero_ddp_users_caps"] for rank in results["estimated_steps"]]
    caps = [r["micro_batch"] for r in ranks[0]["plan"]["ranks"]]
    assert caps[0] <= 2 < caps[1], caps  # (rank 1, uncapped, takes more at this budget)
    assert any("max_micro_batch=[2, None] is kept" in note for note in ranks[0]["plan"]["notes"])
    for rank, run in enumerate(ranks):
        assert run["micro"] and all(size <= caps[rank] for _, size, _ in run["micro"])
        assert run["caps_after"] == [2, None]
    assert set(_samples_per_step(results["estimated_steps"], "hetero_ddp_users_caps").values()) == {GLOBAL_BATCH}


def test_a_scheduler_stepped_every_few_batches_steps_as_without_autofit_on_two_processes(tmp_path):
    # a StepLR of frequency 2 (batches) at AutoFit's micro-batches of 2 for batches of 4: with Lightning's
    # DistributedSampler, and with use_distributed_sampler=False, where every rank draws the whole dataset (a review: the
    # epoch was counted as half of it, and every step of its second half halved the rate)
    run_script(HERE / "ddp_scheduler.py", tmp_path / "out.json", timeout=300)
    found = json.loads((tmp_path / "out.json").read_text())
    for sampler, steps in (("distributed", 4), ("whole", 8)):
        plain, autofit = found[f"plain_{sampler}"], found[f"autofit_{sampler}"]
        assert autofit["micro_batches"] == [2, 2]
        assert autofit["steps"] == plain["steps"] == steps and autofit["lrs"] == plain["lrs"], sampler
        assert plain["lrs"] == [0.1 * 0.5 ** (step // 2) for step in range(steps)]
