"""Run by test_callback.py: 2-process CPU DDP, every block checkpointed, rank 0 saves the gradients."""

import sys

import lightning
import torch
from torch.utils.data import DataLoader

from lightning_efficient import ActivationMemory, DemoGPT


def model():
    return DemoGPT(vocab_size=300, n_layers=2, d_model=16, n_heads=2, seq_len=8).double()


def batches():
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 300, (4, 8), generator=g), "labels": torch.randint(0, 300, (4, 8), generator=g)}


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.batch = batches()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


class Module(DemoGPT):
    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class SaveGrads(lightning.Callback):
    def __init__(self, path):
        self.path = path

    def on_fit_start(self, trainer, pl_module):
        self.init = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 0:
            torch.save({"grads": {n: p.grad.clone() for n, p in pl_module.named_parameters()}, "init": self.init}, self.path)


if __name__ == "__main__":
    lightning.seed_everything(0)
    module = Module(vocab_size=300, n_layers=2, d_model=16, n_heads=2, seq_len=8)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", precision="64-true", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[ActivationMemory(policy="checkpoint"), SaveGrads(sys.argv[1])],
    )
    trainer.fit(module)
