"""bitsandbytes' step without a device wait after every parameter: the same updates, no wait, hooks once."""

import bitsandbytes as bnb
import pytest
import torch

from lightning_efficient import EightBitOptimizer
from lightning_efficient.optim.unsynced import _UnsyncedStepMixin, unsynced
from tests.optim.helpers import Regression, trainer
from tests.optim.test_offload_paged import _params, _run, stepped_under_a_side_stream_like_plain_8bit


@pytest.mark.parametrize("cls", [bnb.optim.AdamW8bit, bnb.optim.SGD8bit, bnb.optim.AdamW32bit], ids=lambda c: c.__name__)
def test_the_unsynced_step_updates_as_bitsandbytes_does_and_never_waits_for_the_device(cls, monkeypatch):
    import bitsandbytes.optim.optimizer as bnb_optimizer

    waits = []
    original = bnb_optimizer.sync_gpu
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: (waits.append(t), original(t)))
    kwargs = {"lr": 1e-2, "momentum": 0.9} if cls is bnb.optim.SGD8bit else {"lr": 1e-2}
    plain_params, params = _params(), _params()
    plain, ours = cls(plain_params, **kwargs), unsynced(cls)(params, **kwargs)
    _run(plain, plain_params, 3)
    assert len(waits) == 3 * len(plain_params)  # the control: bitsandbytes waits once per parameter
    waits.clear()
    _run(ours, params, 3)
    assert waits == []
    for p, q in zip(plain_params, params):
        assert torch.equal(p, q)
    assert (type(ours).__name__, type(ours).__module__) == (cls.__name__, cls.__module__) and isinstance(ours, cls)



def test_eight_bit_optimizer_builds_unsynced_twins_whose_step_hooks_run_once_per_step():
    model = Regression()
    calls = []

    class CountSteps(EightBitOptimizer):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            trainer.optimizers[0].register_step_post_hook(lambda *args: calls.append(1))

    t = trainer(4, [CountSteps()])
    t.fit(model)
    assert isinstance(t.optimizers[0], _UnsyncedStepMixin) and isinstance(t.optimizers[0], bnb.optim.AdamW8bit)
    assert len(calls) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_unsynced_step_under_a_side_stream_equals_plain_8bit():
    stepped_under_a_side_stream_like_plain_8bit(unsynced(bnb.optim.AdamW8bit))
