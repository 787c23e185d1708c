import os
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_efficient import ActivationMemory, CorpusDataModule, DemoGPT
from lightning_efficient.activations import BlockProfile, parse_budget, plan_blocks
from tests.conftest import tiny_gpt_kwargs

HERE = Path(__file__).resolve().parent


def _trainer(callbacks, steps=2, **kwargs):
    return lightning.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, **{"enable_checkpointing": False, **kwargs},
    )


profiles_strategy = st.lists(
    st.tuples(st.integers(1000, 10**6), st.floats(0.05, 0.9), st.floats(0.0, 0.2), st.floats(0.01, 1.0), st.floats(0.0, 1.0)),
    min_size=1, max_size=12,
)


def _profiles(raw):
    out = []
    for i, (keep, sel_frac, ckpt_frac, fwd, sel_share) in enumerate(raw):
        ckpt = int(keep * ckpt_frac)
        sel = max(ckpt, int(keep * sel_frac))
        out.append(BlockProfile(f"b{i}", {"keep": keep, "selective": sel, "checkpoint": ckpt},
                                {"keep": 0.0, "selective": fwd * sel_share, "checkpoint": fwd}))
    return out


@settings(max_examples=200, deadline=None)
@given(profiles_strategy, st.floats(0.0, 1.0), st.integers(0, 10**5))
def test_plan_meets_the_budget_and_costs_no_more_than_checkpointing_everything(raw, where, fixed):
    profiles = _profiles(raw)
    leanest = fixed + sum(p.held_bytes["checkpoint"] for p in profiles)
    everything = fixed + sum(p.held_bytes["keep"] for p in profiles)
    budget = int(leanest + where * (everything - leanest))
    plan = plan_blocks(profiles, budget, fixed)
    assert plan.held_bytes <= budget
    assert plan.held_bytes == fixed + sum(p.held_bytes[k] for p, k in zip(profiles, plan.policies))
    assert plan.cost_s <= sum(p.cost_s["checkpoint"] for p in profiles) + 1e-12


def test_a_budget_below_the_leanest_plan_gives_the_minimum():
    profiles = [BlockProfile("b0", {"keep": 100, "checkpoint": 10}, {"keep": 0.0, "checkpoint": 1.0})]
    with pytest.raises(ValueError, match=r"budget=50 bytes is below what the leanest plan reaches: 60 bytes"):
        plan_blocks(profiles, 50, fixed_bytes=50)


@pytest.mark.parametrize(("text", "expected"), [("6GiB", 6 * 2**30), ("500MB", 500 * 10**6), (1024, 1024), ("1.5 KiB", 1536)])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected
    assert parse_budget(0.5, 1000) == 500


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"policy": "swap"}, "policy='swap'"),
        ({"policy": "auto"}, "budget=None"),
        ({"policy": "auto", "budget": 0}, "budget=0"),
        ({"policy": "auto", "budget": "lots"}, "budget='lots'"),
        ({"policy": "auto", "budget": 1.5}, "budget=1.5"),
        ({"policy": "checkpoint", "budget": "1GiB"}, "budget='1GiB'"),
        ({"blocks": []}, "blocks=\\[\\]"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ActivationMemory(**kwargs)


def test_pattern_matching_nothing_fails_before_the_first_step(small_datamodule_kwargs):
    with pytest.raises(ValueError, match="matches no module; candidates: Block"):
        _trainer([ActivationMemory(blocks=["Nothing"])]).fit(DemoGPT(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))


def test_auto_budget_below_full_checkpointing_fails_before_the_first_step(small_datamodule_kwargs):
    model = DemoGPT(**tiny_gpt_kwargs())
    with pytest.raises(ValueError, match="is below what the leanest plan reaches"):
        _trainer([ActivationMemory(policy="auto", budget=1000, auto_policies=["keep", "checkpoint"])]).fit(
            model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert model.global_step == 0


def test_auto_plan_fits_the_budget_and_is_restored_on_resume(small_datamodule_kwargs, tmp_path):
    lightning.seed_everything(0)
    callback = ActivationMemory(policy="auto", budget=0.5, auto_policies=["keep", "selective", "checkpoint"])
    model = DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 4})
    data = CorpusDataModule(**small_datamodule_kwargs)
    t = _trainer([callback], steps=2)
    t.fit(model, datamodule=data)
    plan = callback.plan
    assert plan is not None and len(plan) == 4 and set(plan) != {"keep"}
    summary = callback._plan_summary
    assert summary.held_bytes <= 0.5 * summary.baseline_bytes
    path = tmp_path / "auto.ckpt"
    t.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["callbacks"]["ActivationMemory"]["plan"] == plan
    resumed = ActivationMemory(policy="auto", budget=0.5, auto_policies=["keep", "selective", "checkpoint"])
    _trainer([resumed], steps=3).fit(DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 4}), datamodule=data, ckpt_path=path)
    assert resumed.plan == plan and resumed._profiles == []  # not profiled again


def test_disk_policy_leaves_no_file_after_fit_and_after_a_failure(small_datamodule_kwargs, tmp_path):
    offload_dir = tmp_path / "offload"
    model = DemoGPT(**tiny_gpt_kwargs())
    _trainer([ActivationMemory(policy="disk", offload_dir=str(offload_dir), min_offload_bytes=0)]).fit(
        model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
    assert list(offload_dir.iterdir()) == []

    class Failing(DemoGPT):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if self.global_step == 1:
                out["loss"].register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("fails in backward")))
            return out

    with pytest.raises(RuntimeError, match="fails in backward"):
        _trainer([ActivationMemory(policy="disk", offload_dir=str(offload_dir), min_offload_bytes=0)], steps=3).fit(
            Failing(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))
    leftovers = [p for d in offload_dir.iterdir() for p in d.glob("*.bin")] if offload_dir.exists() else []
    assert leftovers == []


def test_reentrant_with_find_unused_parameters_is_refused(small_datamodule_kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(find_unused_parameters=True)
    callback = ActivationMemory(reentrant=True)

    class FakeTrainer:
        pass

    fake = FakeTrainer()
    fake.strategy = strategy
    with pytest.raises(ValueError, match="reentrant=True is refused with DDP's find_unused_parameters=True"):
        callback.on_fit_start(fake, DemoGPT(**tiny_gpt_kwargs()))


def test_two_process_ddp_with_checkpoint_matches_one_process(tmp_path):
    out = tmp_path / "grads.pt"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    done = subprocess.run([sys.executable, str(HERE / "ddp_checkpoint.py"), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = torch.load(out)
    sys.path.insert(0, str(HERE))
    import ddp_checkpoint

    model = ddp_checkpoint.model()
    model.load_state_dict(saved["init"])
    batch = ddp_checkpoint.batches()
    torch.manual_seed(0)
    model.token_losses(batch)["loss"].backward()  # dropout off: the reference needs no RNG alignment
    for name, param in model.named_parameters():
        assert (saved["grads"][name] - param.grad).abs().max() <= 1e-12, name
