"""lightning_efficient._samples.batch_samples: the samples a batch holds, whatever holds its tensors."""

import collections
import dataclasses

import torch
from transformers import BatchEncoding

from lightning_efficient._samples import batch_samples


@dataclasses.dataclass
class _Batch:
    lengths: torch.Tensor
    ids: torch.Tensor
    cached: torch.Tensor = dataclasses.field(init=False)  # never set: no error


class _Custom:
    def __init__(self) -> None:
        self.count = torch.tensor(6)
        self.ids = torch.ones(6, 3)
        self.labels = torch.ones(6)


def test_the_samples_are_the_leading_dimension_of_the_first_tensor_with_one_the_shallowest_first():
    # a new user's trial: a dataclass, a BatchEncoding and a dict with a 0-d value first were each counted as 1 sample
    pair = collections.namedtuple("Pair", "x y")
    assert batch_samples(_Batch(torch.tensor(7), torch.ones(4, 7))) == 4
    assert batch_samples(BatchEncoding({"input_ids": torch.ones(3, 5), "attention_mask": torch.ones(3, 5)})) == 3
    assert batch_samples({"length": torch.tensor(5), "x": torch.ones(2, 5), "text": ["a", "b"]}) == 2
    assert batch_samples(_Custom()) == 6 and batch_samples(pair(torch.ones(9, 2), torch.ones(9))) == 9
    assert batch_samples(["a tokenized", "in the step"]) == 2
    assert batch_samples({"note": "no tensors"}) is None and batch_samples(torch.tensor(1.0)) is None
    # a review: per-sample targets in a list (detection boxes, often empty) and a single packed sequence
    targets = [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0)} for _ in range(8)]
    assert batch_samples((torch.ones(8, 3, 4, 4), targets)) == 8
    assert batch_samples({"input_ids": torch.ones(1, 16), "position_ids": torch.arange(16)}) == 1
