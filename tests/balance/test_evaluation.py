from itertools import chain

from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, SequentialSampler

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
