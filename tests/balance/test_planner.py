import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_efficient.balance.planner import held_from_weights, plan_shares, shrunk_plan

speeds = st.lists(st.floats(0.1, 10.0), min_size=1, max_size=64)


@settings(max_examples=300, deadline=None)
@given(speeds, st.integers(1, 5000), st.data())
def test_shares_sum_respect_caps_and_give_equal_step_counts(speeds, extra, data):
    world = len(speeds)
    global_batch = world + extra
    caps = data.draw(st.lists(st.one_of(st.none(), st.integers(1, 400)), min_size=world, max_size=world))
    # the accumulate_grad_batches a user set: the fewest micro-batches a step (at most a sample a rank each)
    least = data.draw(st.integers(1, min(8, global_batch // world)))
    try:
        plan = plan_shares(global_batch, speeds, caps, least_accumulation=least)
    except ValueError as error:
        assert "cannot be split" in str(error)
        # genuinely impossible: even the largest accumulation cannot fit the batch under the caps
        most = global_batch // world
        assert sum(most * (c if c is not None else math.inf) for c in caps) < global_batch or most < 1
        return
    assert sum(plan.shares) == global_batch
    # no fewer micro-batches than set (where the global batch gives every rank that many samples); more only for a cap
    assert plan.accumulation >= least
    if all(c is None for c in caps):
        assert plan.accumulation == least
    for rank, share in enumerate(plan.shares):
        micro = plan.micro_batches(rank)
        assert len(micro) == plan.accumulation  # every rank: the same number of passes per step
        assert sum(micro) == share and min(micro) >= 1
        if caps[rank] is not None:
            assert max(micro) <= caps[rank]


@settings(max_examples=300, deadline=None)
@given(speeds, st.integers(0, 5000))
def test_uncapped_shares_are_proportional_within_one_sample(speeds, extra):
    global_batch = len(speeds) * 4 + extra
    plan = plan_shares(global_batch, speeds)
    ideal = [global_batch * v / sum(speeds) for v in speeds]
    if all(x >= 1 for x in ideal):
        assert all(abs(s - x) < 1 for s, x in zip(plan.shares, ideal))
    # no other split of integers has a smaller slowest-rank time by more than one sample's time
    assert plan.step_time(speeds) <= max(x / v for x, v in zip(ideal, speeds)) + 1 / min(speeds)


def test_a_thousand_ranks():
    speeds = [1.0 + (r % 7) for r in range(1024)]
    plan = plan_shares(100_000, speeds, caps=[150] * 1024)
    assert sum(plan.shares) == 100_000 and len(plan.shares) == 1024
    assert max(max(plan.micro_batches(r)) for r in range(1024)) <= 150


def test_a_share_over_its_cap_uses_accumulation():
    plan = plan_shares(64, [1.0, 1.0], caps=[8, 64])
    assert plan.shares == (32, 32) and plan.accumulation == 4
    assert plan.micro_batches(0) == [8, 8, 8, 8]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        ((1, [1.0, 1.0]), r"global_batch_size=1 is smaller than the number of ranks \(2\)"),
        ((4, [1.0, -1.0]), r"shares=\[1.0, -1.0\]"),
        ((4, [0.0, 0.0]), r"shares=\[0.0, 0.0\]"),
        ((4, [1.0, 1.0], [1]), r"max_micro_batch=\[1\] has 1 entry for 2 ranks"),
        ((5, [1.0, 1.0], [1, 1], 1), r"global_batch_size=5 cannot be split over 2 ranks with max_micro_batch=\[1, 1\] and accumulation=1: at most 2"),
    ],
)
def test_impossible_requests_give_the_numbers(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_shares(*args)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000))
def test_largest_fitting_batch_finds_the_memory_limit(limit, upper):
    from lightning_efficient.balance.planner import largest_fitting_batch

    calls = []

    def fits(size):
        calls.append(size)
        return size <= limit

    assert largest_fitting_batch(fits, upper) == min(limit, upper)
    assert len(calls) <= 2 * math.log2(upper + 1) + 3  # doubling then bisection


