"""SelectiveTokenLoss: exact counts with half-precision losses, extra output keys, a fit that raises
and is run again, references that cannot serve, typed choices."""

import contextlib
import logging
import typing

import lightning
import pytest
import torch
import torch.nn.functional as F

from lightning_efficient import DemoGPT, FusedTokenLoss, SelectiveTokenLoss, TokenLosses
from lightning_efficient.hf import HFCausalLM
from lightning_efficient.tokens.selection import METHODS, SCORES
from tests.conftest import tiny_gpt_kwargs
from tests.tokens.accumulation_model import Tiny


def _trainer(callbacks, steps=3, **kwargs):
    return lightning.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, **kwargs,
    )


class _HalfLosses(lightning.LightningModule):
    """One parameter scaling fixed per-token losses, returned in half precision."""

    def __init__(self, dtype, n):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.base = (1 + 2 * torch.rand(1, n, generator=torch.Generator().manual_seed(0))).to(dtype)
        self.dtype_ = dtype

    def training_step(self, batch, batch_idx):
        return TokenLosses(self.scale.to(self.dtype_) * self.base)


@pytest.mark.parametrize(("dtype", "n"), [(torch.float16, 70_000), (torch.bfloat16, 65_792)])
def test_half_precision_losses_are_summed_and_counted_exactly(dtype, n):
    # float16 cannot hold 70,000 (inf) and bfloat16 rounds 65,792 to 65,536
    model = _HalfLosses(dtype, n)
    callback = SelectiveTokenLoss(method="none")
    callback.setup(_trainer([callback]), model, "fit")
    out = model.training_step(None, 0)
    reference = model.base.double().mean()
    assert out["loss"].dtype == torch.float32
    assert abs(float(out["loss"].detach()) - float(reference)) <= 1e-6 * float(reference)
    (grad,) = torch.autograd.grad(out["loss"], [model.scale])
    assert abs(float(grad) - float(reference)) <= 1e-3 * float(reference)  # the per-token grads are half


class _WithAccuracy(Tiny):
    def __init__(self, fused):
        super().__init__(fused)

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        accuracy = (batch["labels"] != -100).double().mean()  # any extra output
        cls = FusedTokenLoss if self.fused else TokenLosses
        return cls(*(out[k] for k in (("hidden", "weight", "labels") if self.fused else ("token_losses", "mask"))),
                   **({"bias": out.bias} if self.fused else {}), accuracy=accuracy)


@pytest.mark.parametrize("fused", [False, True])
def test_extra_output_keys_reach_on_train_batch_end(fused):
    seen = []

    class Reader(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((outputs.get("accuracy"), (batch["labels"] != -100).double().mean(), sorted(outputs)))

    _trainer([SelectiveTokenLoss(method="topk", keep_ratio=0.5), Reader()], steps=2, precision="64-true").fit(
        _WithAccuracy(fused)
    )
    assert len(seen) == 2
    for accuracy, expected, keys in seen:
        assert accuracy is not None and torch.equal(accuracy, expected)
        assert keys == ["accuracy", "keep", "loss", "mask"]


class _TinyLearning(Tiny):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _RaiseOnce(lightning.Callback):
    def __init__(self, at):
        self.at, self.raised = at, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at and not self.raised:
            self.raised = True
            raise RuntimeError("interrupted")


def test_a_fit_that_raises_leaves_nothing_and_the_next_fit_trains_as_a_fresh_one():
    lightning.seed_everything(0)
    model = _TinyLearning().double()
    callbacks = [SelectiveTokenLoss(method="topk", keep_ratio=0.5), _RaiseOnce(at=2)]  # mid-step (accumulation 2)
    kwargs = {"precision": "64-true", "accumulate_grad_batches": 2}
    with pytest.raises(RuntimeError, match="interrupted"):
        _trainer(callbacks, steps=3, **kwargs).fit(model)
    assert "training_step" not in vars(model) and "optimizer_step" not in vars(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _trainer(callbacks, steps=3, **kwargs).fit(model)  # the same module and callbacks, run again
    assert "training_step" not in vars(model) and "optimizer_step" not in vars(model)
    fresh = _TinyLearning().double()
    fresh.load_state_dict(start)
    _trainer([SelectiveTokenLoss(method="topk", keep_ratio=0.5)], steps=3, **kwargs).fit(fresh)
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())  # it trained
    for key, value in fresh.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def _tiny_llama(vocab):
    config = {"vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}
    return HFCausalLM(model_type="llama", config=config)


def test_hf_reference_with_another_vocabulary_is_refused_before_the_first_step():
    callback = SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=_tiny_llama(80))
    with pytest.raises(ValueError, match=r"reference='<HFCausalLM>' is not allowed: its vocab_size=80 differs from "
                                         r"the model's vocab_size=64"):
        callback.setup(_trainer([callback]), _tiny_llama(64), "fit")


def test_reference_checkpoint_of_another_class_is_refused_before_the_first_step(tmp_path):
    demo = DemoGPT(**tiny_gpt_kwargs())
    path = tmp_path / "demo.ckpt"
    torch.save({"state_dict": demo.state_dict(), "hyper_parameters": dict(demo.hparams),
                "pytorch-lightning_version": lightning.__version__}, path)
    callback = SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=str(path))
    with pytest.raises(ValueError, match=r"reference='.*demo.ckpt' is not allowed: it is not a checkpoint of the "
                                         r"model's class HFCausalLM .*expected a Lightning checkpoint of HFCausalLM"):
        callback.setup(_trainer([callback]), _tiny_llama(512), "fit")


