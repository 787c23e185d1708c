"""Lightning's learning-rate finder before a fit with each plugin: the fit after it is the fit without it (the finder
runs its trial steps with its own callback only, before the plugins' ``on_fit_start``: README, Compatibility)."""

import lightning
import pytest
import torch
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

from lightning_efficient import ActivationMemory, DemoGPT, EightBitOptimizer, SelectiveTokenLoss
from tests.conftest import tiny_gpt_kwargs
from tests.test_copies_during_fit import _Tokens


def _fit(plugin, tmp_path, find_lr: bool):
    torch.manual_seed(0)
    model = DemoGPT(**tiny_gpt_kwargs())
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=tmp_path, callbacks=[plugin()])
    loader = DataLoader(_Tokens(), batch_size=2)
    if find_lr:
        Tuner(trainer).lr_find(model, loader, num_training=3, early_stop_threshold=None, update_attr=False)
    trainer.fit(model, loader)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("plugin", [lambda: ActivationMemory(policy="checkpoint"), lambda: EightBitOptimizer(min_8bit_size=1),
                                    lambda: SelectiveTokenLoss(method="topk", keep_ratio=0.5)],
                         ids=["activation_memory", "eight_bit", "selective_token_loss"])
def test_the_fit_after_lr_find_is_the_fit_without_it(plugin, tmp_path):
    after_finder = _fit(plugin, tmp_path, find_lr=True)
    alone = _fit(plugin, tmp_path, find_lr=False)
    for mine, theirs in zip(after_finder, alone):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert not list(tmp_path.glob(".lr_find*"))  # the finder's checkpoint is gone
