"""With SelectiveTokenLoss, a step's gradient is the mean over every kept token of all its
micro-batches (and ranks), as one big batch gives: not a mean of micro-batch means."""

import lightning
import pytest
import torch

from tests.ddp import run_script
from tests.tokens.accumulation_model import fit, make_rows, reference_step_grads

HERE = __import__("pathlib").Path(__file__).resolve().parent


def _assert_equal(got, want, tol=1e-12):
    for name, grad in want.items():
        assert (got[name] - grad).abs().max() <= tol, name


@pytest.mark.parametrize(
    ("fused", "method", "clip"),
    [(False, "none", None), (False, "topk", None), (True, "none", None), (True, "topk", None),
     (False, "topk", 0.05), (True, "none", 0.05)],
)
def test_accumulated_step_equals_one_batch_over_its_tokens(fused, method, clip):
    # micro-batches of 2 samples hold 2 and 12 valid tokens (step 1), then 16 and 3 (step 2);
    # topk keeps each micro-batch's top half (scope="batch"), the reference the same sets
    run = fit(method, "batch", fused=fused, clip=clip)
    assert len(run.steps) == 2
    for step, grads in enumerate(run.steps):
        micro = [[4 * step, 4 * step + 1], [4 * step + 2, 4 * step + 3]]
        want = reference_step_grads(run.init, method, micro, clip=clip)
        # every on_before_optimizer_step hook sees the normalised gradients, before clipping
        _assert_equal(run.before_clipping[step], reference_step_grads(run.init, method, micro))
        if clip is not None:  # the clip is active: the reference's norm was above it
            assert abs(float(torch.cat([g.flatten() for g in want.values()]).norm()) - clip) < 1e-5
        _assert_equal(grads, want)


