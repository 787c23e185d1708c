"""`lightning-efficient plan`'s whole config (`cli.planned_config`): the run's config with the plan's settings in place."""

from __future__ import annotations

import types

import pytest
import torch

from lightning_efficient import AutoFit
from lightning_efficient.autofit.model import FitPlan, RankChoice
from lightning_efficient.cli import plan_yaml, planned_config, why_autofit_stays


class Module(torch.nn.Module):
    def __init__(self, batch_size: int = 16, width: int = 8) -> None:
        super().__init__()


class AttributeOnly(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.batch_size = 16


class Hetero:
    """Stands for a strategy class named by a string in the config."""


def trainer(module=None, strategy=None):
    return types.SimpleNamespace(lightning_module=module or Module(), datamodule=None, strategy=strategy or Hetero())


AUTOFIT = {"class_path": "lightning_efficient.AutoFit", "init_args": {"budget": "1GiB", "activation_policies": ["keep", "checkpoint"]}}
CHECKPOINTING = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}


def test_autofit_gives_way_to_the_plans_callbacks_and_the_others_stay():
    config = {"config": ["run.yaml"], "seed_everything": 3,
              "trainer": {"callbacks": [CHECKPOINTING, AUTOFIT], "max_steps": 5},
              "model": {"class_path": "x.Module", "init_args": {"width": 4}}}
    settings = {"trainer": {"accumulate_grad_batches": 4, "callbacks": [
        {"class_path": "lightning_efficient.ActivationMemory", "init_args": {"policy": ["checkpoint", "keep"]}}]},
        "model": {"init_args": {"batch_size": 4}}}
    whole = planned_config(config, settings, trainer())
    assert "config" not in whole and whole["seed_everything"] == 3
    assert whole["trainer"]["callbacks"] == [CHECKPOINTING, settings["trainer"]["callbacks"][0]]
    assert whole["trainer"]["accumulate_grad_batches"] == 4 and whole["trainer"]["max_steps"] == 5
    assert whole["model"] == {"class_path": "x.Module", "init_args": {"width": 4, "batch_size": 4}}


def test_a_single_callback_mapping_and_a_users_activation_memory_keep_their_own_arguments():
    mine = {"class_path": "lightning_efficient.ActivationMemory", "init_args": {"policy": "checkpoint", "blocks": ["layers.0", "layers.1"],
                                                                              "offload_dir": "/scratch"}}
    planned = {"class_path": "lightning_efficient.ActivationMemory", "init_args": {"policy": ["checkpoint", "checkpoint"]}}
    for callbacks in (mine, [mine, AUTOFIT]):
        whole = planned_config({"trainer": {"callbacks": callbacks}}, {"trainer": {"callbacks": [planned]}}, trainer())
        (only,) = whole["trainer"]["callbacks"]
        assert only["init_args"] == {"policy": "checkpoint", "blocks": ["layers.0", "layers.1"], "offload_dir": "/scratch"}


def test_where_ranks_plan_differently_the_configs_autofit_stays_with_its_options_and_a_named_strategy_gets_the_caps():
    settings = {"trainer": {"callbacks": [{"class_path": "lightning_efficient.AutoFit", "init_args": {"budget": [2**30, 2**31], "margin": 0.1}}],
                            "strategy": {"init_args": {"max_micro_batch": [8, 4]}}}}
    # (a config's plan_only is left out: the config printed is one to fit with; a review)
    planning = {**AUTOFIT, "init_args": {**AUTOFIT["init_args"], "plan_only": True}}
    whole = planned_config({"trainer": {"callbacks": [planning], "strategy": "hetero"}}, settings, trainer())
    (autofit,) = whole["trainer"]["callbacks"]
    assert autofit["init_args"] == {"budget": [2**30, 2**31], "margin": 0.1, "activation_policies": ["keep", "checkpoint"]}
    assert whole["trainer"]["strategy"] == {"class_path": f"{__name__}.Hetero", "init_args": {"max_micro_batch": [8, 4]}}


def test_a_micro_batch_no_constructor_argument_sets_is_refused():
    with pytest.raises(ValueError, match="no batch_size argument"):
        planned_config({"trainer": {}}, {"trainer": {"accumulate_grad_batches": 2}, "model": {"init_args": {"batch_size": 8}}},
                       trainer(AttributeOnly()))


def _plan(*policies: list[str]) -> FitPlan:
    ranks = [RankChoice(4, list(p), 10, 0.1, 0.2) for p in policies]
    return FitPlan("32-bit", ranks, 2, 0.2, 1000.0, 8 * len(ranks), 0.1, [100] * len(ranks))


def test_the_printed_config_says_why_it_keeps_autofit():
    # a new user's trial: the ranks planned "2 selective" and "2 keep", and the config kept AutoFit with a comment
    # saying the plan's settings replaced it
    assert why_autofit_stays(_plan(["keep", "keep"], ["keep", "keep"]), []) == []
    (differ,) = why_autofit_stays(_plan(["selective", "selective"], ["keep", "keep"]), [])
    assert "rank 0: 2 selective; rank 1: 2 keep" in differ and "AutoFit stays" in differ
    both = why_autofit_stays(_plan(["checkpoint", "keep"], ["keep", "keep"]), ["limit_train_batches=3"])
    assert len(both) == 2 and "limit_train_batches=3" in both[1]
    (short,) = why_autofit_stays(_plan(["keep", "keep"], ["keep", "keep"]), [], 2)
    assert "short batch of 2 samples" in short and "AutoFit stays" in short


def test_a_kept_autofit_is_held_to_the_printed_plans_micro_batch_and_optimizer_states():
    # a new user's trial: kept as a whole search, its fit measured again and could pick another micro-batch than the
    # plan printed above the config
    import yaml

    autofit = AutoFit(budget="1GiB", optimizer_options=["32-bit", "8-bit"], min_8bit_size=1024)
    autofit.short_last_batch = 2
    (kept,) = yaml.safe_load(plan_yaml(_plan(["keep", "keep"]), autofit, trainer(), Module()))["trainer"]["callbacks"]
    assert kept["class_path"] == "lightning_efficient.AutoFit"
    assert kept["init_args"] == {**autofit.init_args(), "micro_batches": [4], "optimizer_options": ["32-bit"]}
    assert kept["init_args"]["min_8bit_size"] == 1024
