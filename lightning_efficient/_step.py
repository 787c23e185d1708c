"""Running a training step outside Lightning's loop, as the auto planner's profile and the
micro-batch probe do: the same precision context as a real step, nothing logged, and the run's
state (parameters, buffers, metrics' states, optimizer state, random streams) put back afterwards."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor

from lightning_efficient._generators import held_generators_restored
from lightning_efficient._torch import random_streams_restored


@contextlib.contextmanager
def quiet_logging(module: LightningModule) -> Iterator[None]:
    """``module.log`` and ``log_dict`` do nothing inside (outside the loop there is nothing to log to)."""
    saved = {name: vars(module)[name] for name in ("log", "log_dict") if name in vars(module)}
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict
        for name, value in saved.items():
            setattr(module, name, value)


def first_samples_batch(strategy: Any, dataloader: Any, size: int) -> Any:
    """A batch of ``size`` samples from the start of ``dataloader``'s dataset (repeated where it holds fewer), collated
    and on the device, as a measuring step reads it: the random generators the dataset and the collate function hold
    are put back afterwards (:func:`~lightning_efficient._generators.held_generators_restored`)."""
    dataset = dataloader.dataset
    with held_generators_restored(dataset, dataloader.collate_fn):
        batch = dataloader.collate_fn([dataset[i % len(dataset)] for i in range(size)])
    return prepared_as_in_the_loop(strategy, batch)


def prepared_as_in_the_loop(strategy: Any, batch: Any) -> Any:
    """``batch`` as Lightning's training loop hands it to ``training_step``: converted by the precision plugin (float
    inputs to float64 under ``"64-true"``, to bfloat16 under ``"bf16-true"``), through the module's
    ``on_before_batch_transfer``, then moved by the strategy (``transfer_batch_to_device``,
    ``on_after_batch_transfer``). A new user's float32 data under ``"64-true"`` failed measuring without the conversion,
    where plain Lightning trains it."""
    with held_generators_restored(*_batch_hooks_overridden(strategy.lightning_module)):
        batch = strategy.precision_plugin.convert_input(batch)
        batch = strategy.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
        return strategy.batch_to_device(batch, dataloader_idx=0)


_BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def _batch_hooks_overridden(module: LightningModule) -> list[Any]:
    """The batch hooks of ``module`` and its trainer's datamodule that are overridden (bound): a seeded augmentation there
    draws from a generator they hold, which the measured batches must not move (a review: weights 0.056 apart)."""
    datamodule = getattr(getattr(module, "_trainer", None), "datamodule", None)
    return [getattr(owner, hook) for owner in (module, datamodule) if owner is not None for hook in _BATCH_HOOKS
            if is_overridden(hook, owner)]


def draws_its_own_batches(module: LightningModule) -> bool:
    """Whether ``module``'s own ``training_step`` takes ``dataloader_iter`` (Lightning's advanced form: it calls
    ``next`` on the loader itself, and Lightning neither converts nor moves the batches)."""
    return is_param_in_hook_signature(type(module).training_step.__get__(module), "dataloader_iter", explicit=True)


def refuse_a_step_that_draws_its_own_batches(name: str, module: LightningModule, why: str) -> None:
    """Refuse a ``training_step(self, dataloader_iter)`` before the first step, saying ``why`` ``name`` needs each
    batch (a new user's trial: AutoFit and ActivationMemory's planning failed on it with "takes 2 positional arguments
    but 3 were given", and hetero_ddp trained it with a wrong loss weight, silently)."""
    if draws_its_own_batches(module):
        raise ValueError(f"{name}: {type(module).__name__}.training_step(self, dataloader_iter) draws its own batches, "
                         f"{why}. Take them as training_step(self, batch, batch_idx) to use it")


def step_batch_index(trainer: Any, args: tuple, kwargs: dict) -> int:
    """The index in the epoch of the batch a ``training_step`` call trains: its ``batch_idx`` argument, or the loop's
    where the module's ``training_step(self, batch)`` takes none (Lightning then hands it the batch alone; a review:
    a step counted from index 0 at every micro-batch was scaled 1.2-6x under accumulation)."""
    if len(args) > 1:
        return int(args[1])
    if "batch_idx" in kwargs:
        return int(kwargs["batch_idx"])
    return int(trainer.fit_loop.epoch_loop.batch_idx)


# the batch indices a measured step tries past the one it was given where training_step returns None there
SKIPPED_INDICES_TRIED = 16

#: module -> {batch index asked for: the index its training_step trained at instead}, for the modules that skipped one
_TRAINED_AT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_loss(strategy: Any, batch: Any, batch_idx: int = 0, *, class_step: bool = True) -> Tensor:
    """The loss of one ``training_step`` on ``batch``, run as the loop runs it (precision context) but
    outside the loop: nothing is logged.

    A ``training_step(self, batch, batch_idx)`` that returns None (Lightning's way to skip a batch) at ``batch_idx`` is
    called again at the next indices, up to :data:`SKIPPED_INDICES_TRIED` of them: a step that skips every few batches
    by their index is measured on one it trains (a new user's trial: AutoFit failed with "'NoneType' object has no
    attribute 'backward'" where plain Lightning trains). The index found is called at once for ``batch_idx`` from then on
    (:func:`skipped_at`), so that only the first measured call runs the skipped one.

    Args:
        strategy: the trainer's strategy (its precision plugin gives the autocast context).
        batch: a batch already on the device.
        batch_idx: passed to ``training_step``.
        class_step: call the class's ``training_step``, not a plugin's wrapper on the instance, so no
            plugin collective runs on one rank alone.

    Raises:
        RuntimeError: where ``training_step`` returns None for ``batch`` at every index tried.
    """
    module = strategy.lightning_module
    who = "AutoFit, ActivationMemory(policy='auto') or max_micro_batch='auto'"
    refuse_a_step_that_draws_its_own_batches("measuring a step outside the loop", module,
                                             f"and a step measured outside the loop (by {who}) is handed one batch")
    step = type(module).training_step.__get__(module) if class_step else module.training_step
    # as Lightning calls it: a training_step(self, batch) gets the batch alone (a review: measuring refused it)
    takes_index = is_param_in_hook_signature(step, "batch_idx", min_args=2)
    with quiet_logging(module), strategy.precision_plugin.train_step_context():
        if not takes_index:
            output = step(batch)
        else:
            known = _TRAINED_AT.get(module, {})
            first = known.get(batch_idx, batch_idx)
            output = step(batch, first)
            tried = [index for index in range(batch_idx, batch_idx + SKIPPED_INDICES_TRIED) if index != first]
            while output is None and tried:
                index = tried.pop(0)
                output = step(batch, index)
                if output is not None:
                    _TRAINED_AT.setdefault(module, {})[batch_idx] = index
    if output is None:
        tried_at = f"batch_idx {batch_idx} to {batch_idx + SKIPPED_INDICES_TRIED - 1}" if takes_index else "its one call"
        raise RuntimeError(
            f"{type(module).__name__}.training_step returned None (a skipped batch) for the batch measured outside the "
            f"loop, at {tried_at}: {who} measures a step that trains on one batch of your training data. Let "
            "training_step train on it, or leave the measuring plugin out")
    return output["loss"] if isinstance(output, Mapping) else output


def skipped_at(module: LightningModule, batch_idx: int) -> bool:
    """Whether :func:`step_loss` found ``module``'s ``training_step`` skipping ``batch_idx`` (and calls another index for
    it): a measurement whose first call ran the skipped index too (a forward before the skip) is to be made again."""
    return batch_idx in _TRAINED_AT.get(module, {})


def run_state_tensors(module: torch.nn.Module) -> dict[str, Tensor]:
    """What :func:`restored_run_state` copies and puts back by name: every ``state_dict`` entry and the buffers
    registered with ``persistent=False``."""
    tensors = module.state_dict(keep_vars=True)
    return {**tensors, **{name: b for name, b in module.named_buffers() if name not in tensors}}


def _metric_states(module: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    """Every torchmetrics ``Metric`` in ``module`` with a copy of what its updates change: its states (attributes,
    outside ``state_dict`` unless persistent; copied as ``Metric.forward`` copies them), update count and caches."""
    from torchmetrics import Metric

    return [(m, {**m._copy_state_dict(), **{name: getattr(m, name) for name in ("_update_count", "_computed", "_forward_cache")}})
            for m in module.modules() if isinstance(m, Metric)]


@contextlib.contextmanager
def restored_run_state(strategy: Any) -> Iterator[None]:
    """Put the module's parameters and buffers (non-persistent ones too), its torchmetrics metrics' states, the
    optimizers' state and the random streams (torch's, this CUDA device's, Python's and NumPy's) back.

    An optimizer that had state keeps it untouched only if the body does not step it; one that had
    none loses whatever the body created (it is created again at the first real step).
    """
    module = strategy.lightning_module
    # to host memory, pageable and synchronous: 0.18 s a call for the 110M GPT on an H200 (a third of AutoFit's planning
    # there), but pinned copies would stay in torch's pinned-memory cache, up to twice the model's state, for the process
    saved_tensors = {name: t.detach().to("cpu", copy=True) for name, t in run_state_tensors(module).items()}
    metrics = _metric_states(module)
    had_state = [len(optimizer.state) > 0 for optimizer in strategy.optimizers]
    with random_streams_restored(strategy.root_device):  # (torch's, Python's and NumPy's: a review, the probe's)
        try:
            yield
        finally:
            module.zero_grad(set_to_none=True)
            for optimizer, had in zip(strategy.optimizers, had_state):
                if not had:
                    optimizer.state.clear()
            with torch.no_grad():
                for name, tensor in run_state_tensors(module).items():
                    tensor.copy_(saved_tensors[name])
            for metric, values in metrics:
                for name, value in values.items():
                    setattr(metric, name, value)
            if strategy.root_device.type == "cuda":
                torch.cuda.empty_cache()
