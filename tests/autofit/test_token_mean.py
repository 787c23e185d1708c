"""The token mean AutoFit keeps where its plan splits the batch: the wrapper itself in real fits (float64, against plain
Lightning on the unsplit batch). AutoFit installing it: tests/autofit/test_callback.py."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning
import pytest
import torch

from lightning_efficient import CorpusDataModule, DemoGPT, SelectiveTokenLoss, StepTokenMean
from lightning_efficient.autofit.token_mean import BatchTokenMean
from tests.conftest import tiny_gpt_kwargs
from tests.ddp import run_script
from tests.tokens.accumulation_model import Rows, Tiny, TinyWithoutBatchIndex, fit, make_rows, reference_step_grads

TOKENS = Path(__file__).resolve().parent.parent / "tokens"


class PaddedGPT(DemoGPT):
    """The demo GPT on rows of different valid lengths, as padded batches are: each sample's labels past a length
    read from its own first token are -100 (the same whatever batch it is in)."""

    def token_losses(self, batch):
        labels = batch["labels"].clone()
        lengths = 1 + batch["input_ids"][:, :1] % labels.shape[1]
        labels[torch.arange(labels.shape[1], device=labels.device) >= lengths] = -100
        return super().token_losses({**batch, "labels": labels})


class ScalarGPT(PaddedGPT):
    """The same loss returned as a scalar: what AutoFit cannot re-weigh."""

    def training_step(self, batch, batch_idx):
        return self.token_losses(batch)["loss"]


class Installs(lightning.Callback):
    """Installs the token mean as AutoFit does when its plan splits the batch."""

    def __init__(self) -> None:
        self.mean = BatchTokenMean()
        self.first_gradients: list[torch.Tensor] | None = None

    def on_fit_start(self, trainer, pl_module):
        self.mean.install(trainer, pl_module, "one batch of 8")

    def teardown(self, trainer, pl_module, stage):
        self.mean.remove()


class FirstGradients(lightning.Callback):
    """The gradients the first optimizer step takes (after every normalisation)."""

    def __init__(self) -> None:
        self.gradients: list[torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.gradients is None:
            self.gradients = [p.grad.detach().clone() for p in pl_module.parameters()]


def _fit(kwargs, model_class, callbacks, *, batch_size, accumulate, fused=False, precision="64-true", steps=3):
    lightning.seed_everything(0)
    model = model_class(**tiny_gpt_kwargs(), fused_loss=fused)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate, precision=precision,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, callbacks=callbacks)
    trainer.fit(model, CorpusDataModule(**{**kwargs, "batch_size": batch_size}))
    return model


def _largest_difference(a, b) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("fused", [False, True])
def test_the_split_batch_trains_as_the_whole_batch_in_float64(fused, small_datamodule_kwargs):
    whole = _fit(small_datamodule_kwargs, PaddedGPT, [], batch_size=8, accumulate=1, fused=fused)
    installs = Installs()
    split = _fit(small_datamodule_kwargs, PaddedGPT, [installs], batch_size=2, accumulate=4, fused=fused)
    plain_split = _fit(small_datamodule_kwargs, PaddedGPT, [], batch_size=2, accumulate=4, fused=fused)
    assert _largest_difference(split, whole) < 1e-12
    assert _largest_difference(plain_split, whole) > 1e-4  # what Lightning's mean of micro-batch means gives
    # the hooks are the class's again
    assert "training_step" not in vars(split) and "optimizer_step" not in vars(split) and not installs.mean.installed


def test_the_step_token_mean_callback_trains_the_split_batch_as_the_whole_and_stands_aside_for_selective_token_loss(
        small_datamodule_kwargs):
    """What ``lightning-efficient plan`` puts in the config it prints for a plan that splits the batch (a new user's
    trial: that config trained 7e-2 away from AutoFit's own fit)."""
    whole = _fit(small_datamodule_kwargs, PaddedGPT, [], batch_size=8, accumulate=1)
    mean = StepTokenMean()
    split = _fit(small_datamodule_kwargs, PaddedGPT, [mean], batch_size=2, accumulate=4)
    assert _largest_difference(split, whole) < 1e-12
    assert "training_step" not in vars(split) and not mean._mean.installed
    beside = StepTokenMean()
    _fit(small_datamodule_kwargs, PaddedGPT, [beside, SelectiveTokenLoss(method="none")], batch_size=2, accumulate=4, steps=1)
    assert not beside._mean.installed and beside.state_dict() == {}  # (a checkpoint asks for no callback it holds nothing of)


class RaisesAtStep(lightning.Callback):
    """Raises at the end of the first optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        raise RuntimeError("raised by the test")


def test_the_step_token_mean_callback_leaves_nothing_behind_when_a_fit_raises_and_stands_aside_for_autofits_own(
        small_datamodule_kwargs, caplog):
    """A review: Lightning skips teardown when fit raises; the wrapper left on the module weighed the next fit's steps
    by the raised fit's accumulation (gradients 1-6x off). Beside AutoFit, whose plan splits the batch, only one of the
    two wraps the step (both did, and the outer one said the step returned a dict, not TokenLosses)."""
    from lightning_efficient import AutoFit

    mean = StepTokenMean()
    with pytest.raises(RuntimeError, match="raised by the test"):
        _fit(small_datamodule_kwargs, PaddedGPT, [mean, RaisesAtStep()], batch_size=2, accumulate=4)
    assert not mean._mean.installed
    whole = _fit(small_datamodule_kwargs, PaddedGPT, [], batch_size=8, accumulate=1)
    with caplog.at_level(logging.INFO):
        beside = _fit(small_datamodule_kwargs, PaddedGPT, [AutoFit(budget="8GiB", micro_batches=[2], activation_policies=["keep"],
                                                                   optimizer_options=["32-bit"]), StepTokenMean()],
                      batch_size=8, accumulate=1)
    assert _largest_difference(beside, whole) < 1e-12
    assert not any("training_step returns dict" in r.getMessage() for r in caplog.records)
    # a count loaded while the callback is installed (ModelParallelStrategy restores after on_fit_start) is this fit's
    mean._mean.install(lightning.Trainer(logger=False), DemoGPT(**tiny_gpt_kwargs()), "one batch")
    mean.on_load_checkpoint(None, None, {"step_token_mean_counts": {"step_token_scale": 12.0, "rank_token_count": 5.5}})
    assert mean._mean.normaliser.scale == 12.0 and mean._restored == {}
    assert mean._mean.rank_mean.previous_count == 5.5
    saved = {}
    mean.on_save_checkpoint(None, None, saved)
    assert saved == {"step_token_mean_counts": {"step_token_scale": 12.0, "rank_token_count": 5.5}} and mean.state_dict() == {}
    mean._mean.remove()
    mean.load_state_dict({"step_token_scale": 7.0})  # a checkpoint from before the counts moved to the top level
    assert mean._restored == {"step_token_scale": 7.0}


def test_a_scalar_loss_passes_as_it_is_and_is_named_once(small_datamodule_kwargs, caplog):
    caplog.set_level(logging.INFO)
    plain = _fit(small_datamodule_kwargs, ScalarGPT, [], batch_size=2, accumulate=4)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        split = _fit(small_datamodule_kwargs, ScalarGPT, [Installs()], batch_size=2, accumulate=4)
    assert _largest_difference(split, plain) == 0.0
    told = [r.getMessage() for r in caplog.records if "training_step returns Tensor" in r.getMessage()]
    assert len(told) == 1 and "one batch of 8" in told[0] and "TokenLosses" in told[0]


def test_a_scalar_loss_over_float_features_is_not_told_about_tokens(caplog):
    """A new user's trial: an MLP on float features was told its loss may be a mean over tokens of varying count and to
    return TokenLosses; a batch without token ids has no tokens to weigh."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        lightning.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          callbacks=[StepTokenMean()]).fit(BoringModel())
    assert not any("training_step returns" in r.getMessage() for r in caplog.records)


def _assert_steps_equal(steps, init, micro_of_step):
    assert len(steps) == 2
    for step, grads in enumerate(steps):
        want = reference_step_grads(init, "none", micro_of_step(step))
        for name, grad in want.items():
            assert (grads[name] - grad).abs().max() <= 1e-12, name


@pytest.mark.parametrize("method", ["batch_token_mean", "none"])
@pytest.mark.parametrize("module_class", [Tiny, TinyWithoutBatchIndex])
@pytest.mark.parametrize("fused", [False, True])
def test_each_step_is_the_mean_over_its_valid_tokens_as_one_batch_in_plain_torch(fused, module_class, method):
    """Micro-batches of 2 samples holding 2 and 12 valid tokens, then 16 and 3: each step's gradient is plain torch's
    mean over the step's valid tokens (not the mean of the two micro-batch means), by AutoFit's wrapper and by
    SelectiveTokenLoss(method="none"), also for a ``training_step(self, batch)`` (a review: counted from index 0 at
    every micro-batch, the steps were scaled 1.17 and 6.33 times)."""
    run = fit(method, "batch", fused=fused, module_class=module_class)
    _assert_steps_equal(run.steps, run.init, lambda step: [[4 * step, 4 * step + 1], [4 * step + 2, 4 * step + 3]])


def test_under_ddp_each_rank_takes_its_own_token_mean_which_ddp_averages_as_for_the_unsplit_batch(tmp_path):
    """2 processes, micro-batches of 2 samples, accumulation 2: each step's gradient is the mean over the ranks of each
    rank's token mean over its 4 samples, what plain DDP gives on batches of 4 (the plan must not change the update
    by splitting: a review found the global token mean here, and plain DDP's rank means where the plan did not split)."""
    out = tmp_path / "grads.pt"
    run_script(TOKENS / "ddp_accumulate.py", out, "batch_token_mean", "batch")
    saved = torch.load(out)
    assert torch.equal(torch.cat(saved["batches"]), make_rows()[0][0::2])  # rank r reads samples r, r + 2, ...
    assert len(saved["steps"]) == 2
    for step, grads in enumerate(saved["steps"]):
        first = 8 * step
        per_rank = [reference_step_grads(saved["init"], "none", [[first + r, first + r + 2], [first + r + 4, first + r + 6]])
                    for r in (0, 1)]
        global_mean = reference_step_grads(saved["init"], "none", [list(range(first, first + 8))])
        for name, grad in grads.items():
            want = (per_rank[0][name] + per_rank[1][name]) / 2
            assert (grad - want).abs().max() <= 1e-12, name
        assert max(float((grads[n] - g).abs().max()) for n, g in global_mean.items()) > 1e-4  # the rows differ in length


def test_under_fsdp2_the_step_is_the_mean_over_every_ranks_valid_tokens(tmp_path):
    """FSDP2 reduces the gradients at every backward, so a rank's own mean cannot be made after the fact: the step is
    the global batch's token mean (what the README says; plain FSDP2 on the unsplit batch averages the ranks' means)."""
    out = tmp_path / "grads.pt"
    run_script(TOKENS / "fsdp_accumulate.py", out)
    saved = torch.load(out)
    _assert_steps_equal(saved["steps"], saved["init"],
                        lambda step: [list(range(8 * step, 8 * step + 4)), list(range(8 * step + 4, 8 * step + 8))])


def test_under_fsdp2_lightning_hands_on_each_micro_batchs_own_loss_also_after_a_short_step(tmp_path):
    """A session's trial: the step after a short one (an epoch's last) handed ``on_train_batch_end`` each micro-batch's
    loss times the step's accumulation (its stand-in count was the short step's); what a plain fit hands on is the
    module's own loss over the accumulation, and its gradients are weighed for the step all the same."""
    out = tmp_path / "shown.pt"
    run_script(TOKENS / "fsdp_accumulate.py", out, "shown")
    for rank in (0, 1):
        saved = torch.load(f"{out}.{rank}")
        assert saved["steps"] == [0, 0, 0, 1, 2, 2, 2]  # 4 micro-batches an epoch: steps of 3, 1 (short), then 3
        for shown, own in saved["pairs"]:
            assert shown == own


def test_in_one_process_lightning_hands_on_each_micro_batchs_own_loss():
    """With the rank's own token mean (one process, DDP), too: the loss handed on is the module's own, bitwise as a plain
    fit's, where the weighted loss's value was its stand-in count's (a step's earlier micro-batches) or the step's."""
    from tests.tokens.accumulation_model import KeepsOwnLoss, OwnLossShown

    def fit_recording(callbacks):
        torch.manual_seed(0)
        losses = OwnLossShown()
        lightning.Trainer(accelerator="cpu", max_steps=4, accumulate_grad_batches=3, precision="64-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[losses, *callbacks]).fit(KeepsOwnLoss())
        return losses

    plain, mine = fit_recording([]), fit_recording([StepTokenMean()])
    assert mine.steps == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3]  # 8 micro-batches an epoch: steps of 3, 3, 2 (short), 3
    assert mine.pairs == plain.pairs
    assert all(shown == own for shown, own in mine.pairs)


class LearnsTiny(Tiny):
    """:class:`Tiny` with a learning rate (the steps move the weights) and a ``batch_size`` to set."""

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Rows(), batch_size=self.batch_size)


