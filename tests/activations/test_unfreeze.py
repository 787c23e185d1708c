"""``ActivationMemory(policy="auto")`` when the parameters that train change while the fit runs (a ``BaseFinetuning``
callback unfreezing the blocks, which save nothing for backward while frozen): the blocks are profiled and planned again
before the next step, against plain Lightning's same fit."""

from __future__ import annotations

import lightning
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_efficient import ActivationMemory
from lightning_efficient._torch import Trainable
from tests.finetuning import assert_trained_alike, finetune

MiB = 2**20


class AutoPlanPerEpoch(lightning.Callback):
    """The ActivationMemory's plan, plan summary and block profiles at the end of each epoch."""

    def __init__(self, memory: ActivationMemory) -> None:
        self.memory = memory
        self.seen: list = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append((self.memory.plan, self.memory.plan_summary, self.memory.profiles))


def test_auto_profiles_the_blocks_again_when_they_unfreeze_and_keeps_its_budget_then(small_datamodule_kwargs, lightning_caplog):
    _, plain = finetune(small_datamodule_kwargs, [])
    budget = 24 * MiB  # the unfrozen blocks' activations are about 17 MiB each at 8 samples
    memory = ActivationMemory(policy="auto", budget=budget, auto_policies=["keep", "checkpoint"])
    epochs = AutoPlanPerEpoch(memory)
    _, model = finetune(small_datamodule_kwargs, [memory, epochs])
    (frozen, frozen_summary, frozen_profiles), (unfrozen, summary, profiles) = epochs.seen
    # frozen, the blocks saved nothing: every block kept
    assert frozen == ["keep"] * 4 and sum(p.held_bytes["keep"] for p in frozen_profiles) == 0
    assert frozen_summary.baseline_bytes <= budget
    assert "parameters train now" in lightning_caplog.text and "profiling them again" in lightning_caplog.text
    # unfrozen, they were profiled again and the plan keeps the budget
    assert all(p.held_bytes["keep"] > 8 * MiB for p in profiles)
    assert summary.baseline_bytes > budget >= summary.held_bytes and "checkpoint" in unfrozen
    assert memory.state_dict()["trainable"] == list(Trainable.of(model))
    # recomputing a block gives the same numbers on CPU
    assert_trained_alike(model, plain, atol=1e-6)


def test_a_restored_auto_plan_made_for_other_parameters_than_train_is_profiled_again(small_datamodule_kwargs, tmp_path,
                                                                                     lightning_caplog):
    keep_every_epoch = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    budget = 24 * MiB
    finetune(small_datamodule_kwargs, [ActivationMemory(policy="auto", budget=budget), keep_every_epoch], root=tmp_path)
    # epoch 0's plan was profiled with the backbone frozen, epoch 1's after the unfreeze; resumed where nothing unfreezes,
    # the backbone stays frozen (BaseFinetuning freezes it again on a resume)
    for checkpoint, profiled_again in (("epoch=0.ckpt", False), ("epoch=1.ckpt", True)):
        lightning_caplog.clear()
        finetune(small_datamodule_kwargs, [ActivationMemory(policy="auto", budget=budget)], epochs=3, unfreeze_at=5,
                 ckpt_path=str(tmp_path / checkpoint))
        # (the restored line said "not profiled again" before the line saying it was: it says now on what that rests)
        assert "; not profiled again while the parameters that train are those it was profiled with." in lightning_caplog.text
        assert ("profiling them again" in lightning_caplog.text) == profiled_again, checkpoint
