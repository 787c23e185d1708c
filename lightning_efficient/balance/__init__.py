"""Heterogeneous-GPU batch balancing: planner, sampler, the shared balancer and the ``hetero_ddp`` and
``hetero_fsdp`` strategies."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_efficient.balance.balancer import Balancer
from lightning_efficient.balance.fsdp import HeterogeneousFSDPStrategy
from lightning_efficient.balance.planner import SharePlan, plan_shares
from lightning_efficient.balance.sampler import HeterogeneousBatchSampler
from lightning_efficient.balance.strategy import HeterogeneousDDPStrategy

for _strategy, _description in (
    (HeterogeneousDDPStrategy, "DDP with per-rank batch shares proportional to measured speed"),
    (HeterogeneousFSDPStrategy, "FSDP2 (ModelParallelStrategy) with per-rank batch shares proportional to measured speed"),
):
    if _strategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_strategy.strategy_name, _strategy, description=_description)

__all__ = [
    "Balancer",
    "HeterogeneousBatchSampler",
    "HeterogeneousDDPStrategy",
    "HeterogeneousFSDPStrategy",
    "SharePlan",
    "plan_shares",
]
