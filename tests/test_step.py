"""lightning_efficient._step: what measuring changes is put back exactly (the run's state, the generators a dataset holds)."""

import random
from types import SimpleNamespace

import lightning
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_efficient._generators import held_generators, held_generators_restored
from lightning_efficient._step import first_samples_batch, restored_run_state, step_loss


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.register_buffer("scratch", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.norm(self.linear(x))


def _changed_and_put_back(device: torch.device) -> None:
    torch.manual_seed(0)
    module = _Module().to(device)
    optimizer = torch.optim.AdamW(module.parameters())
    before = {name: t.detach().clone() for name, t in [*module.state_dict().items(), ("scratch", module.scratch)]}
    strategy = SimpleNamespace(lightning_module=module, optimizers=[optimizer], root_device=device)
    with restored_run_state(strategy):
        generated = torch.rand(3, device=device)
        module(torch.randn(4, 16, device=device)).sum().backward()  # BatchNorm's statistics move
        optimizer.step()  # the parameters move, AdamW makes its state
        module.scratch.mul_(3)
    assert torch.equal(module.scratch, before["scratch"])
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert len(optimizer.state) == 0 and all(p.grad is None for p in module.parameters())
    assert torch.equal(torch.rand(3, device=device), generated)  # the random stream put back


def test_restored_run_state_puts_parameters_buffers_and_optimizer_state_back_on_cpu():
    _changed_and_put_back(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_restored_run_state_puts_back_exactly_through_pinned_asynchronous_copies_on_cuda():
    _changed_and_put_back(torch.device("cuda"))


class _Transform:
    """An augmentation object holding generators of each kind, one inside a dict and one in a list."""

    def __init__(self) -> None:
        self.numpy = np.random.default_rng(5)
        self.legacy = {"state": np.random.RandomState(6)}
        self.python = [random.Random(7)]
        self.system = random.SystemRandom()  # no state to put back: left alone


class _Augmented(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(4)
        self.transform = _Transform()
        self.rows = [{"text": str(i)} for i in range(100_000)]  # not walked whole

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> torch.Tensor:
        t = self.transform
        noise = [t.numpy.random(), t.legacy["state"].rand(), t.python[0].random(), t.system.random()]
        return torch.randn(2, generator=self.generator) + torch.tensor(noise[:3]).sum()


def _next_draws(dataset: _Augmented) -> list[float]:
    t = dataset.transform
    return [float(torch.rand((), generator=dataset.generator)), t.numpy.random(), t.legacy["state"].rand(), t.python[0].random()]


def test_reading_samples_to_measure_puts_back_the_generators_the_dataset_holds():
    # a new user's trial: a seeded augmentation of the dataset's own was drawn from before the fit (the datasets'
    # comparison, AutoFit's and the probe's measuring steps), and the fit trained other samples than plain Lightning's
    dataset, untouched = _Augmented(), _Augmented()
    strategy = SimpleNamespace(precision_plugin=Precision(), lightning_module=lightning.LightningModule(),
                               batch_to_device=lambda batch, dataloader_idx=0: batch)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    first = first_samples_batch(strategy, loader, 5)
    assert first.shape == (5, 2) and torch.equal(first, first_samples_batch(strategy, loader, 5))  # the same draws again
    assert _next_draws(dataset) == _next_draws(untouched)
    held = {id(g) for g in held_generators(dataset)}  # (also module-level ones its classes' code may draw from)
    t = dataset.transform
    assert {id(g) for g in (dataset.generator, t.numpy, t.legacy["state"], t.python[0])} <= held and id(t.system) not in held
    with held_generators_restored(dataset):
        dataset[0]
    assert _next_draws(dataset) == _next_draws(untouched)


class _Iterating(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return self.layer(batch).sum()


class _Batched(_Iterating):
    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()


def test_a_step_that_draws_its_own_batches_is_refused_by_measuring_with_what_to_do():
    # a new user's trial: AutoFit's and ActivationMemory's planning failed on training_step(self, dataloader_iter) with
    # "takes 2 positional arguments but 3 were given"
    strategy = SimpleNamespace(lightning_module=_Iterating(), precision_plugin=Precision())
    with pytest.raises(ValueError, match=r"_Iterating.training_step\(self, dataloader_iter\) draws its own batches.*"
                                         r"training_step\(self, batch, batch_idx\)"):
        step_loss(strategy, torch.ones(3, 2))
    strategy.lightning_module = _Batched()
    assert float(step_loss(strategy, torch.ones(3, 2))) == pytest.approx(float(strategy.lightning_module.layer(torch.ones(3, 2)).sum()))
