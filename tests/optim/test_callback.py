import contextlib
import copy

import bitsandbytes as bnb
import lightning
import pytest
import torch

from lightning_efficient import CorpusDataModule, DemoGPT, EightBitOptimizer
from lightning_efficient.memory import optimizer_state_bytes
from lightning_efficient.optim.offload import host_offloaded
from lightning_efficient.optim.state import dequantize_adam_state
from tests.conftest import tiny_gpt_kwargs
from tests.optim.helpers import Regression, trainer


def _fit(model, steps, callbacks=(), **kwargs):
    t = trainer(steps, callbacks, **kwargs)
    t.fit(model, **{k: v for k, v in kwargs.items() if k == "ckpt_path"})
    return t


def test_converted_optimizer_steps_like_bitsandbytes_used_directly_and_tracks_adamw():
    torch.manual_seed(0)
    model = Regression()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    t = trainer(50, [EightBitOptimizer(embeddings_32bit=False, min_8bit_size=1024)])
    t.fit(model)
    assert isinstance(t.optimizers[0], bnb.optim.AdamW8bit)
    # the same 50 steps by hand with bitsandbytes
    direct = Regression()
    direct.load_state_dict(start)
    optimizer = bnb.optim.AdamW8bit(direct.parameters(), lr=1e-2, weight_decay=0.05, min_8bit_size=1024)
    loader = direct.train_dataloader()
    fp32 = Regression()
    fp32.load_state_dict(start)
    adamw = torch.optim.AdamW(fp32.parameters(), lr=1e-2, weight_decay=0.05)
    steps = 0
    for epoch in range(10):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            for m, opt in ((direct, optimizer), (fp32, adamw)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
            steps += 1
            if steps == 50:
                break
        if steps == 50:
            break
    for (name, ours), theirs, full in zip(model.named_parameters(), direct.parameters(), fp32.parameters()):
        assert torch.equal(ours, theirs), name
        moved = (full - start[name]).norm()
        # stated tolerance against 32-bit AdamW: the parameters differ by at most 10% of the distance
        # 32-bit AdamW moved them in 50 steps (the moments are quantized to 8 bits each step)
        assert (ours - full).norm() <= 0.10 * moved, name


def test_embeddings_and_small_tensors_stay_32bit_and_are_reported(capsys):
    model = Regression()
    callback = EightBitOptimizer()
    t = trainer(2, [callback])
    t.fit(model)
    state = t.optimizers[0].state
    assert state[model.embed.weight]["state1"].dtype == torch.float32  # embedding, 5120 elements
    assert state[model.hidden.weight]["state1"].dtype == torch.uint8  # 7680 elements
    assert state[model.hidden.bias]["state1"].dtype == torch.float32  # under 4096
    figures = callback.memory_figures()
    assert figures["optimizer_32bit_embedding_params"] == 64 * 80
    assert figures["optimizer_8bit_params"] == 80 * 96
    assert figures["optimizer_32bit_small_params"] == 96 + 96 + 1
    assert id(model.embed.weight) not in bnb.optim.GlobalOptimManager.get_instance().pid2config  # cleaned up


def test_name_patterns_keep_32bit_and_unknown_patterns_are_refused():
    model = Regression()
    t = trainer(1, [EightBitOptimizer(keep_32bit=["hidden.*"])])
    t.fit(model)
    assert t.optimizers[0].state[model.hidden.weight]["state1"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"keep_32bit=\['nothing\*'\] matches no parameter"):
        trainer(1, [EightBitOptimizer(keep_32bit=["nothing*"])]).fit(Regression())


class SchedulerAtEnd(lightning.Callback):
    """Whether the scheduler steps the optimizer Lightning trains with, when training ends."""

    def on_train_end(self, trainer, pl_module):
        self.steps_trained = trainer.lr_scheduler_configs[0].scheduler.optimizer is trainer.optimizers[0]


def test_scheduler_still_changes_the_new_optimizers_lr_and_is_handed_back_after_the_fit():
    seen = SchedulerAtEnd()
    t = trainer(3, [EightBitOptimizer(), seen])
    t.fit(Regression(scheduler=True))
    optimizer = t.optimizers[0]
    assert isinstance(optimizer, bnb.optim.AdamW8bit) and seen.steps_trained
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    # after the fit it steps the module's own optimizer again (a module keeping both between fits: Lightning refuses
    # a scheduler attached to an optimizer configure_optimizers did not return)
    assert type(t.lr_scheduler_configs[0].scheduler.optimizer) is torch.optim.AdamW


def test_no_twin_raises_or_with_strict_false_is_left_with_a_warning():
    class Adadelta(Regression):
        def configure_optimizers(self):
            return torch.optim.Adadelta(self.parameters())

    overrides = bnb.optim.GlobalOptimManager.get_instance().pid2config
    before = dict(overrides)
    with pytest.raises(TypeError, match="Adadelta has no bitsandbytes 8-bit twin"):
        trainer(1, [EightBitOptimizer()]).fit(Adadelta())
    assert overrides == before  # a refused conversion leaves no 32-bit override behind for reused ids
    t = trainer(1, [EightBitOptimizer(strict=False)])
    with pytest.warns(UserWarning, match="no 8-bit twin; left as it is"):
        t.fit(Adadelta())
    assert isinstance(t.optimizers[0], torch.optim.Adadelta)


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"min_8bit_size": 0}, "min_8bit_size=0"), ({"offload": "disk"}, "offload='disk'"), ({"bits": 4}, "bits=4"),
    ({"paged": True, "offload": "cpu"}, "offload='cpu'"),
])
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EightBitOptimizer(**kwargs)


