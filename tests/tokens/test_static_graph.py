"""Token-loss outputs under ``DDPStrategy(static_graph=True)``: DDP must see their tensors to synchronise gradients."""

from pathlib import Path

import pytest
import torch

from lightning_efficient import FusedTokenLoss, TokenLosses
from tests.ddp import run_script


@pytest.mark.parametrize("mode", ["plain", "fused", "selective"])
def test_static_graph_ddp_synchronises_the_gradients_of_a_token_loss_output(tmp_path, mode):
    """A review: DDP flattens a forward's output to pass its tensors through the function whose first backward queues
    the all-reduce under static_graph=True; a dict subclass it did not know was one leaf of no tensor, and the ranks'
    gradients were never synchronised (0.3 apart every step)."""
    out = tmp_path / "differences.pt"
    run_script(Path(__file__).with_name("ddp_static_graph.py"), out, mode)
    differences = torch.load(out)
    assert len(differences) == 2 and max(differences) == 0.0, differences


def test_the_outputs_flatten_to_their_tensors_and_back_as_they_were():
    losses = torch.rand(2, 3, requires_grad=True)
    output = TokenLosses(losses, torch.tensor([[True, True, False], [True, False, False]]), note="x")
    leaves, spec = torch.utils._pytree.tree_flatten(output)
    assert any(leaf is losses for leaf in leaves) and "x" in leaves
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(again) is TokenLosses and again.keys() == output.keys() and again["loss"] is output["loss"]
    head = torch.nn.Linear(4, 5)
    fused = FusedTokenLoss(torch.rand(2, 3, 4), head.weight, torch.tensor([[1, 2, -100], [3, -100, -100]]), bias=head.bias)
    leaves, spec = torch.utils._pytree.tree_flatten(fused)
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(again) is FusedTokenLoss and again.bias is head.bias and again["weight"] is head.weight
    assert torch.equal(again["loss"], fused["loss"]) and again.ignore_index == -100
