"""AutoFit against plain Lightning where an epoch ends on a short batch that the plan splits into micro-batches: a
loss that is a mean over the micro-batch's samples weighs the short batch's samples as plain Lightning's step does."""

from pathlib import Path

import lightning
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import AutoFit
from lightning_efficient._validation import SettingRefused
from lightning_efficient.autofit.token_mean import short_batch_weight


class _Regression(lightning.LightningModule):
    """A linear regression on a dataset of ``samples``, drawn in batches of ``batch_size`` (the last one short),
    returning the mean squared error over its (micro-)batch; each step's gradient recorded."""

    def __init__(self, samples: int, batch_size: int, dict_output: bool = False, own_generator: bool = False) -> None:
        super().__init__()
        self.samples, self.batch_size, self.dict_output, self.own_generator = samples, batch_size, dict_output, own_generator
        self.linear = nn.Linear(4, 1)
        self.gradients: list[torch.Tensor] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # what each training_step drew (measuring's too)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(self.samples, 4, generator=g, dtype=torch.float64),
                             torch.randn(self.samples, 1, generator=g, dtype=torch.float64))
        # (a generator of its own: torch's RandomSampler draws one more permutation from it where it is run to its end,
        # which your batch sampler is at a short last batch and the plan's is not where the micro-batch divides it)
        generator = torch.Generator().manual_seed(1) if self.own_generator else None
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, generator=generator)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append((x, y))
        loss = nn.functional.mse_loss(self.linear(x), y)
        return {"loss": loss} if self.dict_output else loss

    def on_before_optimizer_step(self, optimizer):
        self.gradients.append(self.linear.weight.grad.detach().clone())
        self.before_last_step = (self.linear.weight.detach().clone(), self.linear.bias.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(samples, batch, callbacks, accumulate=1, dict_output=False, max_epochs=2, own_generator=False):
    lightning.seed_everything(0)
    model = _Regression(samples, batch, dict_output, own_generator).double()
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=max_epochs, precision="64-true", accumulate_grad_batches=accumulate,
                                logger=False, enable_checkpointing=any(hasattr(c, "dirpath") for c in callbacks),
                                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model)
    return model, trainer


@pytest.mark.parametrize(("samples", "batch", "micro", "accumulate", "dict_output", "own_generator"), [
    (50, 6, 2, 1, False, False),  # a new user's: the short batch of 2 is one micro-batch; its step's gradient was a third
    (53, 6, 2, 1, True, False),  # the short batch of 5 in micro-batches of 2, 2 and 1
    (60, 8, 4, 2, False, False),  # your own accumulation: the last window holds a whole batch and a short one
    (50, 6, 2, 1, False, True),  # a DataLoader's own generator: the second epoch shuffled as plain Lightning's (a review)
    (53, 6, 2, 1, False, True),  # (the plan's sampler runs to its end itself: nothing to do)
])
def test_an_epochs_short_last_batch_split_into_micro_batches_trains_as_in_plain_lightning(samples, batch, micro, accumulate,
                                                                                          dict_output, own_generator):
    plain, plain_trainer = _fit(samples, batch, [], accumulate, dict_output, own_generator=own_generator)
    fit = AutoFit(budget="1GiB", micro_batches=[micro], optimizer_options=["32-bit"], activation_policies=["keep"])
    split, trainer = _fit(samples, batch, [fit], accumulate, dict_output, own_generator=own_generator)
    assert fit.plan.micro_batches == [micro] and fit.plan.accumulation == accumulate * batch // micro
    assert trainer.global_step == plain_trainer.global_step == len(plain.gradients) == len(split.gradients)
    for step, (mine, reference) in enumerate(zip(split.gradients, plain.gradients)):
        torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12, msg=f"step {step}")
    torch.testing.assert_close(split.linear.weight, plain.linear.weight, rtol=1e-12, atol=1e-12)