@pytest.mark.parametrize("resume_at", [8, 11])  # 8 batches an epoch: an epoch end and a mid-epoch step
def test_resume_is_exact(tmp_path, resume_at):
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight = Regression()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=resume_at, save_top_k=-1, filename="{step}")
    trainer(20, [EightBitOptimizer(), saver], enable_checkpointing=True).fit(straight)
    path = tmp_path / f"step={resume_at}.ckpt"
    saved = torch.load(path, weights_only=True)  # loads without unpickling arbitrary objects
    assert saved["callbacks"]["EightBitOptimizer"]["bitsandbytes_version"] == bnb.__version__
    from lightning_efficient.optim.state import BNB_BLOCKWISE, param_state_layout, unwrapped

    assert param_state_layout(saved["optimizer_states"][0]["state"][1]) == BNB_BLOCKWISE
    assert unwrapped(saved["optimizer_states"][0]["state"][1])["state1"].dtype == torch.uint8
    resumed = Regression()
    trainer(20, [EightBitOptimizer()]).fit(resumed, ckpt_path=path)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


class QuantizationMaps(lightning.Callback):
    """The distinct qmap1 and qmap2 tensors of the 8-bit states at the end of training."""

    def on_train_end(self, trainer, pl_module):
        states = [s for s in trainer.optimizers[0].state.values() if "qmap1" in s]
        self.count = len(states)
        self.maps = {key: {id(s[key]) for s in states} for key in ("qmap1", "qmap2")}


def test_a_resumed_8bit_optimizer_holds_one_quantization_map_each_as_bitsandbytes_does(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    straight, resumed = QuantizationMaps(), QuantizationMaps()
    trainer(8, [EightBitOptimizer(embeddings_32bit=False), saver, straight], enable_checkpointing=True).fit(Regression())
    # as a CUDA resume loads it: each parameter's maps moved to the device apart (on CPU torch.load keeps them shared)
    checkpoint = torch.load(tmp_path / "step=4.ckpt", weights_only=True)
    for state in checkpoint["optimizer_states"][0]["state"].values():
        inner = state.get("__bnb_optimizer_quant_state__", state)
        for key in ("qmap1", "qmap2"):
            if key in inner:
                inner[key] = inner[key].clone()
    torch.save(checkpoint, tmp_path / "apart.ckpt")
    trainer(8, [EightBitOptimizer(embeddings_32bit=False), resumed]).fit(Regression(), ckpt_path=tmp_path / "apart.ckpt")
    assert straight.count == resumed.count == 2  # the embedding and the hidden layer
    assert straight.maps == {key: {next(iter(ids))} for key, ids in straight.maps.items()}
    assert all(len(ids) == 1 for ids in resumed.maps.values()), resumed.maps


def test_32bit_checkpoint_into_8bit_and_back(tmp_path):
    from lightning_efficient.optim.state import BNB_BLOCKWISE, convert_optimizer_state

    torch.manual_seed(0)
    t = trainer(6)
    t.fit(Regression())
    path32 = tmp_path / "fp32.ckpt"
    t.save_checkpoint(path32)

    eight = Regression()
    t8 = trainer(7, [EightBitOptimizer(min_8bit_size=1024)])
    with pytest.warns(UserWarning, match="torch-32bit states; converted 5 of them to bitsandbytes"):
        t8.fit(eight, ckpt_path=path32)
    assert t8.global_step == 7 and torch.isfinite(t8.callback_metrics["loss"])
    # the quantized moments are the 32-bit ones within 8-bit quantization error
    saved = torch.load(path32, weights_only=True)["optimizer_states"][0]
    params = list(eight.parameters())
    converted, _ = convert_optimizer_state(saved, params, BNB_BLOCKWISE, lambda p: p.numel() >= 1024)
    for index, state in saved["state"].items():
        back = dequantize_adam_state(converted["state"][index])
        for key in ("exp_avg", "exp_avg_sq"):
            scale = state[key].abs().max()
            assert (back[key] - state[key]).abs().max() <= 0.05 * scale, (index, key)
    assert converted["state"][1]["state1"].dtype == torch.uint8  # hidden.weight: 7,680 elements
    assert converted["state"][2]["state1"].dtype == torch.float32  # hidden.bias: small, 32-bit

    path8 = tmp_path / "int8.ckpt"
    t8.save_checkpoint(path8)
    back = Regression()
    t32 = trainer(8, [EightBitOptimizer(bits=32)])
    with pytest.warns(UserWarning, match="bitsandbytes-blockwise-256 states; converted 5 of them to torch-32bit"):
        t32.fit(back, ckpt_path=path8)
    assert isinstance(t32.optimizers[0], torch.optim.AdamW) and t32.global_step == 8
    assert torch.isfinite(t32.callback_metrics["loss"])


def test_quantized_moments_are_within_quantization_error():
    from lightning_efficient.optim.state import quantize_adam_state

    g = torch.Generator().manual_seed(0)
    state = {"step": torch.tensor(3.0), "exp_avg": torch.randn(5000, generator=g) * 1e-3, "exp_avg_sq": torch.rand(5000, generator=g) * 1e-6}
    back = dequantize_adam_state(quantize_adam_state(state, eight_bit=True))
    for key in ("exp_avg", "exp_avg_sq"):
        blocks = state[key].view(-1)[: 4864].view(-1, 256).abs().amax(1)
        err = (back[key] - state[key]).view(-1)[:4864].view(-1, 256).abs().amax(1)
        assert torch.all(err <= 0.05 * blocks), key  # dynamic 8-bit codes: a few % of each block's max
    assert back["step"].item() == 3.0


def test_host_offloaded_optimizer_gives_the_same_results_on_cpu():
    params = [torch.nn.Parameter(torch.randn(100, 100)), torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(3))]
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = bnb.optim.AdamW8bit(params, lr=1e-2)
    offloaded = host_offloaded(bnb.optim.AdamW8bit)(clones, lr=1e-2)
    for _ in range(4):
        for p, c in zip(params, clones):
            g = torch.randn_like(p)
            p.grad, c.grad = g, g.clone()
        plain.step()
        offloaded.step(closure=lambda: None)
    for p, c in zip(params, clones):
        assert torch.equal(p, c)
    assert all(v.device.type == "cpu" for s in offloaded.state.values() for v in s.values() if torch.is_tensor(v))