def test_choice_arguments_are_typed_with_literal():
    hints = typing.get_type_hints(SelectiveTokenLoss.__init__)
    assert typing.get_args(hints["method"]) == METHODS
    assert typing.get_args(hints["score"]) == SCORES
    assert typing.get_args(hints["scope"]) == ("batch", "global")


def test_non_finite_losses_on_one_rank_stop_every_rank_together(tmp_path):
    """Rank 1 alone has a NaN at step 1: both ranks raise at that step, instead of rank 1 raising while
    rank 0 waits in the gradient all-reduce."""
    from pathlib import Path

    from tests.ddp import run_script

    run_script(Path(__file__).parent / "ddp_non_finite.py", tmp_path, timeout=240)
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert message.startswith("FloatingPointError at step 1:") and "2 per-token losses over all ranks are not finite" in message  # one NaN column, 2 rows


class _ValidatesWithTrainingStep(lightning.LightningModule):
    """A common pattern: validation_step reuses training_step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
        self.val_losses: list[float] = []
        self.grads: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.head(self.embed(ids[:, :-1]))
        labels = ids[:, 1:].clone()
        labels[:, : int(ids[0, 0]) % 3] = -100  # valid-token counts differ between batches
        losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        return TokenLosses(losses, labels != -100)

    def validation_step(self, batch, batch_idx):
        out = self.training_step(batch, batch_idx)
        mean = out["token_losses"][out["mask"]].mean()
        self.val_losses.append((type(out).__name__, float(out["loss"]), float(mean)))

    def on_before_optimizer_step(self, optimizer):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.parameters()]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_validating_mid_window(callbacks, validate):
    model = _ValidatesWithTrainingStep()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 16, (12, 6))), batch_size=2)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                val_check_interval=3 if validate else None, check_val_every_n_epoch=None if validate else 1,
                                limit_val_batches=2 if validate else 0, callbacks=callbacks)
    trainer.fit(model, data, data)
    return model


def test_a_validation_step_calling_training_step_gets_the_plain_output_and_changes_no_gradient():
    """Validation in the middle of an accumulation window neither counts in the step's tokens nor is selected."""
    without = _fit_validating_mid_window([SelectiveTokenLoss(method="topk", keep_ratio=0.5)], validate=False)
    with_validation = _fit_validating_mid_window([SelectiveTokenLoss(method="topk", keep_ratio=0.5)], validate=True)
    assert len(without.grads) == len(with_validation.grads) == 3
    for a, b in zip(without.grads, with_validation.grads):
        assert torch.equal(a, b)
    assert len(with_validation.val_losses) >= 2
    for kind, loss, mean in with_validation.val_losses:  # the module's own output: the mean over every valid token
        assert kind == "TokenLosses" and loss == pytest.approx(mean, rel=1e-6)


def test_a_resumed_run_scales_its_steps_as_the_uninterrupted_one_to_the_last_bit(tmp_path):
    """The step normaliser's scale is in the checkpoint: a mid-run resume gives bitwise the same parameters."""

    def trainer(steps, callbacks):
        return lightning.Trainer(accelerator="cpu", max_steps=steps, accumulate_grad_batches=2, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 limit_val_batches=0, callbacks=callbacks)

    from lightning_efficient.resumable import ResumableDataLoader

    data = ResumableDataLoader(torch.utils.data.TensorDataset(torch.randint(0, 16, (24, 6))), batch_size=2)
    straight = _ValidatesWithTrainingStep()
    trainer(4, [SelectiveTokenLoss(method="none")]).fit(straight, data)
    first = _ValidatesWithTrainingStep()
    head = trainer(2, [SelectiveTokenLoss(method="none")])
    head.fit(first, data)
    head.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = _ValidatesWithTrainingStep()
    trainer(4, [SelectiveTokenLoss(method="none")]).fit(resumed, data, ckpt_path=tmp_path / "mid.ckpt")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


