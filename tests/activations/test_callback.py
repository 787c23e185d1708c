import sys
from pathlib import Path

import lightning
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_efficient import ActivationMemory, CorpusDataModule, DemoGPT
from lightning_efficient.activations import BlockProfile, parse_budget, plan_blocks
from tests.activations.script_data import Rows
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


@pytest.mark.parametrize(("text", "expected"), [("6GiB", 6 * 2**30), ("500MB", 500 * 10**6), (1024, 1024), ("1.5 KiB", 1536),
                                              ("1000", 1000)])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected
    assert parse_budget(0.5, 1000) == 500


def test_a_fraction_given_as_a_string_is_the_fraction_not_zero_bytes():
    # a new user's trial: "0.5" from a YAML file read as 0 bytes (and "1.5" as 1)
    assert parse_budget("0.5", 1000) == 500 and parse_budget(" 0.25 ", 1000) == 250
    for text, said in (("1.5", "a fraction of the baseline in \\(0, 1\\]"), ("0.1B", "less than one byte")):
        with pytest.raises(ValueError, match=f"budget='{text}' is not allowed: .*{said}"):
            parse_budget(text)
    with pytest.raises(ValueError, match=r"budget='0\.5' is not allowed: .*not a fraction"):
        from lightning_efficient import AutoFit

        AutoFit(budget="0.5")


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
        ({"policy": None}, "policy=None is not allowed"),
        ({"policy": 3}, "policy=3 is not allowed"),
        ({"policy": []}, "policy=\\[\\] is not allowed"),
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
    summary = callback.plan_summary
    assert summary.held_bytes <= 0.5 * summary.baseline_bytes
    path = tmp_path / "auto.ckpt"
    t.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["callbacks"]["ActivationMemory"]["plan"] == plan
    resumed = ActivationMemory(policy="auto", budget=0.5, auto_policies=["keep", "selective", "checkpoint"])
    _trainer([resumed], steps=3).fit(DemoGPT(**{**tiny_gpt_kwargs(), "n_layers": 4}), datamodule=data, ckpt_path=path)
    assert resumed.plan == plan and resumed.profiles == []  # not profiled again
    assert resumed.plan_summary == summary


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
    from tests.ddp import run_script

    out = tmp_path / "grads.pt"
    run_script(HERE / "ddp_checkpoint.py", out)
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


def test_a_failed_disk_write_stops_the_fit_naming_the_path_and_the_bytes(tmp_path):
    import json
    import re

    from tests.ddp import run_script

    offload_dir = tmp_path / "offload"
    done = run_script(HERE / "disk_write_failure.py", offload_dir, 20_000)  # files over 20,000 bytes fail
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None, f"the fit ran {result['global_step']} steps with failing writes"
    match = re.search(r"could not write ([0-9,]+) bytes to (\S+\.bin)", result["error"])
    assert match, result["error"]
    assert int(match.group(1).replace(",", "")) > 20_000
    assert match.group(2).startswith(str(offload_dir))
    assert result["global_step"] <= 1
    assert result["left"] == []  # on_exception removed the files and the private directory


def _loader():
    return torch.utils.data.DataLoader(Rows(), batch_size=4)


class _Losses(lightning.Callback):
    def __init__(self, fail_at=None):
        self.losses, self.fail_at = [], fail_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step == self.fail_at:
            raise RuntimeError(f"stop at step {self.fail_at}")


def _activation_threads():
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("activation-")]