class _ProfileFirstMicroBatch(lightning.Callback):
    """Runs the (wrapped) training_step and its backward outside the loop before each step, as a
    memory profile does, then clears the gradients."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            pl_module.training_step(batch, batch_idx)["loss"].backward()
            pl_module.zero_grad(set_to_none=True)


def test_a_training_step_run_outside_the_loop_is_not_counted():
    run = fit("topk", "batch", extra_callbacks=[_ProfileFirstMicroBatch()])
    for step, grads in enumerate(run.steps):
        _assert_equal(grads, reference_step_grads(run.init, "topk", [[4 * step, 4 * step + 1], [4 * step + 2, 4 * step + 3]]))


def test_ddp_with_accumulation_equals_one_batch_over_its_tokens(tmp_path):
    # topk over both ranks' tokens of each micro-step (scope="global"), then one mean over the step
    method, scope = "topk", "global"
    out = tmp_path / "grads.pt"
    run_script(HERE / "ddp_accumulate.py", out, method, scope)
    saved = torch.load(out)
    assert len(saved["steps"]) == 2
    ids = make_rows()[0]
    assert torch.equal(torch.cat(saved["batches"]), ids[0::2])  # rank 0 read samples 0, 2, 4, ...
    for step, grads in enumerate(saved["steps"]):
        # rank r reads samples r, r + 2, ...: a micro-step covers 4 consecutive samples
        micro = [list(range(8 * step, 8 * step + 4)), list(range(8 * step + 4, 8 * step + 8))]
        _assert_equal(grads, reference_step_grads(saved["init"], method, micro))


def test_one_micro_batch_a_step_is_divided_by_its_own_count_and_its_gradients_are_left_alone():
    """One process, no accumulation: each step's loss is its kept sum over its own count (float64, exact), and
    ``normalise_gradients`` has nothing left to multiply, also when the count changes from step to step."""
    from lightning_efficient.tokens.normalize import StepTokenNormaliser

    normaliser = StepTokenNormaliser()
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for count in (5, 7, 3):
        optimizer.zero_grad()
        kept_sum = (weight * 3.0).sum() * count
        loss = normaliser.micro_batch_loss(kept_sum, torch.tensor(count), accumulation=1)
        assert loss.item() == kept_sum.item() / count
        loss.backward()
        before = weight.grad.clone()
        normaliser.normalise_gradients(optimizer)
        assert torch.equal(weight.grad, before)
        assert torch.equal(weight.grad, torch.full((2,), 3.0, dtype=torch.float64))
    # non-finite losses in such a step still fail it, after the backward, with their count
    normaliser.micro_batch_loss((weight * 3.0).sum(), torch.tensor(4), accumulation=1, non_finite=torch.tensor(2))
    with pytest.raises(FloatingPointError, match="2 per-token losses are not finite"):
        normaliser.normalise_gradients(optimizer)


def test_a_weighted_loss_shows_its_value_and_carries_the_weighted_gradient_exactly():
    """``shown_as``: the loss handed on is the value given (an infinite one too: a review found it NaN), in the dtypes'
    promotion; the gradient is the weighted loss's, bitwise, also under a GradScaler's scale and a half-precision value."""
    from lightning_efficient.tokens.normalize import shown_as

    weight = torch.nn.Parameter(torch.tensor([0.3, -1.7], dtype=torch.float64))
    inf = float("inf")
    for coefficient, value in (([3.0, 5.0], torch.tensor(0.25, dtype=torch.float64)), ([3.0, inf], torch.tensor(inf, dtype=torch.float64)),
                               ([3.0, 5.0], torch.tensor(0.25, dtype=torch.bfloat16))):
        weighted = (weight * torch.tensor(coefficient, dtype=torch.float64)).sum() * 7.0
        shown = shown_as(weighted, value)
        assert shown.dtype == torch.float64 and float(shown) == float(value)
        (got,) = torch.autograd.grad(shown * 1024.0, weight, retain_graph=True)  # (a GradScaler's scale on top)
        (want,) = torch.autograd.grad(weighted * 1024.0, weight)
        assert torch.equal(got, want)
    single = torch.nn.Parameter(torch.ones(2))  # float32 weighted, bfloat16 value: float32 shown, float32 gradient
    shown = shown_as((single * 3.0).sum(), torch.tensor(0.5, dtype=torch.bfloat16))
    assert shown.dtype == torch.float32 and float(shown) == 0.5
    shown.backward()
    assert torch.equal(single.grad, torch.full((2,), 3.0))


def test_selective_token_loss_hands_on_each_micro_batchs_mean_over_its_kept_tokens():
    """The loss ``on_train_batch_end`` gets from SelectiveTokenLoss is the micro-batch's mean over its kept tokens over
    the accumulation (a review: nothing held it to that), where its gradient is weighed for the step; with every token
    kept (``method="none"``), bitwise plain Lightning's."""
    from tests.tokens.accumulation_model import KeepsOwnLoss, OwnLossShown

    class KeepsTokenLosses(KeepsOwnLoss):
        def training_step(self, batch, batch_idx):
            output = super().training_step(batch, batch_idx)
            self.own_token_losses = output.token_losses.detach().clone()
            return output

    class KeptMean(lightning.Callback):
        def __init__(self):
            self.pairs = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            keep = outputs["keep"]
            kept_mean = pl_module.own_token_losses[keep].sum() / keep.sum().clamp_min(1)
            self.pairs.append((float(outputs["loss"]), float(kept_mean / trainer.accumulate_grad_batches)))

    def fit_recording(callbacks):
        torch.manual_seed(0)
        shown, kept = OwnLossShown(), KeptMean()
        lightning.Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=3, precision="64-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[shown, kept, *callbacks] if callbacks else [shown]).fit(KeepsTokenLosses())
        return shown, kept

    from lightning_efficient import SelectiveTokenLoss

    _, topk = fit_recording([SelectiveTokenLoss(method="topk", keep_ratio=0.5, threshold="exact")])
    assert len(topk.pairs) == 8 and all(shown == pytest.approx(want, rel=1e-12, abs=0) for shown, want in topk.pairs)
    plain, _ = fit_recording([])
    every, _ = fit_recording([SelectiveTokenLoss(method="none")])
    assert every.pairs == plain.pairs

