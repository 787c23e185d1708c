"""ResumableDataLoader under Lightning's DDP sampler: a mid-epoch resume on another number of ranks
continues from the same sample of the epoch (or is refused with the numbers)."""

from collections import Counter

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import TensorDataset

from lightning_efficient._torch import seeded_permutation
from lightning_efficient.resumable import EpochShuffleSampler, ResumableDataLoader

N, EPOCH = 24, 1


def _loader(world, rank, batch_size=3):
    """The loader as Lightning's DDP rebuilds it: the user's sampler inside a DistributedSamplerWrapper."""
    sampler = DistributedSamplerWrapper(EpochShuffleSampler(N, seed=1), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = ResumableDataLoader(TensorDataset(torch.arange(N)), batch_size=batch_size, sampler=sampler)
    loader.sampler.set_epoch(EPOCH)
    return loader


def _first(loader, batches):
    iterator = iter(loader)
    return [int(i) for _ in range(batches) for i in next(iterator)[0]]


def _rest(loader):
    return [int(i) for batch in loader for i in batch[0]]


@pytest.mark.parametrize(("before", "after", "batches"), [(2, 1, 2), (1, 2, 2), (2, 2, 3)])
def test_a_mid_epoch_resume_on_another_number_of_ranks_trains_the_rest_of_the_epoch_once(before, after, batches):
    """Batch size x ranks stays 6 (Lightning restores its batch counter in the checkpoint's units)."""
    trained, states = [], []
    for rank in range(before):
        loader = _loader(before, rank, batch_size=6 // before)
        trained += _first(loader, batches)
        states.append(loader.state_dict())
        assert states[-1]["batches_handed_out"] == batches
    for rank in range(after):
        resumed = _loader(after, rank, batch_size=6 // after)
        resumed.load_state_dict(states[0])  # every rank saves the same position
        trained += _rest(resumed)
    assert Counter(trained) == Counter(range(N))


def test_a_resume_on_the_same_ranks_continues_the_same_order():
    loader = _loader(1, 0)
    straight = _rest(loader)
    head = _first(_loader(1, 0), 2)
    resumed = _loader(1, 0)
    resumed.load_state_dict({"batches_handed_out": 2})  # a state saved before the layout was recorded
    assert head + _rest(resumed) == straight


def test_a_mid_epoch_resume_with_another_step_size_is_refused():
    loader = _loader(1, 0)
    _first(loader, 2)  # 6 samples trained in 3-sample steps; 2 ranks of 3 take 6 a step
    with pytest.raises(ValueError, match=r"after 2 batches of 3 on 1 rank\(s\) \(6 samples.*6 samples a step, not 3"):
        _loader(2, 0).load_state_dict(loader.state_dict())


def test_an_end_of_epoch_state_resumes_on_any_number_of_ranks():
    loader = _loader(2, 0)
    _rest(loader)
    resumed = _loader(1, 0)
    resumed.load_state_dict(loader.state_dict())
    assert Counter(_rest(resumed)) == Counter(range(N))


def test_epoch_shuffle_sampler_draws_the_shared_seeded_permutation():
    sampler = EpochShuffleSampler(N, seed=5)
    sampler.set_epoch(3)
    assert list(sampler) == seeded_permutation(N, 8) != list(range(N))
    assert list(EpochShuffleSampler(N, shuffle=False)) == list(range(N))


def test_a_position_without_a_batch_size_is_refused():
    loader = _loader(2, 0)
    _first(loader, 1)
    unbatched = ResumableDataLoader(TensorDataset(torch.arange(N)), batch_size=None)
    with pytest.raises(ValueError, match=r"batch_size=3 on 2 rank\(s\); this run has batch_size=None on 1"):
        unbatched.load_state_dict(loader.state_dict())
