"""A finetuning set-up for tests of what happens when the parameters that train change mid-fit: the demo GPT on long rows
whose embeddings and blocks a ``BaseFinetuning`` callback unfreezes at an epoch."""

from __future__ import annotations

import lightning
import torch
from lightning.pytorch.callbacks import BaseFinetuning

from lightning_efficient import CorpusDataModule, DemoGPT

#: long rows: the unfrozen blocks' activations (about 17 MiB each at 8 samples) are well above an RSS reading's spread
MODEL = {"vocab_size": 512, "n_layers": 4, "d_model": 128, "n_heads": 2, "seq_len": 256, "tie_embeddings": False}


class FinetunedGPT(DemoGPT):
    """The demo GPT with an optimizer over what trains when the fit starts, as a finetuning set-up builds it."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class Unfreeze(BaseFinetuning):
    """The embeddings and blocks frozen at the start, trained from epoch ``at``; ``refreeze_at``: frozen again there,
    and trained again the epoch after (a set frozen and unfrozen in turn)."""

    def __init__(self, at: int = 1, refreeze_at: int | None = None) -> None:
        super().__init__()
        self.at, self.refreeze_at = at, refreeze_at

    @staticmethod
    def backbone(pl_module):
        return [pl_module.tok_emb, pl_module.pos_emb, pl_module.blocks]

    def freeze_before_training(self, pl_module):
        self.freeze(self.backbone(pl_module))

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == self.at:
            self.unfreeze_and_add_param_group(self.backbone(pl_module), optimizer)
        elif current_epoch == self.refreeze_at:
            self.freeze(self.backbone(pl_module), train_bn=True)
        elif self.refreeze_at is not None and current_epoch == self.refreeze_at + 1:
            self.make_trainable(self.backbone(pl_module))


def finetune(data_kwargs, callbacks, *, epochs=2, unfreeze_at=1, refreeze_at=None, root=None, ckpt_path=None, accumulate=1,
             model_class=None):
    """The finetuning fit (``Unfreeze``; ``unfreeze_at=None``: without it) with ``callbacks``, on one CPU device: its
    trainer and module."""
    lightning.seed_everything(0)
    model = (model_class or FinetunedGPT)(**MODEL)
    data = CorpusDataModule(**{**data_kwargs, "batch_size": 8, "seq_len": MODEL["seq_len"]})
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=epochs, limit_train_batches=3, limit_val_batches=0, logger=False,
                                enable_checkpointing=root is not None, default_root_dir=root, enable_progress_bar=False,
                                enable_model_summary=False, accumulate_grad_batches=accumulate,
                                callbacks=[*([] if unfreeze_at is None else [Unfreeze(unfreeze_at, refreeze_at)]), *callbacks])
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model


def assert_trained_alike(model, reference, atol=0.0):
    """Every parameter of ``model`` within ``atol`` of ``reference``'s."""
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol, msg=name)
