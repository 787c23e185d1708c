"""ActivationMemory(policy="auto") restores its plan under strategies that load the checkpoint after
``on_fit_start`` (``restore_checkpoint_after_setup=True``: ModelParallelStrategy, hetero_fsdp)."""

from __future__ import annotations

import logging

import lightning
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_efficient import ActivationMemory, DemoGPT
from tests.activations.script_data import Rows
from tests.conftest import tiny_gpt_kwargs


class _RestoreAfterSetup(SingleDeviceStrategy):
    """One CPU device, restoring the checkpoint after setup and ``on_fit_start``, as ModelParallelStrategy does."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def _fit(callback, steps, ckpt_path=None, strategy=None):
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
        strategy=strategy or _RestoreAfterSetup(torch.device("cpu")),
    )
    trainer.fit(DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 3}), torch.utils.data.DataLoader(Rows(), batch_size=4),
                ckpt_path=ckpt_path)
    return trainer


def _auto():
    return ActivationMemory(policy="auto", budget=0.5, auto_policies=["keep", "selective", "checkpoint"])


def test_auto_plan_is_restored_when_the_checkpoint_loads_after_on_fit_start(tmp_path, lightning_caplog):
    lightning.seed_everything(0)
    first = _auto()
    trainer = _fit(first, steps=1)
    plan, summary = first.plan, first.plan_summary
    assert plan is not None and first.profiles != []
    path = tmp_path / "auto.ckpt"
    trainer.save_checkpoint(path)

    resumed = _auto()
    with lightning_caplog.at_level(logging.INFO):
        _fit(resumed, steps=2, ckpt_path=path)
    assert "the checkpoint's auto plan is restored" in lightning_caplog.text
    assert resumed.plan == plan and resumed.profiles == [] and resumed.plan_summary == summary  # not profiled again

    # the same callback in a later fit without a checkpoint plans afresh: nothing of the restored state lingers
    lightning_caplog.clear()
    with lightning_caplog.at_level(logging.INFO):
        _fit(resumed, steps=1)
    assert resumed.profiles != [] and "restored" not in lightning_caplog.text