def test_demo_state_bytes_with_embeddings_32bit_and_8bit(small_datamodule_kwargs):
    figures = {}
    for embeddings_32bit in (True, False):
        model = DemoGPT(**{**tiny_gpt_kwargs(), "d_model": 64, "n_heads": 2})
        t = trainer(1, [EightBitOptimizer(embeddings_32bit=embeddings_32bit)], limit_val_batches=0)
        t.fit(model, datamodule=CorpusDataModule(**small_datamodule_kwargs))
        params = list(model.parameters())
        optimizer = t.optimizers[0]
        hand = 2 * 256 * 4  # the two shared quantization maps
        for p in params:
            s = optimizer.state[p]
            if s["state1"].dtype == torch.uint8:
                hand += 2 * p.numel() + 2 * 4 * -(-p.numel() // 256)
            else:
                hand += 8 * p.numel()
        assert optimizer_state_bytes(optimizer) == hand
        figures[embeddings_32bit] = hand / sum(p.numel() for p in params)
    print(f"demo optimizer-state bytes per parameter: embeddings 32-bit {figures[True]:.3f}, 8-bit {figures[False]:.3f}")
    assert figures[False] < figures[True] and figures[False] <= 2.5


def test_a_fit_that_raises_leaves_no_32bit_override_behind():
    class Failing(Regression):
        def training_step(self, batch, batch_idx):
            if self.global_step == 1:
                raise RuntimeError("user code failed")
            return super().training_step(batch, batch_idx)

    overrides = bnb.optim.GlobalOptimManager.get_instance().pid2config
    before = dict(overrides)
    model = Failing()
    with pytest.raises(RuntimeError, match="user code failed"):
        trainer(3, [EightBitOptimizer()]).fit(model)
    assert id(model.embed.weight) not in overrides
    assert overrides == before


def test_paged_with_an_sgd_module_is_refused_at_fit_start_even_on_cpu():
    with pytest.raises(ValueError, match=r"paged=True is not allowed for optimizer 0: torch\.optim\.sgd\.SGD's 8-bit twin SGD8bit"):
        trainer(1, [EightBitOptimizer(paged=True)]).fit(Regression(optimizer="sgd"))


def test_a_pattern_naming_a_parameter_already_32bit_is_not_refused():
    """keep_32bit=["embed.weight"] matches the embedding, which embeddings_32bit already keeps 32-bit."""
    model = Regression()
    t = trainer(1, [EightBitOptimizer(keep_32bit=["embed.weight"])])
    t.fit(model)
    assert t.optimizers[0].state[model.embed.weight]["state1"].dtype == torch.float32


class KeptOptimizer(Regression):
    """``configure_optimizers`` returns the one optimizer it built first, in every fit (it holds state after one)."""

    def configure_optimizers(self):
        if not hasattr(self, "kept"):
            self.kept = super().configure_optimizers()
        return self.kept


def _kept(module):
    return module.kept["optimizer"] if isinstance(module.kept, dict) else module.kept


class KeptStatesAtStart(lightning.Callback):
    """The optimizer Lightning steps, its states and how many states the kept optimizer holds when training starts."""

    def __init__(self, module):
        self.module = module

    def on_train_start(self, trainer, pl_module):
        self.twin = trainer.optimizers[0]
        self.twin_state = copy.deepcopy(self.twin.state_dict())
        self.users_state_len = len(_kept(self.module).state)


@pytest.mark.parametrize("scheduler", [False, True])
def test_an_optimizer_kept_between_fits_carries_its_states_into_the_8bit_twin_and_gets_them_back_updated(scheduler):
    from lightning_efficient.optim.state import TORCH_32BIT, convert_optimizer_state

    torch.manual_seed(0)
    module = KeptOptimizer(scheduler=scheduler)
    trainer(2).fit(module)
    held = copy.deepcopy(_kept(module).state_dict())
    seen = KeptStatesAtStart(module)
    t = trainer(5, [EightBitOptimizer(min_8bit_size=1024), seen])
    t.fit(module)
    # the twin starts from the held moments, quantized (as a 32-bit checkpoint's are on resume), and the user's
    # optimizer does not hold its 32-bit copy beside them during training
    assert isinstance(seen.twin, bnb.optim.AdamW8bit) and seen.users_state_len == 0
    start, _ = convert_optimizer_state(seen.twin_state, list(module.parameters()), TORCH_32BIT)
    for index, state in held["state"].items():
        assert start["state"][index]["step"].item() == 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert (start["state"][index][key] - state[key]).abs().max() <= 0.05 * state[key].abs().max(), (index, key)
    # after the fit the user's optimizer holds the twin's states, dequantized (and its scheduler steps it again): a
    # next fit goes on from step 7
    kept = _kept(module)
    assert type(kept) is torch.optim.AdamW and t.optimizers[0] is kept
    end, _ = convert_optimizer_state(seen.twin.state_dict(), list(module.parameters()), TORCH_32BIT)
    got = kept.state_dict()
    for index, state in end["state"].items():
        assert got["state"][index]["step"].item() == 7
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][index][key], state[key]), (index, key)
    if scheduler:
        assert module.kept["lr_scheduler"]["scheduler"].optimizer is kept
        trainer(1).fit(module)  # plain Lightning refuses a scheduler attached to an optimizer it was not given
        assert kept.state_dict()["state"][0]["step"].item() == 8
    else:
        # and trains as the same fits in 32-bit within the 8-bit tolerance of the test above
        torch.manual_seed(0)
        plain = KeptOptimizer()
        trainer(2).fit(plain)
        before = {name: p.detach().clone() for name, p in plain.named_parameters()}
        trainer(5).fit(plain)
        for (name, ours), full in zip(module.named_parameters(), plain.parameters()):
            assert (ours - full).norm() <= 0.10 * (full - before[name]).norm(), name


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_kept_scheduler_steps_the_kept_optimizer_after_an_8bit_fit_whose_states_were_not_carried(optimizer):
    # a new user's trial: a first fit 8-bit (no states to carry), or an SGD's momentum (not converted), left the kept
    # scheduler on the twin, and the next plain fit raised
    torch.manual_seed(0)
    module = KeptOptimizer(optimizer=optimizer, scheduler=True)
    if optimizer == "sgd":
        trainer(2).fit(module)
    with contextlib.ExitStack() as stack:
        if optimizer == "sgd":
            stack.enter_context(pytest.warns(UserWarning, match="do not convert to 8-bit"))
        trainer(3, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    kept, scheduler = module.kept["optimizer"], module.kept["lr_scheduler"]["scheduler"]
    assert scheduler.optimizer is kept
    t = trainer(1)
    t.fit(module)
    assert t.optimizers[0] is kept and kept.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** (6 if optimizer == "sgd" else 4))


