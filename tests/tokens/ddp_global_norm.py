"""Run by test_ddp.py: a 2-process CPU DDP step with SelectiveTokenLoss, gradients saved by rank 0.

Usage: python ddp_global_norm.py OUT.pt METHOD SCOPE
"""

import sys

import lightning
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_efficient import SelectiveTokenLoss, TokenLosses

VOCAB, SEQ, N = 11, 6, 4


def make_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    labels[1, 1:] = -100  # rank 1 gets samples 1 and 3: far fewer valid tokens than rank 0
    labels[3, 2:] = -100
    return ids, labels


class Rows(Dataset):
    def __init__(self):
        self.ids, self.labels = make_batch()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 5)
        self.head = torch.nn.Linear(5, VOCAB)

    def per_token(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    def training_step(self, batch, batch_idx):
        return TokenLosses(self.per_token(batch["input_ids"], batch["labels"]), batch["labels"] != -100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=2)


class SaveGrads(lightning.Callback):
    def __init__(self, path):
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 0:
            grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()}
            torch.save({"grads": grads, "init": self.init}, self.path)

    def on_fit_start(self, trainer, pl_module):
        self.init = {k: v.clone() for k, v in pl_module.state_dict().items()}


if __name__ == "__main__":
    out, method, scope = sys.argv[1], sys.argv[2], sys.argv[3]
    lightning.seed_everything(0)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", precision="64-true", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SelectiveTokenLoss(method=method, keep_ratio=0.5, scope=scope), SaveGrads(out)],
    )
    trainer.fit(Tiny())