class _WrappedTransformer(lightning.LightningModule):
    """A user's module holding Lightning's demo Transformer as ``self.model`` (its vocab_size is the inner model's)."""

    def __init__(self, vocab: int):
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=vocab, ninp=16, nhead=2, nhid=32, nlayers=1)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"], batch["labels"])
        return TokenLosses(F.cross_entropy(logits, batch["labels"].reshape(-1), reduction="none").view_as(batch["labels"]))


def test_a_reference_wrapping_a_model_of_another_vocabulary_is_refused_before_the_first_step():
    # a new user's trial: the check looked only at the LightningModule itself, which declares no vocabulary
    callback = SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=_WrappedTransformer(128))
    with pytest.raises(ValueError, match=r"its vocab_size=128 differs from the model's vocab_size=96"):
        callback.setup(_trainer([callback]), _WrappedTransformer(96), "fit")


def test_the_vocabulary_of_a_module_is_found_in_its_submodules_unless_they_declare_several():
    from lightning_efficient.tokens.callback import _vocab_size

    assert _vocab_size(_WrappedTransformer(96)) == 96

    class TwoVocabularies(_WrappedTransformer):
        def __init__(self):
            super().__init__(96)
            from lightning.pytorch.demos import Transformer

            self.source = Transformer(vocab_size=500, ninp=16, nhead=2, nhid=32, nlayers=1)  # another vocabulary

    assert _vocab_size(TwoVocabularies()) is None  # which one scores is not known: not checked (not a false refusal)


def test_a_reference_module_is_put_back_as_it_was_when_the_fit_ends_or_raises():
    # a new user's trial: the reference stayed in eval mode, frozen, with its logging replaced
    reference = _WrappedTransformer(96)
    reference.model.decoder.weight.requires_grad_(False)  # the user's own settings, kept
    reference.model.pos_encoder.eval()
    for fails in (False, True):
        callbacks = [SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=reference)]
        if fails:
            callbacks.append(_RaiseOnce(at=1))
        rows = [{"input_ids": torch.randint(0, 96, (12,)), "labels": torch.randint(0, 96, (12,))} for _ in range(8)]

        class Model(_WrappedTransformer):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self, rows=rows):
                return torch.utils.data.DataLoader(rows, batch_size=4)

        with pytest.raises(RuntimeError, match="interrupted") if fails else contextlib.nullcontext():
            _trainer(callbacks, steps=2).fit(Model(96))
        assert reference.training and "log" not in vars(reference) and "log_dict" not in vars(reference)
        assert not reference.model.pos_encoder.training and reference.model.decoder.training
        assert [p.requires_grad for p in reference.parameters()].count(False) == 1


class _ManualTiny(Tiny):
    """:class:`Tiny` under manual optimization: backward and step inside training_step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.manual_backward(out["loss"])
        self.optimizers().step()
        self.optimizers().zero_grad()
        return out


class _LateManualTiny(_ManualTiny):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = True

    def configure_model(self):
        self.automatic_optimization = False


def test_manual_optimization_is_refused_before_the_first_step_with_the_reason():
    # a new user's trial: under manual optimization the selection, made after training_step returned, never reached
    # the backward training_step had run (top-k at 0.25 trained exactly as no callback), while a warning said it applied
    model = _ManualTiny()
    with pytest.raises(ValueError, match=r"refused under manual optimization .* no selection would reach the gradients"):
        _trainer([SelectiveTokenLoss(method="topk", keep_ratio=0.25)]).fit(model)
    # review: a module that turns automatic optimization off in its configure_model (after the callback's setup, which
    # wrapped training_step) is refused too, and keeps no wrapper
    model = _LateManualTiny()
    with pytest.raises(ValueError, match=r"refused under manual optimization"):
        _trainer([SelectiveTokenLoss(method="topk", keep_ratio=0.25)]).fit(model)
    assert "training_step" not in vars(model) and "optimizer_step" not in vars(model)


def _draw_in_a_spawned_process(rank, callback):
    """Run in the spawned process: the callback arrived, and its generator draws as the launching process's would."""
    callback.generator.manual_seed(7)
    drawn = torch.rand(3, generator=callback.generator)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(7)))