def test_a_fit_that_fails_before_training_leaves_a_kept_optimizers_states_exactly_as_they_were():
    torch.manual_seed(0)
    module = KeptOptimizer()
    trainer(2).fit(module)
    held = copy.deepcopy(module.kept.state_dict())

    class FailsAtStart(lightning.Callback):
        def on_fit_start(self, trainer, pl_module):
            raise RuntimeError("refused before the first step")

    with pytest.raises(RuntimeError, match="refused before the first step"):
        trainer(3, [EightBitOptimizer(min_8bit_size=1024), FailsAtStart()]).fit(module)
    got = module.kept.state_dict()
    assert got["state"].keys() == held["state"].keys()
    for index, state in held["state"].items():
        assert all(torch.equal(got["state"][index][k], v) for k, v in state.items()), index  # not through 8 bits


def test_an_sgd_kept_between_fits_whose_states_do_not_convert_is_said_and_left_as_it_was():
    torch.manual_seed(0)
    module = KeptOptimizer(optimizer="sgd")
    trainer(2).fit(module)
    held = copy.deepcopy(module.kept.state_dict())
    with pytest.warns(UserWarning, match="holds states from before this fit that do not convert to 8-bit"):
        trainer(3, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    got = module.kept.state_dict()
    assert got["state"].keys() == held["state"].keys()
    assert all(torch.equal(got["state"][i]["momentum_buffer"], held["state"][i]["momentum_buffer"]) for i in held["state"])


class KeptBitsandbytes(Regression):
    """Plain Lightning's reference for a kept optimizer under EightBitOptimizer: configure_optimizers keeps one
    bitsandbytes AdamW8bit (same settings as the twin of the Regression's AdamW) between fits."""

    def configure_optimizers(self):
        if not hasattr(self, "kept"):
            self.kept = bnb.optim.AdamW8bit(self.parameters(), lr=self.lr, weight_decay=0.05, min_8bit_size=1024)
        return self.kept


def _override_embedding_32bit(module):
    bnb.optim.GlobalOptimManager.get_instance().override_config(module.embed.weight, "optim_bits", 32)


def test_an_optimizer_kept_from_its_first_8bit_fit_goes_on_from_the_states_that_fit_left():
    # a new user's trial: a configure_optimizers keeping one AdamW lost its first 8-bit fit's moments, where plain
    # Lightning's next fit goes on from them (here: from a kept bitsandbytes AdamW8bit's, bitwise)
    torch.manual_seed(0)
    ours = KeptOptimizer()
    torch.manual_seed(0)
    reference = KeptBitsandbytes()
    _override_embedding_32bit(reference)  # as the twin keeps the embedding 32-bit
    try:
        for steps in (3, 4):
            trainer(steps, [EightBitOptimizer(min_8bit_size=1024)]).fit(ours)
            trainer(steps).fit(reference)
            for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
                assert torch.equal(a, b), (steps, name)
    finally:
        bnb.optim.GlobalOptimManager.get_instance().pid2config.pop(id(reference.embed.weight), None)
    assert len(ours.kept.state) == 0  # the user's AdamW never held 8-bit states


class UnfreezeHidden(lightning.pytorch.callbacks.BaseFinetuning):
    """``hidden`` frozen until epoch ``at``, then unfrozen into a param group of its own (BackboneFinetuning's way)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def freeze_before_training(self, pl_module):
        self.freeze([pl_module.hidden])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == self.at:
            self.unfreeze_and_add_param_group([pl_module.hidden], optimizer, lr=2e-3)


class KeptTrainable(Regression):
    """Keeps the optimizer it built first over the parameters then trainable; ``eight_bit``: a bitsandbytes AdamW8bit
    (plain Lightning's reference for the twin), else torch's AdamW."""

    def __init__(self, eight_bit: bool) -> None:
        super().__init__()
        self.eight_bit = eight_bit

    def configure_optimizers(self):
        if not hasattr(self, "kept"):
            trainable = [p for p in self.parameters() if p.requires_grad]
            self.kept = (bnb.optim.AdamW8bit(trainable, lr=self.lr, weight_decay=0.05, min_8bit_size=1024) if self.eight_bit
                         else torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.05))
        return self.kept


def test_a_group_a_finetuning_callback_adds_during_an_8bit_fit_is_added_to_the_kept_optimizer_too():
    # a new user's trial: BackboneFinetuning's unfrozen layers went into the twin's groups only, so the module's kept
    # optimizer ended the fit with 1 group where plain Lightning's has 2, and its next 8-bit fit lost the 8-bit states
    # the first left ("do not load into this fit's twin")
    torch.manual_seed(0)
    ours = KeptTrainable(eight_bit=False)
    torch.manual_seed(0)
    reference = KeptTrainable(eight_bit=True)
    _override_embedding_32bit(reference)  # as the twin keeps the embedding 32-bit
    try:
        for steps, at in ((12, 1), (4, 0)):  # the second fit trains the unfrozen layer from its first step
            trainer(steps, [UnfreezeHidden(at), EightBitOptimizer(min_8bit_size=1024)]).fit(ours)
            trainer(steps, [UnfreezeHidden(at)]).fit(reference)
            assert [g["lr"] for g in ours.kept.param_groups] == [g["lr"] for g in reference.kept.param_groups]
            assert [len(g["params"]) for g in ours.kept.param_groups] == [len(g["params"]) for g in reference.kept.param_groups] == [3, 2]
            for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
                assert torch.equal(a, b), (steps, name)
    finally:
        bnb.optim.GlobalOptimManager.get_instance().pid2config.pop(id(reference.embed.weight), None)


class KeptTrainableScheduled(KeptTrainable):
    """With a StepLR on the kept optimizer (it gives every group an ``initial_lr``)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not hasattr(self, "kept_scheduler"):
            self.kept_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
        return {"optimizer": optimizer, "lr_scheduler": self.kept_scheduler}


@pytest.mark.parametrize("module_class", [KeptOptimizer, KeptTrainableScheduled])
def test_keys_callbacks_add_to_the_groups_during_an_8bit_fit_are_left_in_the_kept_optimizer_as_in_plain_lightning(module_class):
    # a trial: StochasticWeightAveraging's swa_lr stayed in the twin's groups; a review: a group BaseFinetuning added
    # lost the initial_lr SWALR gives it (a key other groups had when the twin was built). The twin's own keys
    # (SGD8bit's betas) do not come back
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def fit(optimizer, plugins):
        torch.manual_seed(0)
        module = KeptOptimizer(optimizer=optimizer) if module_class is KeptOptimizer else module_class(eight_bit=False)
        finetuning = [UnfreezeHidden(1)] if module_class is not KeptOptimizer else []
        swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=2)
        trainer(-1, [*finetuning, swa, *plugins], max_epochs=3).fit(module)
        return _kept(module).param_groups if module_class is KeptOptimizer else module.kept.param_groups

    for optimizer in ("adamw", "sgd") if module_class is KeptOptimizer else ("adamw",):
        ours, theirs = fit(optimizer, [EightBitOptimizer(min_8bit_size=1024)]), fit(optimizer, [])
        assert len(ours) == len(theirs) == (1 if module_class is KeptOptimizer else 2)
        assert [group.keys() for group in ours] == [group.keys() for group in theirs]
        assert all(group["swa_lr"] == 5e-3 for group in ours), optimizer
        assert [group["lr"] for group in ours] == pytest.approx([group["lr"] for group in theirs], rel=1e-12)
        assert [group.get("initial_lr") for group in ours] == [group.get("initial_lr") for group in theirs]


def test_a_kept_scheduler_that_stochastic_weight_averaging_replaced_during_an_8bit_fit_steps_the_kept_optimizer_again():
    # a new user's trial: SWA takes the module's scheduler out of the trainer's for its SWALR, so it was left bound to the
    # twin after the fit, and the next fit raised Lightning's "attached with an optimizer that wasn't returned"
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def fits(plugins):
        torch.manual_seed(0)
        module = KeptOptimizer(scheduler=True)
        for _ in range(2):
            trainer(-1, [StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1), *plugins()], max_epochs=2).fit(module)
            assert module.kept["lr_scheduler"]["scheduler"].optimizer is module.kept["optimizer"]
        return module.kept["optimizer"].param_groups[0]["lr"]

    assert fits(lambda: [EightBitOptimizer(min_8bit_size=1024)]) == pytest.approx(fits(list), rel=1e-12)


