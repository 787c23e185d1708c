"""AutoFit when the parameters that train change while the fit runs (a ``BaseFinetuning`` callback unfreezing a
backbone): measured and planned again before the next step, against plain Lightning's same fit."""

from __future__ import annotations

import json
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_efficient import ActivationMemory, AutoFit
from lightning_efficient.autofit.model import replan
from tests.ddp import run_script
from tests.finetuning import Unfreeze, assert_trained_alike, finetune

MiB = 2**20


class PlanPerEpoch(lightning.Callback):
    """AutoFit's plan at the end of each epoch, and the block policies of the ActivationMemory in the fit then."""

    def __init__(self, fit: AutoFit) -> None:
        self.fit = fit
        self.plans: list = []
        self.applied: list = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.plans.append(self.fit.plan)
        memory = next((c for c in trainer.callbacks if isinstance(c, ActivationMemory)), None)
        self.applied.append(None if memory is None else list(memory.plan))


@pytest.fixture(scope="module")
def plain(small_datamodule_kwargs):
    return finetune(small_datamodule_kwargs, [])[1]


@pytest.fixture(scope="module")
def unbounded(small_datamodule_kwargs):
    """A budget every plan fits: the AutoFit, its plans before and after the unfreeze, the fit's module."""
    fit = AutoFit(budget="8GiB", search_micro_batch=False, optimizer_options=["32-bit"], report_after_steps=1)
    seen = PlanPerEpoch(fit)
    _, model = finetune(small_datamodule_kwargs, [fit, seen])
    return fit, seen, model


def test_layers_unfrozen_while_the_fit_runs_are_measured_and_planned_for_and_the_fit_trains_as_plain_lightning(plain, unbounded):
    fit, seen, model = unbounded
    before, after = seen.plans
    assert after is not before and after.notes[-1].startswith("measured and planned again at step 3:")
    assert not any(n.startswith("blocks not profiled") for n in after.notes)  # profiled when measured again
    # the backbone's gradients and AdamW's two states (4 bytes each an element) were not in the first plan
    unfrozen = sum(p.numel() for m in Unfreeze.backbone(model) for p in m.parameters())
    assert after.ranks[0].peak_bytes - before.ranks[0].peak_bytes >= 3 * 4 * unfrozen
    # the measured figures are read again for the plan made after the unfreeze, and it predicts them (the first plan
    # was a third of them; RSS readings inside a test process spread by about 10%)
    figures = fit.memory_figures()
    assert figures["autofit_predicted_peak_bytes"] == after.ranks[0].peak_bytes
    assert abs(figures["autofit_measured_peak_bytes"] / after.ranks[0].peak_bytes - 1) < 0.25
    assert figures["autofit_measured_peak_bytes"] > 2 * before.ranks[0].peak_bytes
    # measuring left nothing behind: the same parameters as plain Lightning's fit, to the bit
    assert_trained_alike(model, plain)
    assert fit.state_dict()["trainable"] == [sum(1 for _ in model.parameters()), sum(p.numel() for p in model.parameters())]


def test_a_budget_every_frozen_block_kept_fits_gets_block_policies_when_the_blocks_unfreeze(small_datamodule_kwargs, plain, unbounded):
    profiles = unbounded[0].profiles  # measured after the unfreeze, blocks profiled
    after = unbounded[1].plans[1]
    every_block_kept = after.ranks[0].peak_bytes
    leanest = replan(after, profiles, margin=0.1, policies=("keep", "checkpoint"), leanest=True).ranks[0].peak_bytes
    assert every_block_kept - leanest > 40 * MiB  # room for a budget between them far from either
    budget = int((every_block_kept + leanest) / 2 / 0.9)
    # (on CPU, moving a block to disk or recomputing part of it saves less RSS than the saved-tensor bytes planned from)
    fit = AutoFit(budget=budget, search_micro_batch=False, optimizer_options=["32-bit"], activation_policies=["keep", "checkpoint"],
                  report_after_steps=1)
    seen = PlanPerEpoch(fit)
    _, model = finetune(small_datamodule_kwargs, [fit, seen])
    before, after = seen.plans
    assert all(p == "keep" for p in before.ranks[0].policies) and seen.applied[0] in (None, ["keep"] * 4)
    assert any(p != "keep" for p in after.ranks[0].policies)
    assert seen.applied[1] == after.ranks[0].policies  # applied from the first step after the unfreeze
    assert after.ranks[0].peak_bytes <= budget * 0.9
    assert fit.memory_figures()["autofit_measured_peak_bytes"] <= budget
    # recomputing a block gives the same numbers on CPU
    assert_trained_alike(model, plain, atol=1e-6)


def test_a_set_frozen_and_unfrozen_in_turn_is_measured_once(small_datamodule_kwargs, lightning_caplog):
    fit = AutoFit(budget="8GiB", search_micro_batch=False, optimizer_options=["32-bit"], activation_policies=["keep"])
    seen = PlanPerEpoch(fit)
    finetune(small_datamodule_kwargs, [fit, seen], epochs=4, refreeze_at=2)
    frozen, unfrozen, frozen_again, unfrozen_again = seen.plans
    assert frozen_again is frozen and unfrozen_again is unfrozen and unfrozen is not frozen
    assert lightning_caplog.text.count("parameters train now") == 1


def test_a_resume_measures_again_where_its_plan_was_made_for_other_parameters_than_train(small_datamodule_kwargs, tmp_path,
                                                                                       lightning_caplog):
    keep_every_epoch = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    finetune(small_datamodule_kwargs, [AutoFit(budget="8GiB", search_micro_batch=False), keep_every_epoch], root=tmp_path)
    # epoch 0's checkpoint holds the plan made for the frozen backbone, epoch 1's the one made after the unfreeze; resumed
    # where nothing unfreezes, the backbone stays frozen (BaseFinetuning freezes it again on a resume, in plain Lightning too)
    for checkpoint, measured_again in (("epoch=0.ckpt", False), ("epoch=1.ckpt", True)):
        lightning_caplog.clear()
        finetune(small_datamodule_kwargs, [AutoFit(budget="8GiB", search_micro_batch=False)], epochs=3, unfreeze_at=5,
                  ckpt_path=str(tmp_path / checkpoint))
        assert "the checkpoint's plan is reused" in lightning_caplog.text
        assert ("65,792 parameters train now" in lightning_caplog.text) == measured_again, checkpoint


@pytest.mark.parametrize("mode", ["ddp", "hetero_ddp", "fsdp2"])
def test_under_data_parallelism_every_rank_plans_again_alike_and_trains_as_plain_lightning(small_datamodule_kwargs, tmp_path, mode):
    run_script(Path(__file__).with_name("ddp_unfreeze.py"), tmp_path, mode, json.dumps(small_datamodule_kwargs), timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in ranks:
        before, after = rank["plans"]
        assert after["notes"][-1].startswith("measured and planned again at step 3:") and before != after
        assert after["ranks"][0]["peak_bytes"] > before["ranks"][0]["peak_bytes"]
        for name, value in rank["plain"].items():
            torch.testing.assert_close(rank["autofit"][name], value, rtol=0, atol=0, msg=name)
    assert ranks[0]["plans"] == ranks[1]["plans"]  # every rank's plan alike, from every rank's measured figures
