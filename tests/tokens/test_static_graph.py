"""Token-loss outputs under ``DDPStrategy(static_graph=True)``: DDP must see their tensors to synchronise gradients."""

from pathlib import Path

import pytest
import torch

from lightning_efficient import FusedTokenLoss, TokenLosses
from tests.ddp import run_script


@pytest.mark.parametrize("mode", ["plain", "fused", "selective", "subclass"])
def test_static_graph_ddp_synchronises_the_gradients_of_a_token_loss_output(tmp_path, mode):
    """A review: DDP flattens a forward's output to pass its tensors through the function whose first backward queues
    the all-reduce under static_graph=True; a dict subclass it did not know was one leaf of no tensor, and the ranks'
    gradients were never synchronised (0.3 apart every step)."""
    out = tmp_path / "differences.pt"
    run_script(Path(__file__).with_name("ddp_static_graph.py"), out, mode)
    differences = torch.load(out)
    assert len(differences) == 2 and max(differences) == 0.0, differences


def test_the_outputs_flatten_to_their_tensors_with_history_and_back_as_they_were():
    """Only tensors with autograd history are children (a review: DDP with find_unused_parameters=True copied every
    tensor of the output each step, a fused head's whole weight among them); the rest comes back as it was."""
    losses = torch.rand(2, 3, requires_grad=True) * 1.0
    output = TokenLosses(losses, torch.tensor([[True, True, False], [True, False, False]]), note="x")
    leaves, spec = torch.utils._pytree.tree_flatten(output)
    assert len(leaves) == 2 and leaves[0] is losses and leaves[1] is output["loss"]
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(again) is TokenLosses and list(again.keys()) == list(output.keys()) and again["mask"] is output["mask"]
    assert again["note"] == "x" and again["loss"] is output["loss"]
    head = torch.nn.Linear(4, 5)
    hidden = torch.rand(2, 3, 4, requires_grad=True) * 1.0
    fused = FusedTokenLoss(hidden, head.weight, torch.tensor([[1, 2, -100], [3, -100, -100]]), bias=head.bias)
    leaves, spec = torch.utils._pytree.tree_flatten(fused)
    assert len(leaves) == 2 and leaves[0] is hidden and not any(leaf is head.weight for leaf in leaves)
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(again) is FusedTokenLoss and again.bias is head.bias and again["weight"] is head.weight
    assert torch.equal(again["loss"], fused["loss"]) and again.ignore_index == -100


def test_a_subclass_of_an_output_is_a_pytree_node_too():
    """torch looks a node up by its exact type: a user's subclass registers itself (a review: it stayed one leaf)."""

    class Mine(TokenLosses):
        pass

    output = Mine(torch.rand(2, 3, requires_grad=True) * 1.0)
    leaves, spec = torch.utils._pytree.tree_flatten(output)
    assert len(leaves) == 2 and type(torch.utils._pytree.tree_unflatten(leaves, spec)) is Mine
