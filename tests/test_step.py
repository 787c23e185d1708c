"""lightning_efficient._step.restored_run_state: what measuring changes is put back exactly."""

from types import SimpleNamespace

import pytest
import torch

from lightning_efficient._step import restored_run_state


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
