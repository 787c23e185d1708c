"""``selective`` where torch's selective checkpoint cannot recompute a block exactly: a recurrent layer (whose cell
changes the kept matmul outputs in place, unseen: a GRU's gradients came out wrong with no error) is refused before
the first step, and ``auto`` does not pick it there; an in-place op after a matmul is said with the block and the fix."""

import lightning
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import ActivationMemory, TokenLosses
from lightning_efficient.activations import wrap_block
from lightning_efficient.activations.policies import selective_refusal


class _Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = kind(16, 16, batch_first=True)

    def forward(self, x):
        return x + self.rnn(x)[0]


class _RecurrentLM(lightning.LightningModule):
    def __init__(self, kind: type[nn.RNNBase] = nn.GRU) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_Recurrent(kind) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return TokenLosses(F.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), reduction="none").view_as(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.randint(0, 32, (8, 13), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)


def _fit(callbacks, kind=nn.GRU):
    lightning.seed_everything(0, verbose=False)
    model = _RecurrentLM(kind)
    lightning.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks).fit(model)
    return model


def _max_difference(a, b):
    return max(float((a.state_dict()[k] - b.state_dict()[k]).abs().max()) for k in a.state_dict())


def _grads(module, x, selective=False):
    """The gradients of ``module``'s parameters and of ``x``, keeping everything, or through torch's selective checkpoint
    under the plugin's policy (``selective``), bypassing the refusal to measure why it is there."""
    from torch.utils.checkpoint import checkpoint

    from lightning_efficient.activations.policies import selective_context

    module.zero_grad()
    x.grad = None
    out = checkpoint(module, x, use_reentrant=False, context_fn=selective_context) if selective else module(x)
    out.pow(2).sum().backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def _largest_difference(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", [nn.GRU, nn.RNN, nn.LSTM])
def test_selective_is_refused_for_a_recurrent_block_before_it_trains_and_checkpoint_matches_keep(kind):
    plain = _fit([], kind)
    with pytest.raises(ValueError, match=r"'selective' cannot recompute 3 block\(s\) exactly: layers\.0 \(its recurrent layer "
                                         rf"_Recurrent\.rnn \(nn\.{kind.__name__}\)"):
        _fit([ActivationMemory("selective")], kind)
    assert _max_difference(_fit([ActivationMemory("checkpoint")], kind), plain) == 0.0


def test_auto_does_not_pick_selective_for_a_recurrent_block_and_trains_as_keep():
    plain = _fit([])
    memory = ActivationMemory("auto", budget=0.6, auto_policies=["keep", "selective", "checkpoint"])
    model = _fit([memory])
    assert "selective" not in memory.plan and "checkpoint" in memory.plan
    assert all("selective" not in profile.held_bytes for profile in memory.profiles)
    assert _max_difference(model, plain) == 0.0


def test_selective_on_a_gru_would_give_wrong_gradients_which_is_why_it_is_refused():
    """The refusal's reason, measured: torch's selective checkpoint keeping the GRU cell's matmul outputs gives other
    gradients than keeping everything, with no error (torch 2.13 on CPU)."""
    torch.manual_seed(0)
    block, x = _Recurrent(nn.GRU).double(), torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    assert _largest_difference(_grads(block, x), _grads(block, x, selective=True)) > 1e-3
    assert selective_refusal(block) is not None
    assert selective_refusal(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) is None
    with pytest.raises(ValueError, match="policy='selective' is refused for _Recurrent: its recurrent layer"):
        wrap_block(block, "selective")
    assert "forward" not in vars(block)  # nothing left wrapped


class _CellLoop(nn.Module):
    """A block running a recurrent cell over the sequence (a review: accepted by a check of nn.RNNBase alone)."""

    def __init__(self, cell: type[nn.RNNCellBase]) -> None:
        super().__init__()
        self.cell = cell(16, 16)

    def forward(self, x):
        state, outputs = None, []
        for step in x.unbind(1):
            state = self.cell(step, state)
            outputs.append(state[0] if isinstance(state, tuple) else state)
        return x + torch.stack(outputs, 1)


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.RNNCell, nn.LSTMCell])
def test_selective_is_refused_for_a_block_looping_a_recurrent_cell(cell):
    torch.manual_seed(0)
    block, x = _CellLoop(cell).double(), torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    if cell is nn.GRUCell:  # the reason, measured: wrong gradients with no error
        assert _largest_difference(_grads(block, x), _grads(block, x, selective=True)) > 1e-3
    with pytest.raises(ValueError, match=rf"its recurrent layer _CellLoop\.cell \(nn\.{cell.__name__}\)"):
        wrap_block(block, "selective")


class _InPlaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def test_an_in_place_op_after_a_matmul_under_selective_names_the_block_and_the_fix_and_checkpoint_is_exact():
    torch.manual_seed(0)
    block = _InPlaceBlock().double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    kept = _grads(block, x)
    wrap_block(block, "selective")
    with pytest.raises(RuntimeError, match=r"policy 'selective' keeps the outputs of the matmuls in _InPlaceBlock, and an "
                                           r"in-place op of its forward changed one .* use policy 'checkpoint'"):
        _grads(block, x)
    wrap_block(block, "checkpoint")
    assert all(torch.equal(a, b) for a, b in zip(kept, _grads(block, x)))