def test_the_callback_reaches_processes_that_ddp_spawn_starts():
    # a new user's trial: every ddp_spawn fit failed before its first step, also with method="none": the callback's
    # torch.Generator went to the spawned processes with its state through torch's shared memory, which failed here
    # ("unable to resize file"); it is made again there, and seeded before every draw as before. (ddp_spawn sends the
    # callbacks this way; a whole ddp_spawn fit trained in the trial, but its gloo processes abort at exit now and then
    # here, "terminate called without an active exception", with or without the callback)
    callback = SelectiveTokenLoss(method="random", keep_ratio=0.5)
    callback.generator.manual_seed(3)
    torch.rand(5, generator=callback.generator)  # a used generator, as after a step
    torch.multiprocessing.start_processes(_draw_in_a_spawned_process, args=(callback,), nprocs=1, start_method="spawn")


@pytest.mark.parametrize("method", ["none", "topk"])
def test_the_fit_start_line_names_the_keep_ratio_only_where_one_applies(method, caplog):
    with caplog.at_level(logging.INFO):
        _trainer([SelectiveTokenLoss(method=method, keep_ratio=0.7)], steps=1).fit(_TinyLearning())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SelectiveTokenLoss: method=")]
    assert len(said) == 1, said
    assert ("keep_ratio=0.7" in said[0]) == (method != "none"), said[0]


class _NormedTiny(Tiny):
    """The accumulation tests' token model with a BatchNorm over its hidden features (what StochasticWeightAveraging
    recomputes in an epoch of its own, without backward) and a learning rate."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(self.emb.embedding_dim)

    def hidden(self, ids):
        embedded = self.emb(ids)
        return torch.tanh(self.norm(embedded.flatten(0, 1)).view_as(embedded))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_stochastic_weight_averagings_batch_norm_epoch_without_gradients_finishes_as_plain_lightning():
    """A new user's trial: SWA's extra epoch, which recomputes the batch-norm statistics with no backward, raised
    "Tensor list must have at least one tensor" from the gradient normalisation."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def fit(callbacks):
        lightning.seed_everything(0)
        model = _NormedTiny().double()
        _trainer([StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1), *callbacks], steps=-1, max_epochs=2,
                 precision="64-true").fit(model)
        return model

    plain, mine = fit([]), fit([SelectiveTokenLoss(method="none")])
    assert mine.norm.num_batches_tracked == plain.norm.num_batches_tracked > 0
    for a, b in zip(plain.state_dict().values(), mine.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    # no gradient held at all (the helper's case under hetero_ddp): nothing to scale, no error
    from lightning_efficient.tokens.normalize import StepTokenNormaliser

    normaliser, weight = StepTokenNormaliser(), torch.nn.Parameter(torch.ones(3))
    for count in (4, 2):
        normaliser.micro_batch_loss(weight.sum() * count, count, accumulation=2)
    normaliser.normalise_gradients(torch.optim.SGD([weight], lr=0.1))
    assert weight.grad is None and normaliser.scale == 6.0


class _ScalarReference(_WrappedTransformer):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.model(batch["input_ids"], batch["labels"]), batch["labels"].reshape(-1))


class _TrainedTransformer(_WrappedTransformer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        rows = [{"input_ids": torch.randint(0, 96, (8,), generator=generator), "labels": torch.randint(0, 96, (8,), generator=generator)}
                for _ in range(8)]
        return torch.utils.data.DataLoader(rows, batch_size=4)


def test_a_reference_returning_a_scalar_is_named_as_the_reference_not_the_trained_module():
    # a new user's trial: the message said "training_step returned a scalar tensor" of a module returning TokenLosses
    callback = SelectiveTokenLoss(method="rho1", keep_ratio=0.5, reference=_ScalarReference(96))
    with pytest.raises(TypeError, match=r"needs per-token losses, but the reference's training_step \(_ScalarReference\) "
                                        r"returned a scalar tensor \(\)"):
        _trainer([callback], steps=1).fit(_TrainedTransformer(96))


class _SkipsABatch(_TinyLearning):
    """Returns None for one batch, which Lightning passes over (a new user's module skipping a batch on purpose)."""

    def __init__(self, skipped):
        super().__init__()
        self.skipped = skipped

    def training_step(self, batch, batch_idx):
        return None if batch_idx == self.skipped else super().training_step(batch, batch_idx)


def test_a_training_step_returning_none_skips_its_batch_as_in_plain_lightning():
    # a new user's trial: SelectiveTokenLoss raised "needs per-token losses, but training_step returned NoneType"
    def fit(callbacks):
        lightning.seed_everything(0)
        model = _SkipsABatch(skipped=1).double()
        trainer = _trainer(callbacks, steps=3, precision="64-true")
        trainer.fit(model)
        return model, trainer

    plain, plain_trainer = fit([])
    selected, trainer = fit([SelectiveTokenLoss(method="none")])
    assert trainer.global_step == plain_trainer.global_step == 3
    for (name, value), reference in zip(selected.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12, msg=name)
