"""A copy of the module made while a fit runs (an EMA callback's ``copy.deepcopy``, ``torch.save(module)``) is the
user's module, unwrapped: ActivationMemory's block wrappers and SelectiveTokenLoss's step wrappers are not carried
into it (a new user's trial: an EMA copy made in ``on_fit_start`` ran the live module's blocks, 0.0 apart from it
after its own weights were zeroed, and ``torch.save`` failed to pickle the wrappers)."""

import copy
import functools
import io

import lightning
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_efficient import ActivationMemory, DemoGPT, SelectiveTokenLoss
from lightning_efficient.activations.policies import unwrap_block, wrap_block
from tests.conftest import tiny_gpt_kwargs


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index, :-1], "labels": self.ids[index, 1:]}


class _CopiesTheModule(lightning.Callback):
    """Deep-copies and pickles the module as the fit starts (after the plugins set up)."""

    def on_train_start(self, trainer, pl_module):
        self.copied = copy.deepcopy(pl_module)
        buffer = io.BytesIO()
        torch.save(pl_module, buffer)
        buffer.seek(0)
        self.loaded = torch.load(buffer, weights_only=False)


def _logits(module, batch):
    module.eval()
    with torch.no_grad():
        return module(batch["input_ids"])


@pytest.mark.parametrize("plugin", [lambda: ActivationMemory(policy="checkpoint"), lambda: ActivationMemory(policy="disk"),
                                    lambda: SelectiveTokenLoss(method="topk", keep_ratio=0.5)],
                         ids=["checkpoint", "disk", "selective_token_loss"])
def test_a_copy_made_while_the_fit_runs_is_the_users_module_unwrapped(plugin, tmp_path):
    torch.manual_seed(0)
    copies = _CopiesTheModule()
    model = DemoGPT(**tiny_gpt_kwargs())
    trainer = lightning.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=tmp_path, callbacks=[plugin(), copies])
    trainer.fit(model, DataLoader(_Tokens(), batch_size=4))
    batch = _Tokens()[slice(0, 2)]
    for made in (copies.copied, copies.loaded):
        for module, name in [*((block, "forward") for block in made.blocks), (made, "training_step"), (made, "optimizer_step")]:
            method = vars(module).get(name)  # none, or (copied with the module) the module's own, bound to it
            assert method is None or (method.__self__ is module and method.__func__ is getattr(type(module), name)), name
        # the copy runs its own weights: zeroed blocks change its outputs, not the live module's, and it computes
        # what a plain module with its weights computes
        with torch.no_grad():
            for parameter in made.blocks.parameters():
                parameter.zero_()
        plain = DemoGPT(**tiny_gpt_kwargs())
        plain.load_state_dict(made.state_dict())
        logits = _logits(made, batch)
        torch.testing.assert_close(logits, _logits(plain, batch), rtol=0, atol=0)
        assert not torch.equal(logits, _logits(model, batch))


class _WrapsTheStepToo(lightning.Callback):
    """Someone else's ``functools.wraps`` wrapper over ``training_step``, set up after SelectiveTokenLoss's."""

    def setup(self, trainer, pl_module, stage):
        inner = pl_module.training_step

        @functools.wraps(inner)
        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        self.calls, self.inner = 0, inner
        pl_module.training_step = counted

    def teardown(self, trainer, pl_module, stage):
        pl_module.training_step = self.inner


def test_a_wrapper_of_someone_elses_over_selective_token_losss_runs():
    # a review: Lightning's is_overridden reads __code__ one __wrapped__ below the outer wrapper, where it met
    # SelectiveTokenLoss's wrapper object, which had none (AttributeError before the first step)
    torch.manual_seed(0)
    other = _WrapsTheStepToo()
    model = DemoGPT(**tiny_gpt_kwargs())
    trainer = lightning.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[SelectiveTokenLoss(method="topk", keep_ratio=0.5), other])
    trainer.fit(model, DataLoader(_Tokens(), batch_size=4))
    assert other.calls == 2


def test_unwrapping_a_block_keeps_a_forward_set_on_the_instance_before():
    # a review: unwrapping deleted the instance's forward, so a block whose forward someone had set on the instance ran
    # its class's after the fit
    block = DemoGPT(**tiny_gpt_kwargs()).blocks[0]
    own = functools.partial(type(block).forward, block)
    block.forward = own
    wrap_block(block, "checkpoint")
    assert vars(block)["forward"] is not own
    unwrap_block(block)
    assert vars(block)["forward"] is own
    wrap_block(block := DemoGPT(**tiny_gpt_kwargs()).blocks[0], "checkpoint")
    unwrap_block(block)
    assert "forward" not in vars(block)
