"""``HeterogeneousDDPStrategy`` (``"hetero_ddp"``): DDP with per-rank batch shares sized to speed."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_efficient._distributed import gather_or_raise_together
from lightning_efficient._validation import require, require_bool, require_int
from lightning_efficient.balance.planner import SharePlan, plan_shares
from lightning_efficient.balance.probe import probe_micro_batch
from lightning_efficient.balance.sampler import HeterogeneousBatchSampler
from lightning_efficient.memory import first_tensor
from lightning_efficient.tokens.normalize import StepTokenNormaliser, kept_loss_sum
from lightning_efficient.tokens.output import FusedTokenLoss, NormalisedTokenLoss, TokenLosses


class _BalancedLoader(DataLoader):
    """The training DataLoader ``hetero_ddp`` installs: its state is the strategy's data state
    (sampler position trained, not prefetched, and measured speeds), and each iteration starts the
    trainer's epoch — Lightning calls ``set_epoch`` on ``loader.sampler`` and
    ``loader.batch_sampler.sampler`` only, never on a batch sampler."""

    def __init__(self, *args: Any, strategy: HeterogeneousDDPStrategy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.strategy = strategy

    def __iter__(self) -> Any:
        self.batch_sampler.set_epoch(self.strategy.training_epoch)
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        """The strategy's data state (:meth:`HeterogeneousDDPStrategy.data_state_dict`)."""
        return self.strategy.data_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the strategy's data state (:meth:`HeterogeneousDDPStrategy.load_data_state_dict`)."""
        self.strategy.load_data_state_dict(state)


