"""``HeterogeneousDDPStrategy`` (``"hetero_ddp"``): DDP with per-rank batch shares sized to speed."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_efficient.balance.balanced_strategy import BalancedStrategy
from lightning_efficient.balance.balancer import Balancer


class HeterogeneousDDPStrategy(BalancedStrategy, DDPStrategy):
    """DDP where each rank's share of every global batch follows its measured speed.

    Each rank's compute time per sample is measured on real training steps — from the start of
    ``training_step`` to the moment its last parameter gradient is accumulated in backward, so the
    wait for other ranks at the end of DDP's all-reduce is not counted — smoothed with an
    exponential moving average and exchanged with ``all_gather``; every ``rebalance_every`` steps a
    new plan (:func:`~lightning_efficient.balance.planner.plan_shares`) is adopted when it predicts a
    gain above ``hysteresis``. The strategy installs its own batch sampler, so every sample is used
    exactly once per epoch, and scales each rank's loss so that the step's gradient is the mean
    over the whole global batch, however it is split among ranks and micro-batches: by samples, or
    by valid tokens when ``training_step`` returns per-token losses
    (:class:`~lightning_efficient.TokenLosses`, one all-reduce of the count a step); a loss that
    :class:`~lightning_efficient.SelectiveTokenLoss` normalised by the global kept count is
    re-weighted the same way when the step has several micro-batches.

    Args:
        global_batch_size: samples per optimizer step over all ranks (None: the DataLoader's batch
            size times the number of ranks times ``accumulate_grad_batches``, what plain DDP trains a step).
        shares: ``"auto"`` (measured) or fixed positive weights, one per rank.
        max_micro_batch: the largest micro-batch per rank (an int for all, a list with None for a rank without a
            cap, ``"auto"`` to probe each rank's memory before the first step —
            :mod:`~lightning_efficient.balance.probe` — or None for no cap); larger shares are split with gradient
            accumulation.
        rebalance_every: optimizer steps between re-plans (>= 1).
        warmup_steps: steps measured before the first plan (>= 1).
        hysteresis: the least predicted gain (fraction of step time) that changes the shares.
        ema_decay: weight of the previous speed estimate in the moving average, in [0, 1).
        seed: seed of the per-epoch sample order.
        shuffle: shuffle the training samples each epoch.
        drop_last: drop the last incomplete global batch (as ``DistributedSampler`` does).
        **kwargs: passed on to :class:`~lightning.pytorch.strategies.DDPStrategy`.

    Raises:
        ValueError: naming the argument for invalid settings; before the first step, for shares of
            the wrong length, a global batch smaller than the number of ranks, a DataLoader that does
            not batch (``batch_size=None``), or a mid-epoch checkpoint whose global batch or
            accumulation this run cannot continue, with the numbers.

    The balancing itself is a :class:`~lightning_efficient.balance.balancer.Balancer` the strategy
    holds (``strategy.balancer``), the same one :class:`~lightning_efficient.HeterogeneousFSDPStrategy`
    holds. Speeds are read from device-timeline marks (CUDA events on a GPU) one micro-step later, so
    timing never synchronises the device.

    Resuming on another number of processes is supported: the epoch's remaining global batches are
    re-sliced by a plan for the new ranks, so every remaining sample is trained exactly once.
    """

    strategy_name = "hetero_ddp"

    def __init__(
        self,
        global_batch_size: int | None = None,
        shares: Literal["auto"] | list[float] = "auto",
        max_micro_batch: int | list[int | None] | Literal["auto"] | None = None,
        rebalance_every: int = 50,
        warmup_steps: int = 10,
        hysteresis: float = 0.05,
        ema_decay: float = 0.7,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.balancer = Balancer(
            self.strategy_name, global_batch_size, shares, max_micro_batch, rebalance_every, warmup_steps,
            hysteresis, ema_decay, seed, shuffle, drop_last,
        )
        self.balancer.bind(self)

    @override
    def gradient_sync_off(self) -> Any:
        """DDP's ``no_sync()`` (nothing to switch off before DDP has wrapped the module)."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()
