import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_efficient.balance.planner import plan_shares
from lightning_efficient.balance.sampler import HeterogeneousBatchSampler


def _run_epoch(samplers, changes, rng, lookahead=2, stop_after=None):
    """Drive every rank's sampler in lock-step; at some steps schedule new shares on all of them."""
    world = len(samplers)
    accumulation = samplers[0].schedule[0][1].accumulation
    iterators = [iter(s) for s in samplers]
    seen, step = [], samplers[0].next_batch
    while step < samplers[0].batches_per_epoch:
        if stop_after is not None and step == stop_after:
            break
        for it in iterators:
            for _ in range(accumulation):
                seen.extend(next(it))
        if changes and rng.random() < 0.3:
            plan = plan_shares(samplers[0].global_batch, [rng.uniform(0.2, 5) for _ in range(world)], accumulation=accumulation)
            for s in samplers:
                s.schedule_plan(plan, step + lookahead)
        step += 1
    return seen, step


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.integers(0, 40), st.booleans(), st.booleans(), st.integers(0, 10**6))
def test_every_sample_exactly_once_per_epoch(world, size, extra, drop_last, changes, seed):
    global_batch = world + extra
    if drop_last and size < global_batch:
        return
    rng = random.Random(seed)
    plan = plan_shares(global_batch, [rng.uniform(0.2, 5) for _ in range(world)])
    samplers = [HeterogeneousBatchSampler(size, global_batch, r, plan, seed=seed, drop_last=drop_last) for r in range(world)]
    seen, steps = _run_epoch(samplers, changes, rng)
    counts = Counter(seen)
    assert len(seen) == steps * global_batch
    if drop_last:
        assert max(counts.values()) == 1 and len(counts) == size // global_batch * global_batch
    else:
        assert set(counts) == set(range(size))
        padded = steps * global_batch - size  # completed from the start of the permutation, as DistributedSampler
        assert sum(c - 1 for c in counts.values()) == padded
        if padded < size:
            assert max(counts.values()) <= 2


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(20, 200), st.integers(0, 20), st.integers(0, 10**6), st.data())
def test_a_mid_epoch_resume_yields_exactly_the_remaining_samples(world, size, extra, seed, data):
    global_batch = world + extra
    rng = random.Random(seed)
    plan = plan_shares(global_batch, [rng.uniform(0.2, 5) for _ in range(world)])
    make = lambda: [HeterogeneousBatchSampler(size, global_batch, r, plan, seed=seed) for r in range(world)]  # noqa: E731
    straight = make()
    for s in straight:
        s.set_epoch(3)
    full, steps = _run_epoch(straight, True, random.Random(seed + 1))
    cut = data.draw(st.integers(0, steps))
    first = make()
    for s in first:
        s.set_epoch(3)
    rng = random.Random(seed + 1)
    head, _ = _run_epoch(first, True, rng, stop_after=cut)
    states = []
    for s in first:
        state = s.state_dict()
        state["next_batch"] = cut  # the position trained, as the strategy records it
        states.append(state)
    resumed = make()
    for s, state in zip(resumed, states):
        s.load_state_dict(state)
        s.set_epoch(3)
    tail, _ = _run_epoch(resumed, True, rng)  # the same share changes as the straight run from here on
    assert head + tail == full
