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
