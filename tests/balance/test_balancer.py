"""The shared Balancer at unit level: what a rank gathers before its first speed reading, and the
strategies' settings written through to it."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DistributedSampler

from lightning_efficient import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy
from lightning_efficient.balance.balancer import _check_users_sampler, all_measured, speed_reading
from lightning_efficient.balance.planner import plan_shares


def test_an_unmeasured_rank_gathers_nan_and_no_plan_follows():
    """A rank without a reading sends NaN (not 1 sample/s, which would plan nearly the whole batch
    for the measured rank); the re-plan is skipped until every rank has a reading."""
    assert math.isnan(speed_reading(None))
    assert speed_reading(40.0) == 40.0
    gathered = [speed_reading(40.0), speed_reading(None)]
    assert not all_measured(gathered)
    assert all_measured([40.0, 20.0])
    # what the old reading (1.0 for "none yet") would have planned: nearly everything on rank 0
    assert plan_shares(24, [40.0, 1.0], [None, None], 1).shares[1] <= 1


@pytest.mark.parametrize("strategy_class", [HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy])
def test_settings_are_settable_through_the_strategy_and_validated(strategy_class):
    strategy = strategy_class(global_batch_size=12)
    strategy.shares = [3.0, 1.0]
    strategy.global_batch_size = 16
    strategy.rebalance_every = 5
    assert (strategy.shares, strategy.global_batch_size, strategy.rebalance_every) == ([3.0, 1.0], 16, 5)
    assert strategy.balancer.shares == [3.0, 1.0] and strategy.balancer.global_batch_size == 16
    with pytest.raises(ValueError, match="shares="):
        strategy.shares = [1.0, -1.0]
    with pytest.raises(ValueError, match=r"hysteresis=1\.5"):
        strategy.hysteresis = 1.5
    assert strategy.shares == [3.0, 1.0] and strategy.hysteresis == 0.05  # a refused value changes nothing


def test_hetero_fsdp_refuses_the_probe_set_later_too():
    strategy = HeterogeneousFSDPStrategy()
    with pytest.raises(ValueError, match=r"max_micro_batch='auto' is not allowed: .*FSDP2's all-gathers"):
        strategy.max_micro_batch = "auto"
    strategy.max_micro_batch = [4, 2]
    assert strategy.balancer.max_micro_batch == [4, 2]
    ddp = HeterogeneousDDPStrategy()
    ddp.max_micro_batch = "auto"
    assert ddp.balancer.max_micro_batch == "auto"


class _EvenIndices(torch.utils.data.Sampler):
    """A user's sampler of a subset: the even indices."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        return iter(range(0, self.size, 2))

    def __len__(self) -> int:
        return (self.size + 1) // 2


class _LongestFirst(torch.utils.data.Sampler):
    """A user's order of the whole dataset (a bucketing by length, say)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        return iter(reversed(range(self.size)))

    def __len__(self) -> int:
        return self.size


def test_a_users_sampler_the_strategys_order_would_replace_by_other_samples_is_refused(recwarn):
    # a new user's trial: a SubsetRandomSampler, or their own per-rank sampler with use_distributed_sampler=False, was
    # silently replaced by a permutation of the whole dataset (indices they excluded trained, longer epochs)
    data = torch.utils.data.TensorDataset(torch.arange(32.0))
    for sampler, named in ((torch.utils.data.SubsetRandomSampler(range(0, 32, 2)), "SubsetRandomSampler"),
                           (_EvenIndices(16), "_EvenIndices"),  # (8 samples: neither the dataset nor a rank's part)
                           (DistributedSamplerWrapper(_EvenIndices(32), num_replicas=2, rank=0), "_EvenIndices"),  # Lightning's
                           (torch.utils.data.WeightedRandomSampler([1.0] * 32, num_samples=32), "WeightedRandomSampler"),
                           # a user's own DistributedSampler over a subset, with use_distributed_sampler=False (a trial)
                           (DistributedSampler(torch.utils.data.Subset(data, range(20)), num_replicas=2, rank=0),
                            "DistributedSampler")):
        with pytest.raises(ValueError, match=rf"hetero_ddp draws each step's samples from its own permutation of the whole "
                                             rf"training dataset \(32 samples\), so the DataLoader's {named} "):
            _check_users_sampler("hetero_ddp", torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler), 2)
    # an order of the whole dataset, Lightning's or torch's: nothing said
    for loader in (torch.utils.data.DataLoader(data, batch_size=4), torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
                   torch.utils.data.DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0)),
                   torch.utils.data.DataLoader(data, batch_size=4, sampler=DistributedSamplerWrapper(
                       torch.utils.data.RandomSampler(data), num_replicas=2, rank=0))):
        _check_users_sampler("hetero_ddp", loader, 2)
    assert not [w for w in recwarn.list if "hetero_ddp" in str(w.message)]
    # the user's own order of the whole dataset: replaced, and said
    # the user's own order of the whole dataset, or of a rank's part of it (use_distributed_sampler=False): replaced, and said
    said = ("hetero_ddp: the training DataLoader's _LongestFirst is replaced by the strategy's own permutation of the 32 samples"
            " over the ranks each epoch (seed + epoch; shuffle=False keeps the dataset's order): its order is not kept")
    for sampler in (_LongestFirst(32), _LongestFirst(16)):
        with pytest.warns(UserWarning) as said_now:
            _check_users_sampler("hetero_ddp", torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler), 2)
        assert [str(w.message) for w in said_now] == [said]
    # a DistributedSampler of one's own order (a subclass), and batch samplers of one's own, even endless or dropping
    # the last batch: replaced and said, never iterated (a review: an endless one hung, one dropping its last was refused)
    class _ShardedLongestFirst(DistributedSampler):
        pass

    class _DropsLast(torch.utils.data.BatchSampler):
        pass

    class _Endless(torch.utils.data.Sampler):
        def __iter__(self):
            while True:
                yield [0, 1, 2, 3]

    for loader, named in ((torch.utils.data.DataLoader(data, batch_size=4, sampler=_ShardedLongestFirst(data, num_replicas=2, rank=0)),
                           "_ShardedLongestFirst"),
                          (torch.utils.data.DataLoader(data, batch_sampler=_DropsLast(range(10), 4, drop_last=True)), "_DropsLast"),
                          (torch.utils.data.DataLoader(data, batch_sampler=_Endless()), "_Endless")):
        with pytest.warns(UserWarning) as said_now:
            _check_users_sampler("hetero_ddp", loader, 2)
        assert [str(w.message) for w in said_now] == [said.replace("_LongestFirst", named)]


def test_a_dataloader_state_the_strategy_did_not_save_starts_the_epoch_afresh():
    # a review: a checkpoint from another strategy whose training DataLoader was stateful (torchdata's
    # StatefulDataLoader) handed its state over at an epoch's end raised KeyError('schedule')
    balancer = HeterogeneousDDPStrategy().balancer
    with pytest.warns(UserWarning, match=r"hetero_ddp: the checkpoint's training DataLoader state was not saved by hetero_ddp "
                                         r"\(keys \['_num_yielded', '_sampler_iter_yielded'\]\): the epoch starts from its first batch"):
        balancer.load_data_state_dict({"_num_yielded": 8, "_sampler_iter_yielded": 8})
    assert balancer.micro_done == 0
