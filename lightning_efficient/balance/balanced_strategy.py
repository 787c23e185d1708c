"""The mixin that routes a Lightning data-parallel strategy's hooks to its :class:`~lightning_efficient.balance.balancer.Balancer`
(``hetero_ddp`` and ``hetero_fsdp`` are each a Lightning strategy with it in front), and the launchers that check the
balancer's per-rank settings before a fit's processes start."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_efficient._distributed import (
    destroy_process_group_at_exit,
    waiting_for_other_ranks,
)
from lightning_efficient._step import refuse_a_step_that_draws_its_own_batches
from lightning_efficient.balance.balancer import SETTINGS, Balancer
from lightning_efficient.balance.sampler import HeterogeneousBatchSampler


def _setting(name: str) -> property:
    def get(self: BalancedStrategy) -> Any:
        return getattr(self.balancer, name)

    def set(self: BalancedStrategy, value: Any) -> None:
        self.balancer.set_setting(name, value)

    return property(get, set, doc=f"The balancer's ``{name}`` (settable: validated as by the constructor).")


class _ChecksPerRankSettingsBeforeAFit:
    """A launcher that checks the strategy's per-rank settings before it launches a fit."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            strategy = trainer.strategy
            strategy.balancer.check_per_rank_settings(strategy.num_nodes * strategy.num_processes)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class _FitCheckedSubprocessScriptLauncher(_ChecksPerRankSettingsBeforeAFit, _SubprocessScriptLauncher):
    """Lightning's subprocess launcher, checking per-rank settings before a fit."""


class _FitCheckedMultiProcessingLauncher(_ChecksPerRankSettingsBeforeAFit, _MultiProcessingLauncher):
    """Lightning's multiprocessing (spawn) launcher, checking per-rank settings before a fit."""


_FIT_CHECKED_LAUNCHERS: dict[type, type] = {_SubprocessScriptLauncher: _FitCheckedSubprocessScriptLauncher,
                                            _MultiProcessingLauncher: _FitCheckedMultiProcessingLauncher}