class HeterogeneousDDPStrategy(DDPStrategy):
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
        max_micro_batch: the largest micro-batch per rank (an int for all, a list, ``"auto"`` to probe
            each rank's memory before the first step — :mod:`~lightning_efficient.balance.probe` —
            or None for no cap); larger shares are split with gradient accumulation.
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

    Resuming on another number of processes is supported: the epoch's remaining global batches are
    re-sliced by a plan for the new ranks, so every remaining sample is trained exactly once.
    """

    strategy_name = "hetero_ddp"

    def __init__(
        self,
        global_batch_size: int | None = None,
        shares: Literal["auto"] | list[float] = "auto",
        max_micro_batch: int | list[int] | Literal["auto"] | None = None,
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
        if global_batch_size is not None:
            require_int("global_batch_size", global_batch_size, 1)
        if shares != "auto":
            ok = isinstance(shares, (list, tuple)) and all(isinstance(s, (int, float)) and s >= 0 for s in shares)
            require(ok and sum(shares) > 0, "shares", shares, "'auto' or non-negative weights, one per rank, summing to more than 0")
            require(all(s > 0 for s in shares), "shares", shares, "positive weights (a rank with share 0 would hang DDP)")
        if isinstance(max_micro_batch, str):
            require(max_micro_batch == "auto", "max_micro_batch", max_micro_batch, "an int, a list of ints, 'auto' or None")
        elif isinstance(max_micro_batch, list):
            require(all(isinstance(c, int) and c >= 1 for c in max_micro_batch), "max_micro_batch", max_micro_batch, "integers >= 1")
        elif max_micro_batch is not None:
            require_int("max_micro_batch", max_micro_batch, 1)
        require_int("seed", seed, 0)
        require_bool("shuffle", shuffle)
        require_bool("drop_last", drop_last)
        require_int("rebalance_every", rebalance_every, 1)
        require_int("warmup_steps", warmup_steps, 1)
        require(0.0 <= hysteresis < 1.0, "hysteresis", hysteresis, "a fraction in [0, 1)")
        require(0.0 <= ema_decay < 1.0, "ema_decay", ema_decay, "a number in [0, 1)")
        self.global_batch_size = global_batch_size
        self.shares = shares
        self.max_micro_batch = max_micro_batch
        self.rebalance_every = rebalance_every
        self.warmup_steps = warmup_steps
        self.hysteresis = hysteresis
        self.ema_decay = ema_decay
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._sampler: HeterogeneousBatchSampler | None = None
        self._plan: SharePlan | None = None
        self._micro_done = 0
        self._speeds: list[float] = []
        self._local_speed: float | None = None
        self._last_planned_step = -1
        self._lookahead = 2
        self._counter_epoch = 0
        # (forward seconds, when backward starts, samples) of the micro-step being timed
        self._pending: tuple[float, float, int] | None = None
        self._last_gradient_time = 0.0
        self._timing_hooks: list = []
        self._probed_caps: list[int | None] | None = None
        self._token_normaliser = StepTokenNormaliser()  # token-weighted steps (TokenLosses without the callback)
        self._warned_manual = False

    # -- the plan -----------------------------------------------------------------------------
    def _caps(self) -> list[int | None]:
        world = self.world_size
        if self.max_micro_batch == "auto":
            return list(self._probed_caps) if self._probed_caps else [None] * world
        if self.max_micro_batch is None:
            return [None] * world
        if isinstance(self.max_micro_batch, int):
            return [self.max_micro_batch] * world
        if len(self.max_micro_batch) != world:
            raise ValueError(f"max_micro_batch={self.max_micro_batch} has {len(self.max_micro_batch)} entries for {world} ranks")
        return list(self.max_micro_batch)

    def _initial_weights(self) -> list[float]:
        if self.shares == "auto":
            return [1.0] * self.world_size
        if len(self.shares) != self.world_size:
            raise ValueError(f"shares={list(self.shares)} has {len(self.shares)} weights for {self.world_size} ranks")
        return [float(s) for s in self.shares]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return super().process_dataloader(dataloader)
        if isinstance(dataloader.dataset, IterableDataset):
            raise ValueError("hetero_ddp slices a map-style dataset by index; an IterableDataset cannot be split by shares")
        if dataloader.batch_sampler is None:
            raise ValueError(
                "hetero_ddp: the training DataLoader has batch_size=None (no batching: each dataset item is handed "
                "over as it is), but hetero_ddp builds every rank's batches from single samples by their shares. Give "
                "the DataLoader a batch_size (the global batch is batch_size x ranks x accumulate_grad_batches "
                "unless global_batch_size is set) over a dataset of single samples"
            )
        world = self.world_size
        if self.global_batch_size is None and dataloader.batch_size is None:
            raise ValueError(
                "hetero_ddp: the training DataLoader has a batch_sampler and no batch_size, so the global batch is "
                "unknown: set HeterogeneousDDPStrategy(global_batch_size=...) (hetero_ddp replaces the batch sampler)"
            )
        requested = trainer.accumulate_grad_batches
        # by default a step trains what it would under plain DDP: a DataLoader batch per rank and micro-batch
        global_batch = self.global_batch_size or dataloader.batch_size * world * requested
        if self.max_micro_batch == "auto" and self._probed_caps is None:
            self._probed_caps = self._probe_caps(dataloader, global_batch)
        self._plan = plan_shares(global_batch, self._initial_weights(), self._caps(), None if requested == 1 else requested)
        if self._plan.accumulation != requested:
            rank_zero_info(f"hetero_ddp: {self._plan.accumulation} micro-batches per step to respect max_micro_batch")
            trainer.accumulate_grad_batches = self._plan.accumulation
        self._speeds = [1.0] * world if not self._speeds else self._speeds
        self._sampler = HeterogeneousBatchSampler(
            len(dataloader.dataset), global_batch, self.global_rank, self._plan, self.seed, self.shuffle, self.drop_last
        )
        workers = dataloader.num_workers
        self._lookahead = 2 + math.ceil(workers * (dataloader.prefetch_factor or 0) / self._plan.accumulation)
        rank_zero_info(f"hetero_ddp: global batch {global_batch}, shares {list(self._plan.shares)}")
        return _BalancedLoader(
            dataloader.dataset,
            batch_sampler=self._sampler,
            num_workers=workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            worker_init_fn=dataloader.worker_init_fn,
            persistent_workers=dataloader.persistent_workers if workers else False,
            strategy=self,
        )

    def _probe_caps(self, dataloader: DataLoader, global_batch: int) -> list[int | None]:
        """Each rank's largest micro-batch up to the global batch that trains without running out of
        memory (:func:`~lightning_efficient.balance.probe.probe_micro_batch`), all-gathered."""
        mine, failure = None, None
        try:
            mine = probe_micro_batch(self, dataloader, global_batch)
        except Exception as error:  # noqa: BLE001 - every rank learns of it and raises it together
            failure = error
        caps = gather_or_raise_together(mine, failure, "hetero_ddp: max_micro_batch='auto' could not probe")
        rank_zero_info(f"hetero_ddp: probed max_micro_batch per rank: {caps}")
        return caps

    # -- one step -----------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._sampler is None:
            return super().training_step(*args, **kwargs)
        accumulation = self._plan.accumulation
        epoch = self.lightning_module.trainer.current_epoch
        if epoch != self._counter_epoch:  # a new epoch: positions count from its start
            self._counter_epoch, self._micro_done = epoch, 0
        if self._micro_done % accumulation == 0:
            self._maybe_rebalance()
        batch = args[0] if args else kwargs.get("batch")
        first = first_tensor(batch)
        samples = first.shape[0] if first is not None and first.dim() else 1
        self._finish_timing()
        start = self._now()
        output = super().training_step(*args, **kwargs)
        forward_seconds = self._now() - start
        self._micro_done += 1
        scaled = self._scaled(output, samples)  # may all-reduce: not part of the timing
        self._pending = (forward_seconds, self._now(), samples)
        return scaled

    def _now(self) -> float:
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)
        return time.perf_counter()

    def _gradient_accumulated(self, param: Tensor) -> None:
        self._last_gradient_time = time.perf_counter()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._token_normaliser.reset()  # a fit that raised mid-step must not leak its counts into this one
        for handle in self._timing_hooks:
            handle.remove()
        self._timing_hooks = [
            p.register_post_accumulate_grad_hook(self._gradient_accumulated)
            for p in self.lightning_module.parameters()
            if p.requires_grad
        ]

    @override
    def teardown(self) -> None:
        for handle in self._timing_hooks:
            handle.remove()
        self._timing_hooks = []
        super().teardown()

    def _finish_timing(self) -> None:
        """Turn the previous micro-step's compute time (forward, then backward up to its last
        gradient, leaving out the loss all-reduce and DDP's final wait) into a speed."""
        if self._pending is None:
            return
        forward_seconds, backward_start, samples = self._pending
        self._pending = None
        backward_seconds = max(0.0, self._last_gradient_time - backward_start)
        self._observe(samples / max(forward_seconds + backward_seconds, 1e-9))

    def _observe(self, speed: float) -> None:
        previous = self._local_speed
        self._local_speed = speed if previous is None else self.ema_decay * previous + (1 - self.ema_decay) * speed

    def _scaled(self, output: Any, samples: int) -> Any:
        """Scale the local loss so that the step's gradient is the mean over the whole global batch,
        however its samples are split among ranks and micro-batches.

        Lightning divides each micro-batch's loss by the accumulation ``A`` and DDP averages over
        the ``W`` ranks. By samples, each micro-batch loss (a mean over its samples) is multiplied by
        ``samples * W * A / global_batch`` — the plan fixes every size, so no communication. By
        tokens (a :class:`~lightning_efficient.TokenLosses` or :class:`~lightning_efficient.FusedTokenLoss`
        output; any other dict is weighted by samples), the global token count of the step is only known after
        its last micro-batch: :class:`~lightning_efficient.tokens.normalize.StepTokenNormaliser`
        weights each micro-batch's token *sum* by ``W * A / K`` and the gradients by ``K / count``
        once the step's last backward is done (:meth:`optimizer_step`), with one all-reduce a step.
        A :class:`~lightning_efficient.tokens.output.NormalisedTokenLoss` (``SelectiveTokenLoss``'s
        output) is already weighted so by the callback and is left as it is.
        """
        if not self.lightning_module.automatic_optimization:
            if not self._warned_manual:
                rank_zero_warn("hetero_ddp: manual optimization: losses are not re-weighted; scale each rank's loss "
                               "by its share of the global batch yourself (strategy.current_shares).")
                self._warned_manual = True
            return output
        accumulation = self._plan.accumulation
        if isinstance(output, NormalisedTokenLoss):  # SelectiveTokenLoss's normaliser weights it for the step
            return output
        if isinstance(output, Mapping):
            if "loss" not in output:
                return output
            loss = output["loss"]
            if isinstance(output, TokenLosses):  # the exact sum, not one rebuilt from a rounded mean
                return {**output, "loss": self._token_weighted(kept_loss_sum(output.token_losses, output.mask), output.mask.sum())}
            if isinstance(output, FusedTokenLoss):  # its fused mean keeps the gradients the forward computed
                count = output.mask.sum()
                return {**output, "loss": self._token_weighted(loss * count, count)}
        elif isinstance(output, Tensor):
            loss = output
        else:
            return output
        scaled = loss * (samples * self.world_size * accumulation / self._sampler.global_batch)
        return {**output, "loss": scaled} if isinstance(output, Mapping) else scaled

    def _token_weighted(self, local_sum: Tensor, count: Tensor) -> Tensor:
        """This micro-batch's token-loss sum, scaled by ``W * A / K`` (see :meth:`_scaled`)."""
        return self._token_normaliser.micro_batch_loss(local_sum, count, self._plan.accumulation)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step, with token-weighted gradients divided by the step's global token
        count right after its last backward — before gradient clipping and the optimizer see them."""

        def closure_then_normalise() -> Any:
            result = closure()
            self._normalise_token_gradients(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_normalise, model, **kwargs)

    def _normalise_token_gradients(self, optimizer: Any) -> None:
        self._token_normaliser.normalise_gradients(optimizer)

    def _maybe_rebalance(self) -> None:
        step = self.lightning_module.trainer.global_step
        due = step >= self.warmup_steps and (step - self.warmup_steps) % self.rebalance_every == 0
        if self.shares != "auto" or not due or step == self._last_planned_step:
            return
        self._last_planned_step = step
        mine = torch.tensor([self._local_speed or 1.0], dtype=torch.float64, device=self.root_device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        self._speeds = [float(g) for g in gathered]
        current = self._sampler.plan_at(self._micro_done // self._plan.accumulation)
        candidate = plan_shares(self._sampler.global_batch, self._speeds, self._caps(), self._plan.accumulation)
        gain = 1.0 - candidate.step_time(self._speeds) / current.step_time(self._speeds)
        times = [s / v for s, v in zip(current.shares, self._speeds)]
        stats = {f"hetero/share_rank{r}": float(s) for r, s in enumerate(current.shares)}
        stats.update({f"hetero/step_time_rank{r}": t for r, t in enumerate(times)})
        stats["hetero/idle_fraction"] = 1.0 - min(times) / max(times)
        stats["hetero/predicted_gain"] = gain
        self.lightning_module.log_dict(stats, on_step=True, on_epoch=False, rank_zero_only=True)
        if gain > self.hysteresis:
            start = self._micro_done // self._plan.accumulation + self._lookahead
            self._sampler.schedule_plan(candidate, start)
            rank_zero_info(f"hetero_ddp: step {step}: shares {list(current.shares)} -> {list(candidate.shares)} "
                           f"from global batch {start} (predicted gain {gain:.1%})")

    @property
    def sampler(self) -> HeterogeneousBatchSampler | None:
        """The batch sampler installed in the training DataLoader (None before fit sets it up)."""
        return self._sampler

    @property
    def training_epoch(self) -> int:
        """The epoch the training loop runs, or starts next (Lightning's count of processed epochs)."""
        return self.lightning_module.trainer.fit_loop.epoch_progress.current.processed

    def data_state_dict(self) -> dict[str, Any]:
        """The sampler's state at the position trained (not prefetched), with the measured speeds."""
        state = self._sampler.state_dict()
        # the count of micro-batches trained refers to _counter_epoch; once the sampler has started the
        # next epoch (the loader is iterated before that epoch's first step) nothing of it is trained yet
        trained = self._micro_done if self._sampler.epoch == self._counter_epoch else 0
        state["next_batch"] = trained // self._plan.accumulation
        state["speeds"] = list(self._speeds)
        state["step_token_scale"] = self._token_normaliser.scale  # a resumed first step scales as the uninterrupted one
        return state

    def load_data_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler (see :meth:`HeterogeneousBatchSampler.load_state_dict`, also for another
        number of ranks) and, on the same number of ranks, the measured speeds."""
        self._sampler.load_state_dict(state)
        self._micro_done = self._sampler.next_batch * self._plan.accumulation
        speeds = state.get("speeds") or []
        if len(speeds) == self.world_size:
            self._speeds = [float(s) for s in speeds]
        self._counter_epoch = self._sampler.epoch
        self._token_normaliser.scale = state.get("step_token_scale")

    @property
    def micro_batch_caps(self) -> list[int | None]:
        """Each rank's largest micro-batch in force (probed with ``max_micro_batch="auto"``; None: no cap)."""
        return self._caps()

    @property
    def current_shares(self) -> list[int]:
        """The shares in force for the next global batch to train."""
        return list(self._sampler.plan_at(self._micro_done // self._plan.accumulation).shares)

