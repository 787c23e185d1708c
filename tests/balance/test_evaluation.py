from itertools import chain

import lightning
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy
from lightning_efficient.balance.evaluation import ChunkedBatchSampler, chunks


@given(st.lists(st.integers(), min_size=1, max_size=40), st.integers(1, 50))
def test_chunks_are_the_batch_in_order_in_the_fewest_even_pieces_within_the_cap(batch, cap):
    found = chunks(batch, cap)
    assert list(chain(*found)) == batch
    sizes = [len(chunk) for chunk in found]
    assert max(sizes) <= cap and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert len(found) == -(-len(batch) // cap)


@given(st.integers(0, 60), st.integers(1, 12), st.integers(1, 12), st.booleans(), st.integers(0, 8))
def test_the_chunked_batch_sampler_splits_each_batch_and_counts_the_chunks_of_the_first_batches(samples, size, cap, drop_last, first):
    batches = BatchSampler(SequentialSampler(range(samples)), size, drop_last)
    chunked = ChunkedBatchSampler(batches, cap)
    found = list(chunked)
    assert found == [chunk for batch in batches for chunk in chunks(batch, cap)]
    assert len(chunked) == len(found) and chunked.batch_sizes() == [len(batch) for batch in batches]
    # the first `first` DataLoader batches are the first chunks_in(first) chunks
    assert list(chain(*found[:chunked.chunks_in(first)])) == list(chain(*list(batches)[:first]))
    assert chunked.sampler is batches.sampler  # (Lightning's set_epoch reaches it)


class _TokenMeanValidation(lightning.LightningModule):
    """Logs a mean over each batch's valid tokens (rows padded to different lengths), weighted by its valid tokens
    (``by_tokens``) or by Lightning's default, its rows."""

    def __init__(self, by_tokens: bool) -> None:
        super().__init__()
        self.by_tokens = by_tokens
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

    def validation_step(self, batch, batch_idx):
        x, mask = batch
        loss = ((x * self.weight).sum(-1) * mask).sum() / mask.sum()
        self.log("val_loss", loss, batch_size=int(mask.sum()) if self.by_tokens else None)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*_padded_rows()), batch_size=5)


def _padded_rows():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, 4, dtype=torch.float64, generator=generator)
    return x, (torch.arange(6) < torch.randint(1, 7, (10, 1), generator=generator)).double()


def _validated(strategy, by_tokens: bool) -> float:
    trainer = lightning.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                                enable_model_summary=False)
    return trainer.validate(_TokenMeanValidation(by_tokens), verbose=False)[0]["val_loss"]


def test_a_token_mean_logged_with_its_valid_tokens_as_batch_size_is_the_token_mean_chunked_or_not():
    """What the README advises for a padded token-mean validation loss under the caps: weighted by its rows (Lightning's
    default), a chunk's token mean is not the unsplit batch's; weighted by its valid tokens, the epoch mean is the token
    mean over every token, chunked or not."""
    x, mask = _padded_rows()
    token_mean = float(((x * torch.linspace(0.5, 1.5, 4, dtype=torch.float64)).sum(-1) * mask).sum() / mask.sum())
    chunked = HeterogeneousDDPStrategy(max_micro_batch=[2])
    assert _validated("ddp", True) == pytest.approx(token_mean, rel=1e-12)
    assert _validated(chunked, True) == pytest.approx(token_mean, rel=1e-12)
    assert abs(_validated(HeterogeneousDDPStrategy(max_micro_batch=[2]), False) - _validated("ddp", False)) > 1e-3