def test_the_short_batch_weight_is_one_for_whole_batches_and_weighs_each_sample_as_its_batchs_mean():
    # every sample of the epoch weighs 1 / (its batch's samples) in plain Lightning's step (times 1 / your accumulation,
    # which both divide by); a micro-batch's mean times the weight over the accumulation of micro-batches per batch gives it
    for samples, batch, micro in [(50, 6, 2), (53, 6, 2), (53, 6, 3), (7, 4, 1), (60, 8, 4)]:
        per_batch = batch // micro
        for index in range(-(-samples // micro)):
            size = min(micro, samples - index * micro)
            in_batch = min(batch, samples - index * micro // batch * batch)
            weight = short_batch_weight(index, samples=samples, batch=batch, micro=micro)
            assert weight / (per_batch * size) == pytest.approx(1 / in_batch, rel=1e-15)
            assert (weight == 1.0) == (in_batch == batch)


@pytest.mark.parametrize(("samples", "batch", "micro", "short"), [(50, 6, 2, 2), (53, 6, 3, 5), (48, 6, 2, None), (50, 6, 6, None)])
def test_a_plan_only_fit_names_the_short_last_batch_it_splits(samples, batch, micro, short):
    """What `lightning-efficient plan` keeps AutoFit for: a config of the plan's settings would weigh the short batch's
    micro-batches as Lightning's accumulation does (a third of plain Lightning's last step at 50 samples, 2 x 3)."""
    fit = AutoFit(budget="1GiB", micro_batches=[micro], optimizer_options=["32-bit"], activation_policies=["keep"],
                  plan_only=True)
    _fit(samples, batch, [fit])
    assert fit.plan is not None and fit.plan.micro_batches == [micro]
    assert fit.short_last_batch == short


def test_an_epoch_resumed_mid_way_from_a_dataloader_that_starts_its_data_over_weighs_nothing(tmp_path):
    """A review: a plain DataLoader resumed mid-epoch draws the epoch from its start while the batch indices go on (in
    plain Lightning too), so the index of the short batch held a full micro-batch, which was weighed 3 times (the last
    step's gradient norm 3.82 against plain Lightning's 1.66)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def resumed(callbacks):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1, filename="{step}")
        _fit(50, 6, [*callbacks(), checkpoint], max_epochs=1)
        lightning.seed_everything(0)
        model = _Regression(50, 6).double()
        trainer = lightning.Trainer(accelerator="cpu", max_epochs=1, precision="64-true", logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks())
        trainer.fit(model, ckpt_path=root / "step=4.ckpt")
        return model

    def autofit():
        return [AutoFit(budget="1GiB", micro_batches=[2], optimizer_options=["32-bit"], activation_policies=["keep"])]

    plain, split = resumed(list), resumed(autofit)
    assert len(split.gradients) == len(plain.gradients) == 5  # (steps 5 to 9, drawn from the epoch's start)
    for step, (mine, reference) in enumerate(zip(split.gradients[:4], plain.gradients[:4])):
        torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12, msg=f"step {step}")
    # the last step: the micro-batch at the short batch's index, samples 24 and 25 of the epoch drawn again (full),
    # divided by the accumulation as any other (plain Lightning's last step here is its batch of samples 24 to 29:
    # the indices count 25 micro-batches where its 9 batches hold 27, a difference of the restarted data left as it is)
    (x, y), (weight, bias) = split.batches[-1], split.before_last_step
    assert len(x) == 2
    inputs = weight.detach().clone().requires_grad_(True)
    loss = nn.functional.mse_loss(x @ inputs.T + bias, y) / 3
    (expected,) = torch.autograd.grad(loss, [inputs])
    torch.testing.assert_close(split.gradients[-1], expected, rtol=1e-12, atol=1e-12)


class _NormedRegression(_Regression):
    """The regression through a batch norm over its features: it cannot train on one sample."""

    def __init__(self, samples: int, batch_size: int) -> None:
        super().__init__(samples, batch_size)
        self.norm = nn.BatchNorm1d(4).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.linear(self.norm(x)), y)


def _plan_only(model, accumulate=1, **autofit):
    fit = AutoFit(budget="1GiB", optimizer_options=["32-bit"], activation_policies=["keep"], plan_only=True, **autofit)
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=1, precision="64-true", accumulate_grad_batches=accumulate,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[fit])
    trainer.fit(model)
    return fit.plan


def test_where_an_epoch_ends_on_a_short_batch_the_search_takes_micro_batches_that_weigh_it_as_plain_lightning():
    # a new user's trial: 100 samples in batches of 32 under accumulation 2 were planned at 64 (two batches merged),
    # whose last window's 36 samples are one mean where plain Lightning's step is the mean of 32's and 4's means
    plan = _plan_only(_Regression(100, 32), accumulate=2)
    assert 32 % plan.micro_batches[0] == 0
    assert any("micro-batches dividing your batch of 32 only" in note for note in plan.notes)
    assert not any("dividing your batch" in note for note in _plan_only(_Regression(96, 32), accumulate=2).notes)
    assert not any("dividing your batch" in note for note in _plan_only(_Regression(100, 32)).notes)  # (every size does)
    # a size of yours that does not divide it is taken, and the plan says what it changes
    mine = _plan_only(_Regression(50, 6), accumulate=2, micro_batches=[4])
    assert mine.micro_batches == [4]
    assert any("micro-batch 4 does not divide your batch of 6" in note for note in mine.notes)


def test_a_model_that_cannot_train_on_one_sample_gets_no_micro_batch_ending_its_epoch_on_one():
    # a new user's trial: 35 samples in batches of 8 at micro-batch 2 ended the epoch on one sample, where a batch norm
    # fails (plain Lightning trains the last batch of 3)
    plan = _plan_only(_NormedRegression(35, 8), micro_batches=[2, 4])
    assert plan.micro_batches == [4]
    with pytest.raises(SettingRefused, match=r"micro_batches=\[2\] is not allowed: .*epoch of 35 samples does not end on a "
                                             r"micro-batch of fewer than 2 .*your last batch holds 3"):
        _plan_only(_NormedRegression(35, 8), micro_batches=[2])
    lightning.seed_everything(0)
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=1, precision="64-true", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[AutoFit(budget="1GiB", optimizer_options=["32-bit"], activation_policies=["keep"])])
    trainer.fit(_NormedRegression(35, 8))
    assert 35 % trainer.callbacks[0].plan.micro_batches[0] != 1 and trainer.global_step == 5


class _ScheduledRegression(_Regression):
    """:class:`_Regression` in float32 under a OneCycleLR stepped every optimizer step."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        x, y = loader.dataset.tensors
        return DataLoader(TensorDataset(x.float(), y.float()), batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        steps = 2 * -(-self.samples // self.batch_size)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.rates = [*getattr(self, "rates", []), optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_the_short_batch_is_weighed_under_half_precision_and_a_per_step_scheduler_as_plain_lightning(precision):
    """Half precisions (16-mixed: Lightning's GradScaler, whose unscaled gradients the hook reads) and a OneCycleLR with
    momentum: every step's gradient within the precision's rounding of plain Lightning's, the last, short, one included
    (unweighed it is a third of plain's), and the same learning rate at every step."""
    def fitted(callbacks):
        lightning.seed_everything(0)
        model = _ScheduledRegression(50, 6)
        trainer = lightning.Trainer(accelerator="cpu", max_epochs=2, precision=precision, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    callbacks=callbacks)
        trainer.fit(model)
        return model

    plain = fitted([])
    split = fitted([AutoFit(budget="1GiB", micro_batches=[2], optimizer_options=["32-bit"], activation_policies=["keep"])])
    assert len(split.gradients) == len(plain.gradients) == 18 and split.rates == plain.rates
    for step, (mine, reference) in enumerate(zip(split.gradients, plain.gradients)):
        assert (mine - reference).norm() <= 0.03 * reference.norm(), f"step {step}: {mine} against {reference}"


def test_on_two_processes_under_ddp_and_fsdp2_the_short_batch_trains_as_in_plain_lightning(tmp_path):
    """Each rank's 25 samples (Lightning's DistributedSampler) in batches of 6 and a short one of 1, split 2 x 3: every
    step's gradient, the short steps' included (unweighed, a third of plain's), is plain Lightning's under ddp and
    under FSDP2 (ModelParallelStrategy, which reduces the gradients at every backward), in float64."""
    from tests.ddp import run_script

    run_script(Path(__file__).parent / "short_batch_run.py", tmp_path, timeout=600)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for strategy in ("ddp", "fsdp2"):
            plain, split = results[f"{strategy}-plain"], results[f"{strategy}-autofit"]
            assert "error" not in plain and "error" not in split, (plain.get("error"), split.get("error"))
            assert split["accumulation"] == 3 and len(split["gradients"]) == len(plain["gradients"]) == 10
            for step, (mine, reference) in enumerate(zip(split["gradients"], plain["gradients"])):
                torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12, msg=f"{strategy}, rank {rank}, step {step}")
            torch.testing.assert_close(split["weight"], plain["weight"], rtol=1e-12, atol=1e-12)
