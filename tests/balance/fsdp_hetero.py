"""Run by test_fsdp.py: hetero_fsdp on 2 gloo CPU processes, several fits in one launch.

Usage: python fsdp_hetero.py OUT_DIR

The parent starts two processes (rank, world size and a free port in their environment, so every
Trainer joins the same process group); each runs the fits below in turn and writes OUT_DIR/rankR.pt:

- ``samples`` / ``tokens``: two SGD steps (lr 1, float64) with shares 3:1 of a global batch of 16
  and micro-batches capped at 5 (the plan is 12:4 in 3 micro-batches: 4+4+4 and 2+1+1); rank 0
  saves the full parameters at the start and after each step, and each step's global batch;
- ``straight``: 2 epochs (24 samples, global batch 8, shares 3:1, SGD with momentum), saving a
  distributed checkpoint after step 2 (mid-epoch 0); each rank records the samples it trained per step;
- ``resumed``: the same fit resumed from that checkpoint; ``resumed_full``: resumed from a full
  (single-file) checkpoint written at the same moment, with ``save_distributed_checkpoint=False``;
- ``unmeasured``: shares "auto", re-planned every step, with rank 1 never measured: the shares per step;
- ``rebalance``: shares "auto" with rank 1 3x slower per sample (slept before the forward): the shares in force per step; then
  ``sync_off``: a backward inside ``gradient_sync_off()`` leaves the sharded gradients unset, one after it sets them;
- ``unsharded``: a module whose head no ``fully_shard`` manages: the error fit raises; ``replicated``: the
  same with those parameters made replicated DTensors on the data-parallel mesh; ``validate_unsharded``:
  ``validate`` of the unsharded module (no refusal: nothing is trained).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from lightning_efficient import HeterogeneousFSDPStrategy, TokenLosses
from tests.ddp import launch_ranks

SEQ, VOCAB, D = 4, 11, 8


class Rows(Dataset):
    """``n`` sequences of token ids; labels with about 40% ignored (``masked``) or none ignored."""

    def __init__(self, n: int, masked: bool = False):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if masked:
            self.labels[torch.rand(n, SEQ, generator=g) < 0.4] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"ids": self.ids[i], "labels": self.labels[i], "index": i}


class Net(torch.nn.Module):
    """Embedding, two encoder blocks, head (float64)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(D, 2, dim_feedforward=16, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = torch.nn.Linear(D, VOCAB)
        self.double()  # float64 ("64-true" is not offered by ModelParallelStrategy; "32-true" keeps the dtype)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def per_token(net, batch):
    logits = net(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(batch["labels"].shape)


class TinyTransformer(lightning.LightningModule):
    """:class:`Net` with ``fully_shard`` per block and then on the net in ``configure_model`` (``shard_root=False``:
    the blocks only, leaving the embedding and head to no ``fully_shard``)."""

    def __init__(self, mode: str = "samples", slow_rank: int | None = None, shard_root: bool = True, momentum: float = 0.0,
                 replicate_rest: bool = False):
        super().__init__()
        self.mode, self.slow_rank, self.shard_root, self.momentum = mode, slow_rank, shard_root, momentum
        self.replicate_rest = replicate_rest
        self.net = Net()
        self.trained: list[dict] = []

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        if self.shard_root:
            fully_shard(self.net, mesh=mesh)
        elif self.replicate_rest:  # DTensors on the data-parallel mesh, but replicated: no fully_shard manages them
            from torch.distributed.tensor import Replicate, distribute_tensor

            for owner in (self.net.emb, self.net.head):
                for name, p in list(owner.named_parameters(recurse=False)):
                    setattr(owner, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))

    def training_step(self, batch, batch_idx):
        self.trained.append({"step": self.trainer.global_step, "epoch": self.current_epoch,
                             "indices": batch["index"].tolist()})
        if self.slow_rank is not None:  # 1 ms a sample, 3 ms on the slow rank, BEFORE the forward: the fast
            # rank then waits for the slow one inside the root's all-gather, which its speed must leave out
            time.sleep(0.001 * len(batch["ids"]) * (3 if self.global_rank == self.slow_rank else 1))
        losses = per_token(self.net, batch)
        if self.mode == "tokens":
            return TokenLosses(losses, batch["labels"] != -100)
        return losses.mean()  # every sample has SEQ tokens: the mean over the micro-batch's samples

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", per_token(self.net, batch).mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0 if self.momentum == 0 else 0.1, momentum=self.momentum)


def full_parameters(module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: call on every rank)."""
    return {name: p.full_tensor().detach().clone() for name, p in module.named_parameters()}


class RecordSteps(lightning.Callback):
    """Full parameters at the start and after each optimizer step, and each step's global batch."""

    def __init__(self):
        self.params: list[dict] = []
        self.batches: list[list[int]] = []
        self.shares: list[list[int]] = []
        self.plan = None

    def on_train_start(self, trainer, pl_module):
        self.params.append(full_parameters(pl_module))
        sampler = trainer.strategy.sampler
        self.plan = {"shares": list(sampler.plan_at(0).shares), "accumulation": sampler.plan_at(0).accumulation,
                     "micro": [[len(m) for m in sampler.rank_slice(0, sampler.permutation(), r)] for r in range(2)]}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        sampler = trainer.strategy.sampler
        self.batches.append(sampler.global_batch_indices(trainer.global_step, sampler.permutation()))
        self.shares.append(trainer.strategy.current_shares)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.params.append(full_parameters(pl_module))


class Unmeasured(lightning.Callback):
    """Rank ``rank`` has no speed reading when each step starts (as before its first micro-step is read)."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank:
            trainer.strategy.balancer.local_speed = None


class SaveAt(lightning.Callback):
    """At ``step``, a checkpoint in the strategy's format to ``path`` and, if ``full`` is given, a full
    (single-file) one there too (the same moment, so both resumes must continue the same run)."""

    def __init__(self, path: Path, step: int, full: Path | None = None):
        self.path, self.step, self.full = path, step, full

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(self.path)
            if self.full is not None:
                distributed = trainer.strategy._save_distributed_checkpoint
                trainer.strategy._save_distributed_checkpoint = False  # as save_distributed_checkpoint=False writes it
                try:
                    trainer.save_checkpoint(self.full)
                finally:
                    trainer.strategy._save_distributed_checkpoint = distributed


def trainer(callbacks, **kwargs) -> lightning.Trainer:
    kwargs.setdefault("max_steps", 2)
    return lightning.Trainer(
        accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs,
    )


def run(out: Path, rank: int) -> dict:
    results: dict = {}
    for mode in ("samples", "tokens"):
        record = RecordSteps()
        strategy = HeterogeneousFSDPStrategy(global_batch_size=16, shares=[3.0, 1.0], max_micro_batch=5)
        trainer([record], max_steps=2, strategy=strategy).fit(TinyTransformer(mode), DataLoader(Rows(48, masked=mode == "tokens"), batch_size=4))
        results[mode] = {"params": record.params, "batches": record.batches, "plan": record.plan}

    checkpoint, full = out / "step2.ckpt", out / "step2-full.ckpt"
    for tag in ("straight", "resumed", "resumed_full"):
        module = TinyTransformer(momentum=0.9)
        record = RecordSteps()
        callbacks = [SaveAt(checkpoint, 2, full)] if tag == "straight" else []
        strategy_kwargs = {"global_batch_size": 8, "shares": [3.0, 1.0], "seed": 7,
                           "save_distributed_checkpoint": tag != "resumed_full"}
        fit = trainer([*callbacks, record], max_epochs=2, max_steps=-1,
                      strategy=HeterogeneousFSDPStrategy(**strategy_kwargs))
        resume = {"straight": None, "resumed": str(checkpoint), "resumed_full": str(full)}[tag]
        fit.fit(module, DataLoader(Rows(24), batch_size=4), ckpt_path=resume)
        results[tag] = {"trained": module.trained, "final": record.params[-1], "global_step": fit.global_step}

    record = RecordSteps()
    strategy = HeterogeneousFSDPStrategy(global_batch_size=24, shares="auto", warmup_steps=2, rebalance_every=2,
                                         hysteresis=0.02)
    module = TinyTransformer(slow_rank=1)
    trainer([record], max_steps=14, strategy=strategy).fit(module, DataLoader(Rows(48), batch_size=4))
    results["rebalance"] = {"shares": record.shares}

    # rank 1 never has a reading when a re-plan is due: the shares stay (no made-up speed for it)
    record = RecordSteps()
    strategy_unmeasured = HeterogeneousFSDPStrategy(global_batch_size=24, shares="auto", warmup_steps=1, rebalance_every=1,
                                                    hysteresis=0.0)
    trainer([record, Unmeasured(1)], max_steps=4, strategy=strategy_unmeasured).fit(TinyTransformer(), DataLoader(Rows(48), batch_size=4))
    results["unmeasured"] = {"shares": record.shares, "speeds": strategy_unmeasured.balancer.speeds}

    # the probe's sync switch: no reduce-scatter inside (the sharded gradients stay unset), and back on after
    rows = Rows(4)
    batch = {"ids": rows.ids[rank::2], "labels": rows.labels[rank::2]}
    module.zero_grad(set_to_none=True)
    with strategy.gradient_sync_off():
        per_token(module.net, batch).mean().backward()
    unset_inside = all(p.grad is None for p in module.parameters())
    module.zero_grad(set_to_none=True)
    per_token(module.net, batch).mean().backward()
    results["sync_off"] = {"unset_inside": unset_inside, "set_after": all(p.grad is not None for p in module.parameters())}

    for tag, module in (("unsharded", TinyTransformer(shard_root=False)),
                        ("replicated", TinyTransformer(shard_root=False, replicate_rest=True))):
        try:
            trainer([], strategy=HeterogeneousFSDPStrategy(global_batch_size=8)).fit(module, DataLoader(Rows(16), batch_size=4))
            results[tag] = "no error"
        except Exception as error:  # noqa: BLE001 - the test reads which error
            results[tag] = f"{type(error).__name__}: {error}"
    # validation needs no gradient averaging: the same unsharded module validates
    try:
        metrics = trainer([], strategy=HeterogeneousFSDPStrategy(global_batch_size=8)).validate(
            TinyTransformer(shard_root=False), DataLoader(Rows(8), batch_size=4), verbose=False)
        results["validate_unsharded"] = metrics[0]["val_loss"]
    except Exception as error:  # noqa: BLE001
        results["validate_unsharded"] = f"{type(error).__name__}: {error}"
    return results


def main(out: Path) -> None:
    rank = os.environ.get("LOCAL_RANK")
    if rank is None:
        codes = launch_ranks(__file__, out)
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        return
    torch.set_num_threads(1)
    torch.save(run(out, int(rank)), out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