def test_nothing_fits():
    from lightning_efficient.balance.planner import largest_fitting_batch

    with pytest.raises(ValueError, match="not even a micro-batch of 1 sample fits"):
        largest_fitting_batch(lambda size: False, 64)


@pytest.mark.parametrize("least", [0, 5, 2.0, True])
def test_a_least_accumulation_the_global_batch_cannot_give_every_rank_is_refused(least):
    # 8 samples over 2 ranks: at most 4 micro-batches a step with a sample each (review: 5 was lowered to 4 silently)
    with pytest.raises(ValueError, match=rf"least_accumulation={least!r} is not allowed: expected an integer from 1 to 4"):
        plan_shares(8, [1.0, 1.0], least_accumulation=least)


@settings(max_examples=300, deadline=None)
@given(speeds, st.integers(0, 500), st.integers(1, 6), st.data())
def test_an_epochs_short_last_batch_is_shared_in_proportion_within_the_plans_micro_batches(speeds, extra, steps, data):
    world = len(speeds)
    plan = plan_shares(world * steps + extra, speeds, accumulation=steps)
    samples = data.draw(st.integers(world * steps, sum(plan.shares)))
    short = shrunk_plan(plan, samples)
    assert sum(short.shares) == samples and short.accumulation == steps
    for rank, (new, old) in enumerate(zip(short.shares, plan.shares)):
        assert steps <= new <= old  # a sample in every micro-batch, and no micro-batch above the plan's (its caps)
        assert max(short.micro_batches(rank)) <= max(plan.micro_batches(rank))
        # in proportion: no rank over its part by a sample or more (its time a step), except one lifted to the floor
        # of a sample a micro-batch (the others then give up those samples)
        assert new == steps or new < old * samples / sum(plan.shares) + 1
    with pytest.raises(ValueError, match=r"samples=.* is not allowed"):
        shrunk_plan(plan, world * steps - 1)


def test_shares_held_from_the_weights_by_a_bound_say_which_rank_and_why():
    # a new user's trial: shares 3:1 of 8 samples under caps [2, 8] trained 5:3, and the strategy said nothing of why
    caps = [2, 8]
    plan = plan_shares(8, [3.0, 1.0], caps)
    assert (plan.shares, plan.accumulation) == ((5, 3), 3)
    said = held_from_weights(plan, [3.0, 1.0], caps, "your shares")
    assert said == " (rank 1: a sample in each of its 3 micro-batches; your shares alone give [6, 2])"
    capped = plan_shares(12, [3.0, 1.0], [4, None], accumulation=2)  # rank 0's 9 held to 2 x 4
    assert capped.shares == (8, 4)
    assert held_from_weights(capped, [3.0, 1.0], [4, None], "your shares") == " (rank 0: its cap, 4 a micro-batch; your shares alone give [9, 3])"
    # its review: rounding alone, or weights whose float products are not exact, hold nothing
    assert held_from_weights(plan_shares(8, [3.0, 1.0]), [3.0, 1.0], [None, None], "your shares") == ""
    assert held_from_weights(plan_shares(10, [2.0, 1.0], [None, 3]), [2.0, 1.0], [None, 3], "your shares") == ""  # 7:3, as rounded
    assert held_from_weights(plan_shares(15, [3.0, 1.0], least_accumulation=4), [3.0, 1.0], [None, None], "w") == ""  # 11:4
    assert held_from_weights(plan_shares(9, [0.1, 0.2], least_accumulation=3), [0.1, 0.2], [None, None], "w") == ""  # 3:6
    one = plan_shares(4, [10.0, 1.0])  # rank 1's 0.36 of a sample is one
    assert held_from_weights(one, [10.0, 1.0], [None, None], "w") == " (rank 1: a sample in its micro-batch; w alone give [4, 0])"
