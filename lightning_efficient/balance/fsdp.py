"""``HeterogeneousFSDPStrategy`` (``"hetero_fsdp"``): FSDP2 with per-rank batch shares sized to speed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_efficient._validation import require
from lightning_efficient.balance.balanced_strategy import BalancedStrategy
from lightning_efficient.balance.balancer import Balancer

_NO_PROBE = ("an int, a list of ints or None under hetero_fsdp ('auto' probes each rank alone until it runs out of "
             "memory, and FSDP2's all-gathers need every rank in every forward and backward: a rank that ran out of "
             "memory mid-step would leave the others waiting)")


class HeterogeneousFSDPStrategy(BalancedStrategy, ModelParallelStrategy):
    """FSDP2 (Lightning's ``ModelParallelStrategy``) where each rank's share of every global batch
    follows its measured speed — the balancing of :class:`~lightning_efficient.HeterogeneousDDPStrategy`
    (the same :class:`~lightning_efficient.balance.balancer.Balancer`: share planner, exactly-once
    sampler, loss weighting by samples or tokens, re-balancing) for models sharded with ``fully_shard``.

    The module shards itself in ``configure_model`` as under ``ModelParallelStrategy``
    (``fully_shard(block, mesh=self.device_mesh["data_parallel"])`` per block, then the root). FSDP2's
    reduce-scatter averages gradients over the data-parallel ranks as DDP's all-reduce does, so each
    rank's loss is weighted exactly as under ``hetero_ddp`` and the update is the gradient of the
    whole global batch, however it is split among ranks and micro-batches.

    Speed: under FSDP2 every rank waits for the others in each block's all-gather, so wall-clock step
    time is the same on every rank whatever its speed. A rank's speed is therefore its samples per
    second of forward *compute*: ``training_step`` less the time spent in FSDP2's pre-forward hooks
    (the all-gather waits), read from device-timeline marks one micro-step later (no synchronisation).
    The backward is not timed: it is assumed to take the same multiple of the forward on every rank.
    That holds when every rank trains the same model the same way; it does not when ranks recompute
    different parts of the backward, e.g. ``ActivationMemory("auto")`` picking a different plan per
    rank (a rank that checkpoints more runs a longer backward than its forward speed predicts, so it
    is given too large a share). Use one fixed ``ActivationMemory`` policy for every rank, or fixed
    ``shares``, in that case.

    Args:
        global_batch_size: samples per optimizer step over all data-parallel ranks (None: the
            DataLoader's batch size times the ranks times ``accumulate_grad_batches``).
        shares: ``"auto"`` (measured) or fixed positive weights, one per rank.
        max_micro_batch: the largest micro-batch per rank (an int for all, a list with None for a rank without a
            cap, or None for no cap); larger shares are split with gradient accumulation. ``"auto"`` (the memory probe of
            ``hetero_ddp``) is refused: the probe trains each rank alone until it runs out of memory,
            and under FSDP2 every forward and backward all-gathers parameters with every rank, so a
            rank that ran out of memory mid-step would leave the others waiting in a collective.
        rebalance_every: optimizer steps between re-plans (>= 1).
        warmup_steps: steps measured before the first plan (>= 1).
        hysteresis: the least predicted gain (fraction of step time) that changes the shares.
        ema_decay: weight of the previous speed estimate in the moving average, in [0, 1).
        seed: seed of the per-epoch sample order.
        shuffle: shuffle the training samples each epoch.
        drop_last: drop the last incomplete global batch.
        data_parallel_size: ranks that shard the model and share the global batch (``"auto"``: all).
        tensor_parallel_size: must be 1 — the ranks of a tensor-parallel group must all see the same
            batch, so shares would have to be given per group, which this strategy does not do.
        **kwargs: passed on to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    Raises:
        ValueError: naming the argument for invalid settings (also ``max_micro_batch="auto"`` and a
            ``tensor_parallel_size`` other than 1); before the first step of ``fit`` (not
            ``validate``/``test``/``predict``), for a trainable parameter that ``fully_shard`` does not
            manage — a plain tensor, or a DTensor not sharded over the data-parallel ranks (its
            gradient would not be averaged over the ranks, so they would silently train apart), and for what ``hetero_ddp`` refuses there (shares of
            the wrong length, a global batch smaller than the ranks, a DataLoader without batching).
    """

    strategy_name = "hetero_fsdp"

    def __init__(
        self,
        global_batch_size: int | None = None,
        shares: Literal["auto"] | list[float] = "auto",
        max_micro_batch: int | list[int | None] | None = None,
        rebalance_every: int = 50,
        warmup_steps: int = 10,
        hysteresis: float = 0.05,
        ema_decay: float = 0.7,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        require(max_micro_batch != "auto", "max_micro_batch", max_micro_batch, _NO_PROBE)
        require(
            isinstance(tensor_parallel_size, int) and not isinstance(tensor_parallel_size, bool)
            and tensor_parallel_size == 1, "tensor_parallel_size", tensor_parallel_size,
            "1 under hetero_fsdp (the ranks of a tensor-parallel group must see the same batch, so shares would "
            "have to be per group; use ModelParallelStrategy for tensor parallelism)",
        )
        require(
            data_parallel_size == "auto" or (isinstance(data_parallel_size, int) and not isinstance(data_parallel_size, bool)
                                             and data_parallel_size >= 1),
            "data_parallel_size", data_parallel_size, "'auto' (every rank) or an integer >= 1",
        )
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.balancer = Balancer(
            self.strategy_name, global_batch_size, shares, max_micro_batch, rebalance_every, warmup_steps,
            hysteresis, ema_decay, seed, shuffle, drop_last,
        )
        self.balancer.time_backward = False  # FSDP2's reduce-scatter ends backward in step on every rank
        self.balancer.probe_refusal = _NO_PROBE  # also when set later (strategy.max_micro_batch = "auto")
        self.balancer.bind(self)

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # ModelParallelStrategy's "auto" is the number of nodes
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # validate/test/predict compute no gradients to average
            self._refuse_unsharded_parameters()
        from torch.distributed.fsdp import FSDPModule

        handles = []
        for module in self.lightning_module.modules():
            if isinstance(module, FSDPModule):  # around FSDP2's own pre-forward hook: its all-gather wait
                handles.append(module.register_forward_pre_hook(self.balancer.wait_started, prepend=True))
                handles.append(module.register_forward_pre_hook(self.balancer.wait_ended))
        self.balancer.add_hooks(handles)

    def _refuse_unsharded_parameters(self) -> None:
        """Refuse trainable parameters that no ``fully_shard`` manages: ``ModelParallelStrategy`` trains
        them, but their gradients are never averaged over the ranks, so each rank trains its own copy.

        Between steps every parameter ``fully_shard`` manages is a DTensor sharded (``Shard``) over the
        data-parallel ranks; a plain tensor, or a DTensor that is replicated over them (``Replicate``,
        e.g. one made with ``distribute_tensor``), is not managed and is refused."""
        world = self.balancer.world
        loose = [name for name, p in self.lightning_module.named_parameters()
                 if p.requires_grad and not _sharded_over(p, world)]
        if loose and world > 1:
            shown = ", ".join(loose[:5]) + (f" and {len(loose) - 5} more" if len(loose) > 5 else "")
            raise ValueError(
                f"hetero_fsdp: {len(loose)} trainable parameter(s) are not sharded by fully_shard over the "
                f"{world} data-parallel ranks ({shown}): their gradients would not be averaged, so each rank "
                "would train its own copy. In configure_model, call fully_shard(block, mesh=self.device_mesh"
                "['data_parallel']) on each block and then on the root module (it takes every parameter left)"
            )

    @override
    def gradient_sync_off(self) -> Any:
        """FSDP2's ``set_requires_gradient_sync(False)`` on every FSDP module (no reduce-scatter)."""
        return _fsdp_sync_off(self.lightning_module)


def _sharded_over(param: Any, world: int) -> bool:
    """Whether ``param`` is a DTensor sharded (some ``Shard`` placement) over a mesh of ``world`` ranks,
    as ``fully_shard`` leaves the parameters it manages between steps."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(param, DTensor) and param.device_mesh.size() == world
            and any(isinstance(placement, Shard) for placement in param.placements))


@contextlib.contextmanager
def _fsdp_sync_off(module: Any) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)