def test_a_kept_optimizer_holding_states_gets_no_key_of_the_twins_own_settings_back_in_any_group():
    # a new user's trial: states written back into a kept optimizer that held some before the fit brought the twin's
    # alpha, t_alpha and t_beta3 into the group BaseFinetuning added
    def groups(plugins):
        torch.manual_seed(0)
        module = KeptTrainable(eight_bit=False)
        trainer(4, [UnfreezeHidden(99)]).fit(module)  # states to carry into the twin, hidden frozen
        trainer(12, [UnfreezeHidden(1), *plugins]).fit(module)
        return module.kept.param_groups

    ours, theirs = groups([EightBitOptimizer(min_8bit_size=1024)]), groups([])
    assert [sorted(group) for group in ours] == [sorted(group) for group in theirs] and len(ours) == 2


def test_an_optimizer_kept_between_fits_takes_its_own_newer_states_over_those_an_earlier_8bit_fit_left():
    torch.manual_seed(0)
    module = KeptOptimizer()
    trainer(2, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    trainer(3).fit(module)  # plain: the kept AdamW starts afresh (its states were 8-bit, in the twin) and makes its own
    assert module.kept.state_dict()["state"][0]["step"].item() == 3
    seen = KeptStatesAtStart(module)
    trainer(1, [EightBitOptimizer(min_8bit_size=1024), seen]).fit(module)
    assert int(seen.twin_state["state"][0]["step"]) == 3  # carried from the user's, not the first fit's twin (2)


def test_the_states_a_kept_optimizer_left_that_no_longer_load_are_said_and_the_twin_starts_afresh():
    torch.manual_seed(0)
    module = KeptOptimizer()
    trainer(2, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    module.kept.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # a new group between the fits
    seen = KeptStatesAtStart(module)
    with pytest.warns(UserWarning, match="do not load into this fit's twin"):
        trainer(1, [EightBitOptimizer(min_8bit_size=1024), seen]).fit(module)
    assert seen.twin_state["state"] == {}


class TwoSGDGroups(Regression):
    """SGD with one param group without momentum (the embedding), first or last."""

    def __init__(self, embedding_first: bool = True):
        super().__init__()
        self.embedding_first = embedding_first

    def configure_optimizers(self):
        groups = [{"params": [self.embed.weight], "momentum": 0.0},
                  {"params": [p for n, p in self.named_parameters() if n != "embed.weight"]}]
        return torch.optim.SGD(groups if self.embedding_first else groups[::-1], lr=self.lr, momentum=0.9)


class Updates(lightning.Callback):
    """Each step's gradient and update of the embedding and of the hidden layer's weight."""

    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._before = {n: (p.detach().clone(), p.grad.clone()) for n, p in (("embed", pl_module.embed.weight),
                                                                          ("hidden", pl_module.hidden.weight))}

    def on_train_batch_end(self, trainer, pl_module, *args):
        now = {"embed": pl_module.embed.weight, "hidden": pl_module.hidden.weight}
        self.steps.append({n: (now[n].detach() - before, grad) for n, (before, grad) in self._before.items()})


@pytest.mark.parametrize("embedding_first", [True, False])
def test_an_sgd_with_a_group_without_momentum_becomes_8bit_and_that_group_steps_as_torch_does(embedding_first):
    # a new user's trial: bitsandbytes' SGD8bit refused a first group's momentum=0 as its default
    torch.manual_seed(0)
    module, updates = TwoSGDGroups(embedding_first), Updates()
    t = trainer(3, [EightBitOptimizer(min_8bit_size=1024, embeddings_32bit=False), updates])
    t.fit(module)
    twin = t.optimizers[0]
    assert isinstance(twin, bnb.optim.SGD8bit)
    assert sorted(g["momentum"] for g in twin.param_groups) == [0.0, 0.9]
    assert twin.defaults["momentum"] == 0.9 and "betas" not in twin.defaults  # torch's SGD defaults: a group added later
    for step in updates.steps[1:]:  # from the second step on, momentum shows
        update, grad = step["embed"]
        # no momentum: SGD's update, to the rounding of a parameter near 1 (momentum would add 0.9 of the last, >1e-3)
        assert torch.allclose(update, -module.lr * grad, rtol=0, atol=1e-6)
        update, grad = step["hidden"]
        assert not torch.allclose(update, -module.lr * grad, rtol=1e-2, atol=1e-9)  # momentum 0.9 (in 8 bits)


class OneCycleSGD(Regression):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10), "interval": "step"}}


