"""A tiny token model and a dataset with uneven valid-token counts, for the accumulation tests
(imported by test_accumulation.py and by the ddp_accumulate.py script)."""

import lightning
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_efficient import FusedTokenLoss, SelectiveTokenLoss, TokenLosses

VOCAB, SEQ, D = 13, 8, 6
# valid tokens per sample: micro-batches of 2 samples hold 2, 12, 16, 3, ... valid tokens
VALID = [1, 1, 6, 6, 8, 8, 2, 1, 3, 7, 8, 0, 5, 2, 1, 4]


def make_rows():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (len(VALID), SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (len(VALID), SEQ), generator=g)
    for i, n in enumerate(VALID):
        labels[i, n:] = -100
    return ids, labels


class Rows(Dataset):
    def __init__(self):
        self.ids, self.labels = make_rows()

    def __len__(self):
        return len(VALID)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Tiny(lightning.LightningModule):
    """Embedding, tanh, linear head; training_step returns TokenLosses or FusedTokenLoss. lr 0, so
    every step's gradient is taken at the initial weights."""

    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.head = torch.nn.Linear(D, VOCAB)

    def hidden(self, ids):
        return torch.tanh(self.emb(ids))

    def per_token(self, ids, labels):
        logits = self.head(self.hidden(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    def training_step(self, batch, batch_idx):
        if self.fused:
            return FusedTokenLoss(self.hidden(batch["input_ids"]), self.head.weight, batch["labels"], bias=self.head.bias)
        return TokenLosses(self.per_token(batch["input_ids"], batch["labels"]), batch["labels"] != -100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        # in order on every rank (rank r reads samples r, r + W, ...), so the test knows each micro-step
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        return DataLoader(Rows(), batch_size=2, sampler=DistributedSampler(Rows(), shuffle=False) if distributed else None)


class StepGrads(lightning.Callback):
    """The gradients each optimizer step used (after normalisation and clipping: ``steps``), the
    gradients ``on_before_optimizer_step`` sees (before clipping: ``before_clipping``) and the
    micro-batches' input ids, on rank 0. Listed before SelectiveTokenLoss, so its hook runs first."""

    def __init__(self):
        self.steps, self.before_clipping, self.batches = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before_clipping.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})

    def on_fit_start(self, trainer, pl_module):
        self.init = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch["input_ids"].clone())
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.steps.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})


class InstallsBatchTokenMean(lightning.Callback):
    """AutoFit's token mean over a split batch (:class:`~lightning_efficient.autofit.token_mean.BatchTokenMean`),
    installed as AutoFit installs it where its plan splits the batch."""

    def __init__(self):
        from lightning_efficient.autofit.token_mean import BatchTokenMean

        self.mean = BatchTokenMean()

    def on_fit_start(self, trainer, pl_module):
        self.mean.install(trainer, pl_module, "one batch of 4")

    def teardown(self, trainer, pl_module, stage):
        self.mean.remove()


class TinyWithoutBatchIndex(Tiny):
    """:class:`Tiny` whose ``training_step`` takes the batch alone (Lightning then passes no ``batch_idx``)."""

    def training_step(self, batch):
        return super().training_step(batch, None)


def fit(method, scope, fused=False, steps=2, clip=None, extra_callbacks=(), module_class=Tiny, **trainer_kwargs):
    """Train ``steps`` steps with accumulation 2; return the StepGrads callback (initial state,
    per-step gradients, micro-batches' input ids). ``method="batch_token_mean"``: AutoFit's token mean in place of
    SelectiveTokenLoss (every valid token kept)."""
    lightning.seed_everything(0)
    grads = StepGrads()
    loss = InstallsBatchTokenMean() if method == "batch_token_mean" else SelectiveTokenLoss(
        method=method, keep_ratio=0.5, scope=scope, threshold="exact")
    trainer = lightning.Trainer(
        accelerator="cpu", precision="64-true", max_steps=steps, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=clip, callbacks=[grads, loss, *extra_callbacks],
        **trainer_kwargs,
    )
    trainer.fit(module_class(fused))
    return grads


def reference_step_grads(init, method, micro_steps, clip=None):
    """Plain torch, float64: the mean over every kept token of the micro-steps' samples (each
    micro-step's kept set chosen over all its samples), as one batch; clipped like Lightning."""
    from lightning_efficient.tokens.selection import select_tokens

    model = Tiny().double()
    model.load_state_dict(init)
    ids, labels = make_rows()
    kept_sum, kept_count = 0.0, 0
    for samples in micro_steps:
        losses = model.per_token(ids[samples], labels[samples])
        keep = select_tokens(method, losses, labels[samples] != -100, 0.5).keep
        kept_sum, kept_count = kept_sum + losses[keep].sum(), kept_count + int(keep.sum())
    (kept_sum / kept_count).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return {n: p.grad for n, p in model.named_parameters()}


class OwnLossShown(lightning.Callback):
    """Per micro-batch on this rank: the loss Lightning hands ``on_train_batch_end`` (``outputs["loss"]``) and the
    module's own loss divided by the accumulation (what a plain fit hands on), from a module whose
    ``training_step`` keeps its output's ``"loss"`` in ``own_loss`` (:class:`KeepsOwnLoss`)."""

    def __init__(self):
        self.pairs: list[tuple[float, float]] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.pairs.append((float(outputs["loss"]), float(pl_module.own_loss / trainer.accumulate_grad_batches)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(trainer.global_step)  # (the step the micro-batch trains in)


class KeepsOwnLoss(Tiny):
    """:class:`Tiny` keeping its output's own ``"loss"`` (the micro-batch's token mean) in ``own_loss``."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.own_loss = output["loss"].detach().clone()
        return output