def test_a_fit_that_raises_leaves_nothing_behind_and_the_callback_fits_again(tmp_path):
    offload_dir = tmp_path / "offload"
    callback = ActivationMemory(policy="disk", offload_dir=str(offload_dir), min_offload_bytes=0)
    lightning.seed_everything(0)
    model = DemoGPT(**tiny_gpt_kwargs())
    with pytest.raises(RuntimeError, match="stop at step 2"):
        _trainer([callback, _Losses(fail_at=2)], steps=4).fit(model, _loader())
    assert [name for name, block in model.named_modules() if "forward" in vars(block)] == []
    assert _activation_threads() == []
    assert list(offload_dir.iterdir()) == []
    after_failure = {k: v.clone() for k, v in model.state_dict().items()}

    again = _Losses()
    lightning.seed_everything(1)
    _trainer([callback, again], steps=3).fit(model, _loader())
    assert callback.plan == ["disk", "disk"] and callback.memory_figures()["activation_disk_offloaded_bytes"] > 0
    fresh_model = DemoGPT(**tiny_gpt_kwargs())
    fresh_model.load_state_dict(after_failure)
    fresh = _Losses()
    lightning.seed_everything(1)
    _trainer([fresh], steps=3).fit(fresh_model, _loader())
    assert again.losses == fresh.losses
    assert _activation_threads() == [] and list(offload_dir.iterdir()) == []