class LoggedMomentum(lightning.Callback):
    """The momentum LearningRateMonitor logs at each step (it logs in on_train_batch_start)."""

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, *args):
        self.values.append(next(float(v) for k, v in trainer.callback_metrics.items() if k.endswith("-momentum")))


def test_learning_rate_monitor_logs_the_scheduled_momentum_of_an_8bit_sgd_at_the_step_that_uses_it(tmp_path):
    # a new user's trial: it read the twin's betas, which took the scheduled momentum only at the next step
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    logged = {}
    for label, callbacks in (("plain", []), ("8-bit", [EightBitOptimizer(min_8bit_size=1024)])):
        seen = LoggedMomentum()
        lightning.Trainer(accelerator="cpu", max_steps=5, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, logger=CSVLogger(tmp_path / label), log_every_n_steps=1,
                          callbacks=[*callbacks, LearningRateMonitor(logging_interval="step", log_momentum=True), seen],
                          ).fit(OneCycleSGD())
        logged[label] = seen.values
    assert logged["8-bit"] == logged["plain"] and len(set(logged["plain"])) > 2


def test_a_module_without_an_optimizer_trains_as_in_plain_lightning():
    class NoOptimizer(Regression):
        def configure_optimizers(self):
            return None

    torch.manual_seed(0)
    module = NoOptimizer()
    before = copy.deepcopy(module.state_dict())
    t = trainer(2, [EightBitOptimizer()])
    t.fit(module)  # raised that Lightning's placeholder optimizer had no 8-bit twin
    assert t.fit_loop.epoch_loop.batch_progress.total.completed == 2  # the steps ran, nothing stepped the parameters
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def test_a_setting_that_cannot_become_8bit_says_why_when_left_as_it_is():
    class NesterovSGD(Regression):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True)

    with pytest.warns(UserWarning, match=r"optimizer 0: torch\.optim\.sgd\.SGD param group 0 cannot become 8-bit: nesterov=True"):
        trainer(1, [EightBitOptimizer(strict=False)]).fit(NesterovSGD())
    with pytest.raises(TypeError, match=r"nesterov=True .*EightBitOptimizer\(strict=False\) leaves such an optimizer"):
        trainer(1, [EightBitOptimizer()]).fit(NesterovSGD())
    with pytest.raises(ValueError, match="bits"):
        EightBitOptimizer(bits=8.0)


