"""Heterogeneous-GPU batch balancing: planner, sampler and the ``hetero_ddp`` strategy."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_efficient.balance.planner import SharePlan, plan_shares
from lightning_efficient.balance.sampler import HeterogeneousBatchSampler
from lightning_efficient.balance.strategy import HeterogeneousDDPStrategy

if HeterogeneousDDPStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        HeterogeneousDDPStrategy.strategy_name,
        HeterogeneousDDPStrategy,
        description="DDP with per-rank batch shares proportional to measured speed",
    )

__all__ = ["HeterogeneousBatchSampler", "HeterogeneousDDPStrategy", "SharePlan", "plan_shares"]