class BalancedStrategy:
    """Mixin routing a Lightning data-parallel strategy's hooks to its :class:`Balancer`.

    Put it before the Lightning strategy class (``class S(BalancedStrategy, DDPStrategy)``) and set
    ``self.balancer`` in ``__init__``. The constructor settings read and write through to the balancer
    (``strategy.shares = [3.0, 1.0]``, ``strategy.global_batch_size``, ...; a new value is validated as
    by the constructor).
    """

    balancer: Balancer

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader re-built on the balanced batch sampler (others as the strategy does)."""
        self.balancer.bind(self)
        balanced = self.balancer.process_dataloader(dataloader)
        return super().process_dataloader(dataloader) if balanced is None else balanced

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The strategy's step, timed, with the loss weighted for the global batch."""
        return self.balancer.training_step(super().training_step, *args, **kwargs)

    def _configure_launcher(self) -> None:
        """The strategy's launcher, whose ``fit`` launches first check the per-rank settings against the number of
        ranks: a ``shares`` list of the wrong length is refused once, before any process is launched, not by every rank
        after the launch (validate, test and predict, which do not share batches, are not refused)."""
        super()._configure_launcher()  # type: ignore[misc]
        checked = _FIT_CHECKED_LAUNCHERS.get(type(self._launcher))
        if checked is not None:  # (a class of this module's, not a closure: ddp_spawn pickles the launcher)
            launcher = checked.__new__(checked)
            vars(launcher).update(vars(self._launcher))
            self._launcher = launcher

    def setup_environment(self) -> None:
        """The strategy's environment, then the same intra-op thread count on every rank.

        Lightning's launcher sets ``torch.set_num_threads(cpus // processes)`` in the process that
        launches the others only; the ranks it starts keep torch's default (every core), so on CPU
        they oversubscribe the cores and run several times slower than rank 0 — measured speeds
        would then follow the thread counts, not the hardware. Without ``OMP_NUM_THREADS`` set, every
        rank here gets the launching process's count (a no-op where it already has it). The process group is destroyed
        at exit (:func:`~lightning_efficient._distributed.destroy_process_group_at_exit`)."""
        super().setup_environment()
        destroy_process_group_at_exit()
        _set_num_threads_if_needed(num_processes=self.num_processes)

    def setup(self, trainer: Any) -> None:
        """The strategy's setup, then the balancer's (timing hooks, a fresh token count). The position in the epoch
        is forgotten first: ``configure_optimizers`` reading ``trainer.estimated_stepping_batches`` iterates the
        training DataLoader within the strategy's setup (a second review: after a fit that raised, the next trained
        10 of 22 samples)."""
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_a_step_that_draws_its_own_batches(self.balancer.name, trainer.lightning_module,
                                                     "so the strategy can neither hand each rank its share of the global "
                                                     "batch nor weigh its loss by it")
        self.balancer.forget_position(trainer.current_epoch)
        super().setup(trainer)
        self.balancer.bind(self)
        self.balancer.setup()

    def on_train_start(self) -> None:
        """The strategy's, then the checkpoint's data position where Lightning left it unread
        (:meth:`Balancer.load_pending_data_state`); the resumed step will count as saved
        (:class:`~lightning_efficient._batch_counts.ResumedStepSaved`)."""
        super().on_train_start()
        self.balancer.load_pending_data_state()
        self.balancer.resumed_step_saved.fit_started()

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """The strategy's reduction (``self.log(..., sync_dist=True)`` calls it), as a wait for the other ranks: one in
        ``training_step`` waits there for the slowest rank, which is not this rank's compute (every rank would read the
        slowest one's speed). A mean reduced within ``training_step`` weighs each rank's value by its samples in the
        micro-batch, as plain DDP's equal micro-batches weigh them (a new user's trial: a logged step loss 71.9 for plain
        DDP's 88.0 at shares 5:3)."""
        with waiting_for_other_ranks():
            samples = self.balancer.logging_samples
            is_mean = (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")) or reduce_op == ReduceOp.AVG
            if samples is None or not is_mean or not isinstance(tensor, Tensor) or self.world_size == 1:
                return super().reduce(tensor, group=group, reduce_op=reduce_op)
            # one all-reduce of the weighted values and the weight, in float64 (a half-precision product overflows)
            value = tensor.to(torch.float64)
            summed = super().reduce(torch.cat([value.reshape(-1) * samples, value.new_full((1,), samples)]), group=group, reduce_op="sum")
            mean = (summed[:-1] / summed[-1]).reshape(tensor.shape)
            return mean.to(tensor.dtype if tensor.is_floating_point() else torch.get_default_dtype())

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """The strategy's gather (``self.all_gather``), as a wait for the other ranks (see :meth:`reduce`)."""
        with waiting_for_other_ranks():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """The strategy's barrier, as a wait for the other ranks (see :meth:`reduce`)."""
        with waiting_for_other_ranks():
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """The strategy's broadcast, as a wait for the other ranks (see :meth:`reduce`)."""
        with waiting_for_other_ranks():
            return super().broadcast(obj, src)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The strategy's backward, the collectives it calls through ``torch.distributed`` timed as waits for the other
        ranks (see :meth:`reduce`; SyncBatchNorm all-reduces in its backward)."""
        with self.balancer.backward_waits_marked():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The strategy's, then the scheduler frequencies Lightning tests after this micro-batch
        (:class:`~lightning_efficient._batch_counts.SchedulerFrequencies`)."""
        super().on_train_batch_start(batch, batch_idx)
        self.balancer.build_evaluation_loaders_again_if_the_cap_changed(self.lightning_module.trainer)
        self.balancer.scheduler_frequencies.before_batch(self.lightning_module.trainer, batch_idx)
        self.balancer.resumed_step_saved.before_batch(self.lightning_module.trainer)

    def on_validation_start(self) -> None:
        """The strategy's; the validation DataLoaders processed so far are one set (:class:`EvaluationCounts`)."""
        super().on_validation_start()
        self.balancer.evaluation_counts.setup_ran()

    def on_test_start(self) -> None:
        """The strategy's; the test DataLoaders processed so far are one set (:class:`EvaluationCounts`)."""
        super().on_test_start()
        self.balancer.evaluation_counts.setup_ran()

    def teardown(self) -> None:
        """Remove the timing hooks, put back the trainer's ``accumulate_grad_batches``, then the strategy's teardown."""
        self.balancer.remove_hooks()
        self.balancer.restore_trainer()
        super().teardown()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step, with token-weighted gradients divided by the step's global token
        count right after its last backward — before gradient clipping and the optimizer see them."""

        def closure_then_normalise() -> Any:
            result = closure()
            self.balancer.normalise_gradients(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_normalise, model, **kwargs)

    @property
    def sampler(self) -> HeterogeneousBatchSampler | None:
        """The batch sampler installed in the training DataLoader (None before fit sets it up)."""
        return self.balancer.sampler

    @property
    def training_epoch(self) -> int:
        """The epoch the training loop runs, or starts next (Lightning's count of processed epochs)."""
        return self.balancer.training_epoch

    def data_state_dict(self) -> dict[str, Any]:
        """The sampler's state at the position trained (not prefetched), with the measured speeds."""
        return self.balancer.data_state_dict()

    def load_data_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler (see :meth:`HeterogeneousBatchSampler.load_state_dict`, also for another
        number of ranks) and, on the same number of ranks, the measured speeds."""
        self.balancer.load_data_state_dict(state)

    @property
    def micro_batch_caps(self) -> list[int | None]:
        """Each rank's largest micro-batch in force (probed with ``max_micro_batch="auto"``; None: no cap)."""
        return self.balancer.caps()

    @property
    def current_shares(self) -> list[int]:
        """The shares in force for the next global batch to train."""
        return self.balancer.current_shares

    def gradient_sync_off(self) -> Any:
        """A context in which backward accumulates gradients locally, without the data-parallel
        reduction (the micro-batch probe runs its steps inside it)."""
        raise NotImplementedError


for _name in SETTINGS:
    setattr(BalancedStrategy, _name, _setting(_name))
del _name