def test_an_sgd_kept_with_its_own_states_leaves_no_8bit_states_behind_it():
    # its own momentum does not convert and stays its own: the twin's states would never be used again
    from lightning_efficient.optim.callback import _TWINS_LEFT

    torch.manual_seed(0)
    module = KeptOptimizer(optimizer="sgd")
    trainer(2).fit(module)
    with pytest.warns(UserWarning, match="do not convert to 8-bit"):
        trainer(2, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    assert module.kept not in _TWINS_LEFT


def test_the_states_a_kept_optimizer_left_are_dropped_with_it_or_when_asked_or_on_a_resume(tmp_path):
    import weakref

    from lightning_efficient.optim.callback import _TWINS_LEFT

    torch.manual_seed(0)
    module = KeptOptimizer()
    trainer(2, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    assert module.kept in _TWINS_LEFT
    EightBitOptimizer.forget_left_states(module.kept)
    seen = KeptStatesAtStart(module)
    trainer(1, [EightBitOptimizer(min_8bit_size=1024), seen]).fit(module)
    assert seen.twin_state["state"] == {}  # afresh, as asked
    # a resume loads the checkpoint's states, not the ones left
    t = trainer(2, [EightBitOptimizer(min_8bit_size=1024)], enable_checkpointing=True, default_root_dir=tmp_path)
    t.fit(module)
    path = tmp_path / "saved.ckpt"
    t.save_checkpoint(path)
    saved_step = int(t.optimizers[0].state_dict()["state"][1]["step"])
    trainer(1, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)  # the left states move on a step
    seen = KeptStatesAtStart(module)
    trainer(saved_step + 1, [EightBitOptimizer(min_8bit_size=1024), seen]).fit(module, ckpt_path=path)
    assert int(seen.twin_state["state"][1]["step"]) == saved_step
    # and the entry goes with the optimizer
    kept = weakref.ref(module.kept)
    del module, seen, t
    import gc

    gc.collect()
    assert kept() is None and len(_TWINS_LEFT) == 0


def test_a_32bit_fit_goes_on_from_the_8bit_states_a_kept_optimizer_left_dequantized():
    from lightning_efficient.optim.state import TORCH_32BIT, convert_optimizer_state

    torch.manual_seed(0)
    module = KeptOptimizer()
    t = trainer(3, [EightBitOptimizer(min_8bit_size=1024)])
    t.fit(module)
    left, _ = convert_optimizer_state(t.optimizers[0].state_dict(), list(module.parameters()), TORCH_32BIT)
    with pytest.warns(UserWarning, match=r"bits=32.*goes on from the 8-bit states the fit before left"):
        trainer(0, [EightBitOptimizer(bits=32)], max_epochs=1, limit_train_batches=0).fit(module)
    got = module.kept.state_dict()["state"]
    for index, state in left["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[index][key], state[key]), (index, key)


def test_states_left_under_other_8bit_settings_are_said_and_the_twin_starts_afresh():
    torch.manual_seed(0)
    module = KeptOptimizer()
    trainer(2, [EightBitOptimizer(min_8bit_size=1024)]).fit(module)
    seen = KeptStatesAtStart(module)
    with pytest.warns(UserWarning, match="other parameters are 8-bit under this callback's settings"):
        trainer(1, [EightBitOptimizer(min_8bit_size=100_000), seen]).fit(module)
    assert seen.twin_state["state"] == {}


def test_parameters_a_finetuning_callback_adds_while_the_fit_runs_keep_32bit_where_the_settings_say():
    """A new user's trial: BaseFinetuning's unfrozen embedding, and layers matched by keep_32bit, got 8-bit states:
    the 32-bit overrides were registered for the optimizer's parameters at the start only."""
    from lightning.pytorch.callbacks import BaseFinetuning

    class UnfreezeLater(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze([pl_module.embed, pl_module.hidden])

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 1:
                self.unfreeze_and_add_param_group([pl_module.embed, pl_module.hidden], optimizer)

    class States(lightning.Callback):
        def on_train_end(self, trainer, pl_module):
            state = trainer.optimizers[0].state
            self.kinds = {name: state[p]["state1"].dtype for name, p in pl_module.named_parameters() if p in state}

    class Frozen(Regression):
        def configure_optimizers(self):  # the trainable parameters only, as a finetuning set-up builds it
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    states = States()
    _fit(Frozen(), 16, [UnfreezeLater(), EightBitOptimizer(keep_32bit=["hidden.weight"], min_8bit_size=64), states])
    assert states.kinds == {"embed.weight": torch.float32, "hidden.weight": torch.float32, "hidden.bias": torch.uint8,
                            "out.weight": torch.uint8, "out.bias": torch.float32}
    assert not bnb.optim.GlobalOptimManager.get_instance().pid2config  # dropped after the fit
