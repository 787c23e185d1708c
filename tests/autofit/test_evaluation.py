"""Validation and test under an AutoFit plan that splits the batch, where their DataLoaders read ``batch_size`` too: the
same samples as plain Lightning's under integer counts (``limit_val_batches``, ``num_sanity_val_steps``,
``limit_test_batches``), in chunks of the plan's micro-batch, the same logged means; your settings put back after."""

import lightning
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import AutoFit


class Classifier(lightning.LightningModule):
    """A linear classifier whose training, validation and test DataLoaders all read ``batch_size``; each evaluation
    batch's samples recorded by stage."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8
        self.linear = nn.Linear(4, 3)
        self.seen: dict[str, list[int]] = {"sanity": [], "validate": [], "test": []}
        self.sizes: dict[str, list[int]] = {"sanity": [], "validate": [], "test": []}

    def _loader(self, samples: int, seed: int, shuffle: bool = False) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = TensorDataset(torch.randn(samples, 4, generator=g), torch.randint(0, 3, (samples,), generator=g), torch.arange(samples))
        return DataLoader(data, batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(48, 0, shuffle=True)

    def val_dataloader(self):
        return self._loader(30, 1)

    def test_dataloader(self):
        return self._loader(30, 2)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.cross_entropy(self.linear(x), y)

    def _evaluate(self, batch, name):
        x, y, index = batch
        stage = "sanity" if self.trainer.sanity_checking else ("test" if self.trainer.testing else "validate")
        self.seen[stage] += index.tolist()
        self.sizes[stage].append(len(index))
        self.log(name, nn.functional.cross_entropy(self.linear(x), y))

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val_loss")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test_loss")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks, **settings):
    lightning.seed_everything(0)
    model = Classifier()
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=callbacks, **settings)
    trainer.fit(model)
    metrics = dict(trainer.callback_metrics)
    tested = trainer.test(model, verbose=False) if callbacks else None
    return model, trainer, metrics, tested


@pytest.mark.parametrize("settings", [
    {"limit_val_batches": 1, "num_sanity_val_steps": 1, "val_check_interval": 3},  # a new user's: 2 samples where plain's 8
    {"limit_val_batches": 2, "num_sanity_val_steps": 2},
    {"limit_val_batches": 0.5},
    {},
])
def test_validation_reads_the_batches_plain_lightning_reads_in_chunks_of_the_micro_batch(settings):
    plain, _, plain_metrics, _ = _fit([], **settings)
    fit = AutoFit(budget="1GiB", micro_batches=[2], optimizer_options=["32-bit"], activation_policies=["keep"])
    mine, trainer, metrics, _ = _fit([fit], **settings)
    assert fit.plan.micro_batches == [2] and fit.plan.accumulation == 4
    assert mine.seen["sanity"] == plain.seen["sanity"] and mine.seen["validate"] == plain.seen["validate"]
    assert max(mine.sizes["sanity"] + mine.sizes["validate"]) == 2  # (within the plan's micro-batch)
    torch.testing.assert_close(metrics["val_loss"], plain_metrics["val_loss"], rtol=1e-5, atol=1e-6)
    for name, value in settings.items():
        assert getattr(trainer, name) == value, name
    assert "process_dataloader" not in vars(trainer.strategy)


def test_a_test_after_the_fit_runs_as_without_autofit():
    fit = AutoFit(budget="1GiB", micro_batches=[2], optimizer_options=["32-bit"], activation_policies=["keep"])
    mine, trainer, _, _ = _fit([fit], limit_test_batches=2)
    assert fit.plan.accumulation == 4
    # your batches of 8, as plain Lightning's (AutoFit's plan is the fit's: a test after it runs as without AutoFit)
    assert mine.seen["test"] == list(range(16)) and set(mine.sizes["test"]) == {8} and trainer.limit_test_batches == 2
