"""AutoFit against plain Lightning where an epoch ends on a short batch that the plan splits into micro-batches: a
loss that is a mean over the micro-batch's samples weighs the short batch's samples as plain Lightning's step does."""

import lightning
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import AutoFit
from lightning_efficient.autofit.token_mean import short_batch_weight


class _Regression(lightning.LightningModule):
    """A linear regression on a dataset of ``samples``, drawn in batches of ``batch_size`` (the last one short),
    returning the mean squared error over its (micro-)batch; each step's gradient recorded."""

    def __init__(self, samples: int, batch_size: int, dict_output: bool = False) -> None:
        super().__init__()
        self.samples, self.batch_size, self.dict_output = samples, batch_size, dict_output
        self.linear = nn.Linear(4, 1)
        self.gradients: list[torch.Tensor] = []

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(self.samples, 4, generator=g, dtype=torch.float64),
                             torch.randn(self.samples, 1, generator=g, dtype=torch.float64))
        # (shuffled from the global stream: a generator of the DataLoader's own draws a second permutation where the
        # sampler is run to its end, which your batch sampler is at a short last batch and the plan's is not where the
        # micro-batch divides it: the next epoch's order then differs, a difference this test is not about)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.linear(x), y)
        return {"loss": loss} if self.dict_output else loss

    def on_before_optimizer_step(self, optimizer):
        self.gradients.append(self.linear.weight.grad.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(samples, batch, callbacks, accumulate=1, dict_output=False):
    lightning.seed_everything(0)
    model = _Regression(samples, batch, dict_output).double()
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=2, precision="64-true", accumulate_grad_batches=accumulate,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=callbacks)
    trainer.fit(model)
    return model, trainer


@pytest.mark.parametrize(("samples", "batch", "micro", "accumulate", "dict_output"), [
    (50, 6, 2, 1, False),  # a new user's: the short batch of 2 is one micro-batch; its step's gradient was a third of plain's
    (53, 6, 2, 1, True),  # the short batch of 5 in micro-batches of 2, 2 and 1
    (60, 8, 4, 2, False),  # your own accumulation: the last window holds a whole batch and a short one
])
def test_an_epochs_short_last_batch_split_into_micro_batches_trains_as_in_plain_lightning(samples, batch, micro, accumulate,
                                                                                          dict_output):
    plain, plain_trainer = _fit(samples, batch, [], accumulate, dict_output)
    fit = AutoFit(budget="1GiB", micro_batches=[micro], optimizer_options=["32-bit"], activation_policies=["keep"])
    split, trainer = _fit(samples, batch, [fit], accumulate, dict_output)
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
