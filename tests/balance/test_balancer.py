"""The shared Balancer at unit level: what a rank gathers before its first speed reading, and the
strategies' settings written through to it."""

from __future__ import annotations

import math

import pytest

from lightning_efficient import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy
from lightning_efficient.balance.balancer import all_measured, speed_reading
from lightning_efficient.balance.planner import plan_shares


def test_an_unmeasured_rank_gathers_nan_and_no_plan_follows():
    """A rank without a reading sends NaN (not 1 sample/s, which would plan nearly the whole batch
    for the measured rank); the re-plan is skipped until every rank has a reading."""
    assert math.isnan(speed_reading(None))
    assert speed_reading(40.0) == 40.0
    gathered = [speed_reading(40.0), speed_reading(None)]
    assert not all_measured(gathered)
    assert all_measured([40.0, 20.0])
    # what the old reading (1.0 for "none yet") would have planned: nearly everything on rank 0
    assert plan_shares(24, [40.0, 1.0], [None, None], 1).shares[1] <= 1


@pytest.mark.parametrize("strategy_class", [HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy])
def test_settings_are_settable_through_the_strategy_and_validated(strategy_class):
    strategy = strategy_class(global_batch_size=12)
    strategy.shares = [3.0, 1.0]
    strategy.global_batch_size = 16
    strategy.rebalance_every = 5
    assert (strategy.shares, strategy.global_batch_size, strategy.rebalance_every) == ([3.0, 1.0], 16, 5)
    assert strategy.balancer.shares == [3.0, 1.0] and strategy.balancer.global_batch_size == 16
    with pytest.raises(ValueError, match="shares="):
        strategy.shares = [1.0, -1.0]
    with pytest.raises(ValueError, match=r"hysteresis=1\.5"):
        strategy.hysteresis = 1.5
    assert strategy.shares == [3.0, 1.0] and strategy.hysteresis == 0.05  # a refused value changes nothing


def test_hetero_fsdp_refuses_the_probe_set_later_too():
    strategy = HeterogeneousFSDPStrategy()
    with pytest.raises(ValueError, match=r"max_micro_batch='auto' is not allowed: .*FSDP2's all-gathers"):
        strategy.max_micro_batch = "auto"
    strategy.max_micro_batch = [4, 2]
    assert strategy.balancer.max_micro_batch == [4, 2]
    ddp = HeterogeneousDDPStrategy()
    ddp.max_micro_batch = "auto"
    assert ddp.balancer.max_micro_batch == "auto"
