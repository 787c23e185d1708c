"""Validation and test under AutoFit's plan: at your batches, in chunks of the plan's micro-batch.

AutoFit draws its micro-batches by setting ``batch_size``; a validation or test DataLoader that reads it too is built at
the micro-batch, so Lightning's integer ``limit_val_batches`` / ``limit_test_batches`` and ``num_sanity_val_steps``
counted micro-batches (a new user's trial: ``limit_val_batches=1`` validated 2 samples where plain Lightning validates 8,
and the monitored ``val_loss`` differed). While AutoFit's plan splits your batch, such a DataLoader is batched at your
batch size again and each batch split into chunks of at most the micro-batch (the same samples in the same order,
each chunk within the plan's memory), and Lightning's counts count those chunks of the batches they count without
AutoFit (:mod:`~lightning_efficient.balance.evaluation`, what the heterogeneous strategies do under their caps).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage

from lightning_efficient._instance_wrappers import InstanceWrapper, put_back
from lightning_efficient.balance.evaluation import EvaluationCounts, evaluation_loader_at

_EVALUATING = (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING)


class EvaluationAtYourBatch:
    """Wraps a fit's strategy's ``process_dataloader`` so that validation and test DataLoaders built at the plan's
    micro-batch run your batches in chunks of it (see the module docstring)."""

    def __init__(self) -> None:
        self.counts = EvaluationCounts()
        self._strategy: Any = None
        self._wrapper: InstanceWrapper | None = None
        self._live = {"on": False}
        self._sizes: dict[str, int] = {}

    def install(self, trainer: Trainer, batch: int, micro: int) -> None:
        """Re-batch the evaluation DataLoaders built at ``micro`` at ``batch`` (yours) from now on, until :meth:`remove`;
        a second call (a plan made again) changes the sizes for the DataLoaders built next."""
        self._sizes = {"batch": batch, "micro": micro}
        if self._wrapper is not None and self._strategy is trainer.strategy:
            return
        self.remove()
        strategy = trainer.strategy
        original = strategy.process_dataloader
        self._live = live = {"on": True}

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            stage = trainer.state.stage
            if not live["on"] or stage not in _EVALUATING:
                return dataloader
            loader, chunked = evaluation_loader_at(dataloader, self._sizes["batch"], self._sizes["micro"]) or (None, None)
            self.counts.loader_processed(trainer, stage, chunked)
            return dataloader if loader is None else loader

        self._wrapper = InstanceWrapper(process_dataloader, original)
        strategy.process_dataloader = self._wrapper
        self._strategy = strategy

    def evaluation_started(self) -> None:
        """The evaluation DataLoaders processed so far run now: the next ones are another set (a validation or a test's)."""
        self.counts.setup_ran()

    def remove(self) -> None:
        """Put the strategy's ``process_dataloader`` back (where ours is still the outermost; else ours passes every call
        through from now on) and your evaluation counts."""
        self._live["on"] = False
        strategy, self._strategy = self._strategy, None
        if strategy is not None and vars(strategy).get("process_dataloader") is self._wrapper:
            put_back(strategy, "process_dataloader", self._wrapper.__wrapped__)
        self._wrapper = None
        self.counts.put_back()