@pytest.mark.parametrize("via", ["StepTokenMean", "AutoFit"])
def test_a_resume_in_one_process_weighs_its_first_step_as_the_uninterrupted_run(tmp_path, via):
    """A new user's trial: a resumed first step's stand-in count was its first micro-batch's, where the uninterrupted
    run's is the previous step's: weights 2.2e-16 apart in float64 where plain Lightning resumes bitwise. The checkpoint
    keeps the rank's running count in one process, also one saved after fit returned (a review). Resumed at an epoch's
    end (16 rows): under StepTokenMean after its short step (micro-batches of 2, steps of 3, 3, 2), under AutoFit after
    4 batches of 4 split 2 x 2."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_efficient import AutoFit

    batch_size, accumulation, epoch_steps = (2, 3, 3) if via == "StepTokenMean" else (4, 1, 4)

    def fit(ckpt_path=None, steps=epoch_steps + 2, save_after=None, mean=True, epochs=None):
        torch.manual_seed(0)
        means = [] if not mean else [StepTokenMean() if via == "StepTokenMean" else AutoFit(
            budget="8GiB", micro_batches=[2], optimizer_options=["32-bit"], activation_policies=["keep"])]
        saving = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=epoch_steps, save_top_k=-1)] if ckpt_path is None else []
        model = LearnsTiny(batch_size).double()  # (built in float64: a checkpoint loads into it unrounded)
        trainer = lightning.Trainer(accelerator="cpu", max_steps=steps, max_epochs=epochs, precision="64-true", logger=False,
                                    enable_checkpointing=ckpt_path is None, enable_progress_bar=False, enable_model_summary=False,
                                    accumulate_grad_batches=accumulation, callbacks=[*means, *saving], default_root_dir=tmp_path)
        trainer.fit(model, ckpt_path=ckpt_path)
        if save_after is not None:
            trainer.save_checkpoint(save_after)
        return model

    uninterrupted = fit()
    resumed = fit(str(tmp_path / f"epoch=0-step={epoch_steps}.ckpt"))
    assert _largest_difference(resumed, uninterrupted) == 0.0
    fit(steps=-1, epochs=1, save_after=tmp_path / "after.ckpt")  # (Lightning resumes a fit ended at max_epochs=1 ...)
    two_epochs = fit(steps=-1, epochs=2)  # (... as the fit of max_epochs=2, not one of max_steps)
    assert _largest_difference(fit(str(tmp_path / "after.ckpt"), steps=-1, epochs=2), two_epochs) == 0.0
    if via == "StepTokenMean":  # the counts are not the callback's state: a resume without it is not asked for it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(str(tmp_path / "after.ckpt"), mean=False)
        assert not any("StepTokenMean" in str(w.message) for w in caught), [str(w.message) for w in caught]


class WrapsTheStepToo(lightning.Callback):
    """Another callback that wraps ``training_step`` on the instance for a fit, on top of the token mean's, and puts
    back what it found when the fit ends."""

    def on_fit_start(self, trainer, pl_module):
        self.found = pl_module.training_step
        pl_module.training_step = lambda *args, **kwargs: self.found(*args, **kwargs)

    def teardown(self, trainer, pl_module, stage):
        pl_module.training_step = self.found


def test_a_wrapper_left_under_another_callbacks_passes_every_call_through_after_the_fit(small_datamodule_kwargs):
    """A review: put back by a callback that wrapped the step on top of it, the token mean's wrapper outlived its fit and
    weighed the next fit's first step by the old fit's counts (6x the gradient)."""
    model = _fit(small_datamodule_kwargs, PaddedGPT, [Installs(), WrapsTheStepToo()], batch_size=2, accumulate=4)
    assert "training_step" in vars(model)  # ours, put back under the other's
    fresh = PaddedGPT(**tiny_gpt_kwargs()).double()
    fresh.load_state_dict(model.state_dict())
    for module in (model, fresh):  # the same plain fit of both
        lightning.seed_everything(1)
        lightning.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=4, precision="64-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=0).fit(module, CorpusDataModule(**{**small_datamodule_kwargs, "batch_size": 2}))
    assert _largest_difference(model, fresh) == 0.0


def test_the_rank_mean_rescales_what_the_steps_earlier_backwards_held_and_nothing_else():
    """The gradients held at a step's last micro-batch are rescaled from the stand-in count to the step's count only
    where a backward of this step put them there: not an earlier step's left by a step that ran no backward
    (StochasticWeightAveraging's batch-norm epoch), not at a step's first micro-batch."""
    from lightning_efficient.tokens.normalize import RankStepTokenMean

    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step(counts, backward):
        mean = RankStepTokenMean()
        weight.grad = torch.full_like(weight, 5.0)  # what an earlier step left
        for i, count in enumerate(counts):
            loss = mean.micro_batch_loss(weight.sum() * count, count, len(counts), first=i == 0, last=i == len(counts) - 1,
                                         optimizers=[optimizer])
            if backward:
                loss.backward()
        return weight.grad.clone()

    assert torch.equal(step([4, 2], backward=False), torch.full((3,), 5.0, dtype=torch.float64))
    # with backwards: (5 + 4 * 2 / 8) * 8 / 6 + 2 * 2 / 6, before Lightning's division by the accumulation
    torch.testing.assert_close(step([4, 2], backward=True), torch.full((3,), (5 + 1) * 8 / 6 + 4 / 6, dtype=torch.float64))
    torch.testing.assert_close(step([3], backward=True), torch.full((3,), 5 + 1.0, dtype=torch.float64))


def test_the_rank_means_stand_in_count_is_the_previous_steps_so_a_short_first_row_does_not_inflate_the_gradients():
    """A review: with the first micro-batch's count as the stand-in, a padded first row of one valid token scaled the
    step's earlier gradients up to the step's count over it (x 130 in its case), and an fp16 GradScaler skipped 5 of 24
    steps (plain Lightning: none). The stand-in is the previous step's count from the second step on."""
    from lightning_efficient.tokens.normalize import RankStepTokenMean

    weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    mean = RankStepTokenMean()
    for i, count in enumerate([100, 160]):  # a first step of 260 tokens
        mean.micro_batch_loss(weight * count, count, 2, first=i == 0, last=i == 1, optimizers=[optimizer]).backward()
    first_of_next = mean.micro_batch_loss(weight * 1, 1, 2, first=True, last=False, optimizers=[optimizer])
    assert _gradient(first_of_next, weight) == 1 * 2 / 260  # not 1 * 2 / (1 * 2)
    mean.reset()  # a new fit starts from its first micro-batch's count
    assert _gradient(mean.micro_batch_loss(weight * 1, 1, 2, first=True, last=False, optimizers=[optimizer]), weight) == 1.0


def _gradient(loss: torch.Tensor, weight: torch.Tensor) -> float:
    """d loss / d weight (a weighted micro-batch loss's value is its own mean; its gradient carries the weight)."""
    return float(torch.autograd.grad(loss, weight)[0])


class SkipsTwo(Tiny):
    """:class:`Tiny` skipping (returning None) micro-batches 1 and 2: the last of step 0 and the first of step 1."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx in (1, 2) else super().training_step(batch, batch_idx)


class SkipsThird(Tiny):
    """:class:`Tiny` skipping micro-batch 3, the last of step 1, after a whole step 0."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 3 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("method", ["batch_token_mean", "none"])
@pytest.mark.parametrize(("module_class", "trained"), [(SkipsTwo, [[[0, 1]], [[6, 7]]]),
                                                       (SkipsThird, [[[0, 1], [2, 3]], [[4, 5]]])])
def test_a_step_with_a_micro_batch_returning_none_is_the_mean_over_the_tokens_that_trained(method, module_class, trained):
    """Each step's gradient is plain torch's token mean over the micro-batches that trained. SkipsTwo: step 0 trains
    micro-batch 0 alone (its last returned None), step 1 micro-batch 3 alone (its first did); a review: step 1 had
    counted step 0's tokens into its own. Both: a step whose last micro-batch returned None was left at the stand-in
    count's scale (half the mean at a fit's first step; at a later one the previous step's count over this one's)."""
    run = fit(method, "batch", module_class=module_class)
    for step, micro_batches in enumerate(trained):
        want = reference_step_grads(run.init, "none", micro_batches)
        for name, grad in want.items():
            assert (run.steps[step][name] - grad).abs().max() <= 1e-12, (step, name)


def test_the_rank_means_stand_in_is_per_micro_batch_so_another_accumulation_keeps_the_scale():
    """A review: under a GradientAccumulationScheduler going from 1 to 4 micro-batches a step, the previous step's count
    (one micro-batch's) stood in for four micro-batches', and the earlier micro-batches ran 6.6x above the gradients'
    scale. The stand-in is the previous step's count per micro-batch times this step's accumulation."""
    from lightning_efficient.tokens.normalize import RankStepTokenMean

    weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    mean = RankStepTokenMean()
    mean.micro_batch_loss(weight * 10, 10, 1, first=True, last=True, optimizers=[optimizer]).backward()  # 10 a micro-batch
    first_of_next = mean.micro_batch_loss(weight * 8, 8, 4, first=True, last=False, optimizers=[optimizer])
    assert _gradient(first_of_next, weight) == 8 * 4 / (10 * 4)  # not 8 * 4 / 10
