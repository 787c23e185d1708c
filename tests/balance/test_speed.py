"""The micro-step time model the balancer re-plans with: fixed + per-sample cost."""

from __future__ import annotations

import math

import pytest

from lightning_efficient.balance.planner import plan_shares
from lightning_efficient.balance.speed import MicroStepTimes, equal_time_weights, predicted_step_time


def _measured(times: list[tuple[int, float]]) -> MicroStepTimes:
    model = MicroStepTimes()
    model.observe(1, 100.0)  # the first micro-step of a fit (one-time costs) is left out
    for samples, seconds in times:
        model.observe(samples, seconds)
    return model


def test_fit_recovers_fixed_and_per_sample_cost_and_ignores_outliers_and_the_first_step():
    model = _measured([(4, 0.010 + 4 * 0.002)] * 4 + [(2, 0.010 + 2 * 0.002)] * 4 + [(2, 5.0)])  # one stalled step
    fixed, per_sample, noise = model.fit()
    assert fixed == pytest.approx(0.010) and per_sample == pytest.approx(0.002) and noise == 0.0
    assert 1 not in model.seconds


def test_fit_with_one_size_is_proportional_and_before_four_measurements_is_unknown():
    assert _measured([(4, 0.02)] * 4).fit() == (0.0, pytest.approx(0.005), 0.0)
    assert all(math.isnan(x) for x in _measured([(4, 0.02)] * 3).fit())
    assert all(math.isnan(x) for x in MicroStepTimes().fit())
    # a size measured fewer times is left out; the spread is the median absolute deviation over the median
    fixed, per_sample, noise = _measured([(4, 0.016), (4, 0.020), (4, 0.020), (4, 0.024), (2, 0.001)]).fit()
    assert (fixed, per_sample) == (0.0, pytest.approx(0.005)) and noise == pytest.approx(0.1)


def test_fit_spread_is_the_largest_relative_spread():
    _, _, noise = _measured([(4, 0.02)] * 4 + [(2, 0.008), (2, 0.012), (2, 0.008), (2, 0.012)]).fit()
    assert noise == pytest.approx(0.2)


def test_fit_keeps_the_costs_non_negative():
    fixed, per_sample, _ = _measured([(2, 0.030), (6, 0.020)] * 4).fit()  # more samples took less: noise
    assert fixed >= 0 and per_sample > 0
    fixed, per_sample, _ = _measured([(2, 0.001), (6, 0.012)] * 4).fit()  # a negative intercept
    assert fixed == 0.0 and per_sample > 0


def _replan_until_settled(global_batch, shares, seconds_of, replan, measured_first=None):
    """Shares after re-planning 6 times, each rank measured at its current share by ``seconds_of(rank, n)``
    (and, first, at the shares ``measured_first``)."""
    history = [list(shares)]
    models = [MicroStepTimes() for _ in shares]
    for rank, model in enumerate(models):
        for _ in range(5 if measured_first else 0):
            model.observe(measured_first[rank], seconds_of(rank, measured_first[rank]))
    for _ in range(6):
        for rank, model in enumerate(models):
            for _ in range(5):
                model.observe(shares[rank], seconds_of(rank, shares[rank]))
        shares = replan(global_batch, shares, models)
        history.append(list(shares))
    return history


def _affine_replan(global_batch, shares, models):
    fixed, per_sample, _ = zip(*(m.fit() for m in models))
    candidate = plan_shares(global_batch, equal_time_weights(global_batch, 1, fixed, per_sample), None, 1)
    gain = 1 - predicted_step_time(candidate.shares, 1, fixed, per_sample) / predicted_step_time(shares, 1, fixed, per_sample)
    return list(candidate.shares) if gain > 0.05 else shares


def _proportional_replan(global_batch, shares, models):  # the rule before: samples per second at the current share
    speeds = [shares[r] / m.seconds[shares[r]] for r, m in enumerate(models)]
    candidate = plan_shares(global_batch, speeds, None, 1)
    gain = 1 - candidate.step_time(speeds) / plan_shares(global_batch, shares, None, 1).step_time(speeds)
    return list(candidate.shares) if gain > 0.05 else shares


def test_identical_ranks_with_a_fixed_cost_per_micro_step_come_back_to_equal_shares():
    """10 ms fixed + 1 ms a sample on both ranks, measured at [4, 4], then at [5, 3] after one noisy
    re-plan: samples per second at the current share make the rank with fewer samples look slower in
    proportion, so that rule never brings the shares back; the fixed + per-sample model returns them to [4, 4]."""
    identical = lambda rank, n: 0.010 + 0.001 * n
    assert _replan_until_settled(8, [5, 3], identical, _proportional_replan, [4, 4])[-1] == [5, 3]
    history = _replan_until_settled(8, [5, 3], identical, _affine_replan, [4, 4])
    assert history[-1] == [4, 4] and all(3 <= s[0] <= 5 for s in history), history


def test_a_slower_rank_still_gets_fewer_samples():
    """Rank 1 costs 3 ms a sample, rank 0 1 ms, both 2 ms fixed: equal step times at about 18:6 of 24."""
    slowed = lambda rank, n: 0.002 + (0.003 if rank else 0.001) * n
    final = _replan_until_settled(24, [12, 12], slowed, _affine_replan)[-1]
    assert sum(final) == 24 and 2.5 <= final[0] / final[1] <= 3.5, final


def test_equal_time_weights_end_every_step_together():
    weights = equal_time_weights(30, 2, [0.01, 0.004], [0.002, 0.001])
    assert sum(weights) == pytest.approx(30)
    times = [2 * a + b * w for w, a, b in zip(weights, [0.01, 0.004], [0.002, 0.001])]
    assert times[0] == pytest.approx(times[1])
