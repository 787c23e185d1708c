"""Every plugin refuses a wrong-typed argument at construction, naming it, its value and what is allowed."""

import pytest
import torch

from lightning_efficient import ActivationMemory, EightBitOptimizer, HeterogeneousDDPStrategy, MemoryReport, SelectiveTokenLoss


@pytest.mark.parametrize(("make", "kwargs", "message"), [
    (ActivationMemory, {"reentrant": "no"}, "reentrant='no' is not allowed: expected True or False"),
    (ActivationMemory, {"use_streams": 1}, "use_streams=1 is not allowed: expected True or False"),
    (ActivationMemory, {"offload_dir": 123}, "offload_dir=123 is not allowed: expected None or a path"),
    (ActivationMemory, {"offload_dir": __file__}, "offload_dir=.* is not allowed: expected a directory \\(or None\\), not an existing file"),
    (ActivationMemory, {"disk_pending_bytes": 0}, "disk_pending_bytes=0 is not allowed"),
    (ActivationMemory, {"policy": "auto", "budget": 0.5, "auto_policies": []}, "auto_policies=\\[\\] is not allowed"),
    (HeterogeneousDDPStrategy, {"shuffle": "no"}, "shuffle='no' is not allowed: expected True or False"),
    (HeterogeneousDDPStrategy, {"drop_last": None}, "drop_last=None is not allowed"),
    (HeterogeneousDDPStrategy, {"seed": 1.5}, "seed=1.5 is not allowed: expected an integer >= 0"),
    (EightBitOptimizer, {"keep_32bit": "head"}, "keep_32bit='head' is not allowed: expected a list of name patterns"),
    (EightBitOptimizer, {"paged": "yes"}, "paged='yes' is not allowed: expected True or False"),
    (EightBitOptimizer, {"strict": None}, "strict=None is not allowed"),
    (EightBitOptimizer, {"embeddings_32bit": 2}, "embeddings_32bit=2 is not allowed"),
    (MemoryReport, {"log": "no"}, "log='no' is not allowed: expected True or False"),
    (MemoryReport, {"json_path": 5}, "json_path=5 is not allowed: expected None or a path"),
    (SelectiveTokenLoss, {"keep_ratio": True}, "keep_ratio=True is not allowed"),
    (SelectiveTokenLoss, {"method": "rho1", "reference": 42}, "reference=42 is not allowed"),
    (SelectiveTokenLoss, {"method": "rho1", "reference": torch.nn.Linear(2, 2)},
     "reference='Linear' is not allowed: expected an nn.Module with a training_step"),
])
def test_wrong_typed_arguments_are_refused_at_construction(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)