class _SavedBytesOfFirstStep(lightning.Callback):
    """Counts what the real first training step saves for backward (it runs after ActivationMemory's hook)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            from lightning_efficient.memory import SavedTensorCounter

            self.counter = SavedTensorCounter(exclude=[*pl_module.parameters(), *pl_module.buffers()]).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.counter.__exit__(None, None, None)
            self.bytes = self.counter.bytes


def test_auto_profiles_in_the_precision_context_of_the_real_step():
    callback = ActivationMemory(policy="auto", budget=1.0, auto_policies=["keep", "checkpoint"])
    real = _SavedBytesOfFirstStep()
    lightning.seed_everything(0)
    _trainer([callback, real], steps=1, precision="bf16-mixed").fit(DemoGPT(**tiny_gpt_kwargs()), _loader())
    assert callback.plan == ["keep", "keep"]  # the whole baseline fits: the real step saves what was profiled
    profiled = callback.plan_summary.baseline_bytes
    assert abs(profiled - real.bytes) <= 0.01 * real.bytes, (profiled, real.bytes)  # equal here; float32 would be ~1.2x


class _WrappedBlocksDuringFit(lightning.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.wrapped = [name for name, block in pl_module.named_modules() if "forward" in vars(block)]


def test_a_policy_set_now_wins_over_the_checkpoints_plan(tmp_path, lightning_caplog):
    caplog = lightning_caplog
    import logging

    lightning.seed_everything(0)
    model = DemoGPT(**tiny_gpt_kwargs())
    t = _trainer([ActivationMemory(policy="checkpoint")], steps=1)
    t.fit(model, _loader())
    path = tmp_path / "checkpointed.ckpt"
    t.save_checkpoint(path)

    resumed, seen = ActivationMemory(policy="keep"), _WrappedBlocksDuringFit()
    with caplog.at_level(logging.INFO):
        _trainer([resumed, seen], steps=2).fit(DemoGPT(**tiny_gpt_kwargs()), _loader(), ckpt_path=path)
    assert resumed.plan == ["keep", "keep"] and seen.wrapped == []
    assert "the checkpoint's plan (2 checkpoint) is not restored: policy='keep' set now wins" in caplog.text

    # an auto run replans when the checkpoint's plan was not an auto plan for the same budget
    auto = ActivationMemory(policy="auto", budget=1.0, auto_policies=["keep", "checkpoint"])
    _trainer([auto], steps=2).fit(DemoGPT(**tiny_gpt_kwargs()), _loader(), ckpt_path=path)
    assert auto.plan == ["keep", "keep"] and auto.profiles != []


class _Llama(lightning.LightningModule):
    """A tiny transformers LlamaForCausalLM with its default ``use_cache=True``, trained on its own loss."""

    def __init__(self):
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=512, use_cache=True))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _FirstGrads(lightning.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.use_cache = pl_module.model.config.use_cache

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()}


def test_reentrant_checkpoint_of_hugging_face_layers_turns_off_use_cache_and_gives_keeps_gradients(lightning_caplog):
    caplog = lightning_caplog
    import logging

    got = {}
    for policy, reentrant in [("keep", False), ("checkpoint", True)]:
        model, grads = _Llama().double(), _FirstGrads()
        with caplog.at_level(logging.INFO):
            _trainer([ActivationMemory(policy=policy, reentrant=reentrant), grads], steps=1, precision="64-true").fit(
                model, _loader())
        got[policy] = grads
        assert model.model.config.use_cache is True  # restored
    assert got["keep"].use_cache is True and got["checkpoint"].use_cache is False
    assert caplog.text.count("config.use_cache set to False on model") == 1
    for name, grad in got["keep"].grads.items():
        assert (got["checkpoint"].grads[name] - grad).abs().max() <= 1e-12, name


class _Checkpointing(lightning.Callback):
    """Each step's transformers checkpointing flags (layers' and the model's) and the first step's gradients."""

    def __init__(self, fail=False):
        self.flags, self.fail = [], fail

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.flags.append({m.gradient_checkpointing for m in pl_module.modules() if hasattr(m, "gradient_checkpointing")})
        self.use_cache = pl_module.model.config.use_cache
        if self.fail:
            raise RuntimeError("failed on purpose")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()}


def test_transformers_gradient_checkpointing_is_turned_off_while_the_policies_decide_and_restored_after(tmp_path):
    # a new user's trial: with model.gradient_checkpointing_enable() on, policy="disk" reported blocks on disk and
    # wrote nothing (transformers recomputed every layer around the wrapper), and "auto" profiled recomputed blocks
    def fit(hf_checkpointing, callbacks, fail=False):
        model = _Llama().double()
        if hf_checkpointing:
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        seen = _Checkpointing(fail)
        try:
            _trainer([*callbacks, seen], steps=1, precision="64-true").fit(model, _loader())
        except RuntimeError as error:
            assert "failed on purpose" in str(error)
        after = {m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")}
        return seen, after

    plain, _ = fit(False, [])
    disk = ActivationMemory(policy="disk", offload_dir=str(tmp_path / "disk"))
    with pytest.warns(UserWarning, match="transformers' gradient checkpointing is on in model.model and 2 more; turned off"):
        seen, after = fit(True, [disk])
    assert seen.flags == [{False}] and after == {True}  # off in the fit, the user's again after it
    # review: transformers forces use_cache=False only while its checkpointing is on: without it, every training
    # forward built a cache of each layer's keys and values (beside the blocks on disk)
    assert seen.use_cache is False
    assert disk.memory_figures()["activation_disk_offloaded_bytes"] > 0
    for name, grad in plain.grads.items():
        assert (seen.grads[name] - grad).abs().max() <= 1e-12, name
    _, after = fit(True, [ActivationMemory(policy="disk", offload_dir=str(tmp_path / "failing"))], fail=True)
    assert after == {True}  # a fit that fails puts it back too
    seen, after = fit(True, [ActivationMemory(policy="keep")])  # keep only: the user's setting stays
    assert seen.flags == [{True}] and after == {True}


def _auto_plan_under_hetero_ddp(budget, out_dir):
    import json

    from tests.ddp import run_script

    out_dir.mkdir()
    run_script(HERE / "ddp_auto_plan.py", budget, out_dir)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_auto_under_hetero_ddp_plans_each_rank_for_its_own_micro_batch(tmp_path):
    # every block kept: about 680 KB on rank 0 (micro-batch 2), 2.04 MB on rank 1 (micro-batch 6);
    # every block checkpointed: about 182 KB and 546 KB
    ranks = _auto_plan_under_hetero_ddp(600_000, tmp_path / "out")
    assert [r["micro_batch"] for r in ranks] == [2, 6]
    for rank in ranks:
        assert "error" not in rank
        assert rank["saved_bytes"] <= 600_000, rank
        assert rank["planned_bytes"] <= 600_000
    assert ranks[1]["plan"] == ["checkpoint"] * 4 and ranks[0]["plan"] != ranks[1]["plan"]


def test_auto_budget_infeasible_on_one_rank_fails_on_every_rank_with_the_numbers(tmp_path):
    ranks = _auto_plan_under_hetero_ddp(400_000, tmp_path / "out")  # rank 0 could plan for it, rank 1 cannot
    said = "ActivationMemory(policy='auto') could not plan: rank 1 (micro-batch 6): budget=400,000 bytes is below what the leanest plan reaches"
    # (a SettingRefused, a ValueError, on both: the command line says it in one line)
    assert ranks[0]["error"].startswith(f"SettingRefused: {said}"), ranks[0]["error"]
    # the rank that failed raises its own error, with every rank's failures as a note
    assert ranks[1]["error"].startswith("SettingRefused: budget=400,000 bytes is below what the leanest plan reaches"), ranks[1]["error"]
    assert len(ranks[1]["notes"]) == 1 and ranks[1]["notes"][0].startswith(said)
    assert ranks[1]["notes"][0] == ranks[0]["error"].removeprefix("SettingRefused: ")


class _PendingBound(lightning.Callback):
    def __init__(self, memory):
        self.memory, self.bounds = memory, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bounds.append(self.memory._disk.max_pending_bytes)


def test_disk_pending_bytes_bounds_the_disk_writers_backlog_and_the_fit_equals_keeping_every_block(tmp_path):
    def fit(callbacks):
        lightning.seed_everything(1)
        model = DemoGPT(**tiny_gpt_kwargs())
        losses = _Losses()
        _trainer([*callbacks, losses], steps=3).fit(model, _loader())
        return losses.losses, model

    memory = ActivationMemory(policy="disk", offload_dir=str(tmp_path), min_offload_bytes=0, disk_pending_bytes=1)
    bound = _PendingBound(memory)
    losses, model = fit([memory, bound])  # every saved storage waits for the one before it to be written
    plain_losses, plain = fit([])
    assert bound.bounds == [1, 1, 1]
    assert losses == plain_losses
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert memory.memory_figures()["activation_disk_offloaded_bytes"] > 0


def test_offload_asked_for_by_auto_policies_on_cpu_is_said_to_be_left_out(small_datamodule_kwargs):
    # a new user's trial: the refusal blamed the budget, never saying offload was not among the choices on CPU
    with pytest.warns(UserWarning, match=r"auto_policies=\['offload', 'keep'\] includes 'offload', which needs CUDA: planned on cpu"):
        _trainer([ActivationMemory("auto", budget=1.0, auto_policies=["offload", "keep"])]).fit(
            DemoGPT(**tiny_gpt_kwargs()), datamodule=CorpusDataModule(**small_datamodule_kwargs))


def test_autofit_keeps_transformers_gradient_checkpointing_the_user_turned_on():
    # AutoFit keeps what the user set: with transformers' checkpointing on, it plans no block policies (it measured
    # recomputed blocks as kept ones before), and the flags stay on through the fit
    from lightning_efficient import AutoFit

    model = _Llama()
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autofit, seen = AutoFit(budget="4GiB", search_micro_batch=False, optimizer_options=["32-bit"]), _Checkpointing()
    _trainer([autofit, seen], steps=1).fit(model, _loader())
    assert any("transformers' gradient checkpointing" in note for note in autofit.plan.notes)
    assert all(policy == "keep" for policy in autofit.plan.ranks[0].policies)
    assert seen.flags == [{True}]
    # review: measured with it on, the fit ran with it off, where an ActivationMemory followed AutoFit (the user's) or
    # AutoFit's own was kept for another fit; the measuring and the fit see the same now
    for make in (lambda: [AutoFit(budget="4GiB", search_micro_batch=False, optimizer_options=["32-bit"]),
                          ActivationMemory(policy="disk")],
                 lambda: [autofit]):
        callbacks, seen = make(), _Measured()
        model = _Llama()
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _trainer([*callbacks, seen], steps=1).fit(model, _loader())
        assert len(set(seen.flags)) == 1, seen.flags  # the same while AutoFit measured and while the fit ran


class _Measured(_Checkpointing):
    """The transformers checkpointing flags at every training step, AutoFit's measuring steps included."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass

    def setup(self, trainer, pl_module, stage):
        self.flags = []
        model = pl_module.model
        original = model.forward

        def forward(*args, **kwargs):
            self.flags.append(frozenset(m.gradient_checkpointing for m in pl_module.modules() if hasattr(m, "gradient_checkpointing")))
            return original(*args, **kwargs)

        model.forward = forward
