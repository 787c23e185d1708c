"""Run by test_strategy.py: 2-process CPU runs of hetero_ddp. Usage: python ddp_hetero.py MODE OUT [EXTRA], or
python ddp_hetero.py --runs RUNS.json for several fits one after another in the same 2 processes (see ``run``).

Modes: samples / tokens / selective (two steps with shares 2:1 and learning rate 0, rank 0 saves its gradients and
global batches, and in samples the loss logged with sync_dist=True; with the suffix _acc, a global batch of 10 with
micro-batches capped at 3, so the shares 7:3 run as micro-batches 3+2+2 and 1+1+1), rebalance (rank 1 slowed 3x; rank
0 saves the shares over time; rebalance_selective: the same with SelectiveTokenLoss gathering every rank's token
scores in the step; rebalance_logged: the same with the step's loss logged with sync_dist=True at the step's end;
rebalance_gathered: the same with the loss gathered by self.all_gather there; rebalance_metric: a torchmetrics MeanMetric
of the loss synced on each step (dist_sync_on_step=True) there; rebalance_direct: a torch.distributed.all_reduce of
it there; rebalance_backward: an all-reduce in the backward, as SyncBatchNorm's),
probe (max_micro_batch="auto" under a real per-rank memory limit: rank 0 may grow its address space by 256 MiB, rank 1
by 48 MiB, from the start of fit to its end), bad_global, bad_accumulation, bad_iterating_step (a
training_step(self, dataloader_iter)) (the ValueError fit raises is written to OUT).
"""

import dataclasses
import hashlib
import json
import os
import resource
import sys
import time

import lightning
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader, Dataset, default_collate
from transformers import BatchEncoding

from lightning_efficient import HeterogeneousDDPStrategy, SelectiveTokenLoss, TokenLosses

N, SEQ, VOCAB, FEATURES = 48, 5, 13, 6


class Rows(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(N, FEATURES, generator=g, dtype=torch.float64)
        self.y = torch.randn(N, 1, generator=g, dtype=torch.float64)
        self.ids = torch.randint(0, VOCAB, (N, SEQ), generator=g)
        self.labels = torch.randint(0, VOCAB, (N, SEQ), generator=g)
        self.labels[torch.rand(N, SEQ, generator=g) < 0.4] = -100  # uneven valid tokens per sample

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "ids": self.ids[i], "labels": self.labels[i], "index": i}


@dataclasses.dataclass
class RowsBatch:
    """A dataclass batch whose first field is 0-d (a new user's trial: it was counted as one sample)."""

    count: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor

    def __getitem__(self, key):
        return getattr(self, key)


# HETERO_BATCH_TYPE: the batches as dicts (Rows' own), a dataclass, or Hugging Face's BatchEncoding (a Mapping, not a
# dict), the last two with a 0-d value first
COLLATES = {"dict": default_collate,
            "dataclass": lambda samples: RowsBatch(count=torch.tensor(len(samples)), **default_collate(samples)),
            "encoding": lambda samples: BatchEncoding({"count": torch.tensor(len(samples)), **default_collate(samples)})}


class AllReducedInBackward(torch.autograd.Function):
    """The identity, whose backward all-reduces the sum of its gradient (SyncBatchNorm all-reduces in its backward)."""

    @staticmethod
    def forward(ctx, hidden):
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        total = grad.sum().detach().clone()
        torch.distributed.all_reduce(total)
        return grad


class Module(lightning.LightningModule):
    def __init__(self, mode, slow_rank=None):
        super().__init__()
        self.mode, self.slow_rank = mode, slow_rank
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        if mode.startswith("probe"):  # about 1.8 MiB of address space per sample at the peak of a micro-step
            self.wide = torch.nn.Linear(FEATURES, 1 << 15)
        if mode == "rebalance_metric":
            self.mean_loss = torchmetrics.MeanMetric(dist_sync_on_step=True)

    def per_sample_loss(self, batch):
        if self.mode == "rebalance_backward":  # the all-reduce runs before the first layer's gradients
            hidden = AllReducedInBackward.apply(self.net[1](self.net[0](batch["x"])))
            return F.mse_loss(self.net[2](hidden), batch["y"])
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def per_token(self, batch):
        logits = self.head(torch.tanh(self.emb(batch["ids"])))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(batch["labels"].shape)

    def training_step(self, batch, batch_idx):
        if self.mode.startswith(("tokens", "selective", "rebalance_selective")):
            # every parameter takes part (DDP all-reduces only buckets whose gradients are all ready)
            losses = self.per_token(batch) + 0 * self.net(batch["x"]).sum()
            out = TokenLosses(losses, batch["labels"] != -100)
        else:
            out = self.per_sample_loss(batch) + 0 * self.per_token(batch).sum()
        if self.mode.startswith("probe"):
            out = out + F.dropout(torch.tanh(self.wide(batch["x"])), 0.1).square().mean()  # draws random numbers
        if self.slow_rank is not None:  # compute that grows with the batch: 1 ms a sample, 3 ms on the slow rank
            time.sleep(0.001 * len(batch["x"]) * (3 if self.global_rank == self.slow_rank else 1))
        if self.mode in ("rebalance_logged", "samples", "samples_acc"):  # Lightning all-reduces it here: a rank waits
            self.log("logged_loss", out, sync_dist=True, on_step=True, batch_size=len(batch["x"]))
        if self.mode in ("samples", "samples_acc"):  # a half-precision mean of the strategy's own (a review: inf)
            self.reduced_half = self.trainer.strategy.reduce(torch.tensor(22000.0, dtype=torch.float16))
        if self.mode == "rebalance_gathered":
            self.gathered = self.all_gather(out.detach())
        if self.mode == "rebalance_metric":  # its forward gathers the ranks' states: a rank waits there
            self.synced_mean = self.mean_loss(out.detach())
        if self.mode == "rebalance_direct":
            summed = out.detach().clone()
            torch.distributed.all_reduce(summed)
        self.own_loss = (out["loss"] if isinstance(out, TokenLosses) else out).detach().clone()
        return out

    def configure_optimizers(self):
        if self.mode.startswith("probe"):
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.0 if not self.mode.startswith("rebalance") else 1e-3)


class IteratingModule(Module):
    """training_step(self, dataloader_iter): it draws its own batches (Lightning's advanced form)."""

    def training_step(self, dataloader_iter):
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


def address_space_kib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1])


class MemoryLimit(lightning.Callback):
    """A real allocator limit for the whole fit: RLIMIT_AS at the current address space plus an allowance.

    Before its first micro-batch the probe already holds about 25 MiB more than at ``on_fit_start``
    (Adam's state, the gradients, its copy of the weights to restore, gloo and malloc), and a
    micro-step of the probe module peaks at about 1.8 MiB per sample (measured on CPU, float64): the
    whole global batch of 48 needs about 130 MiB, so rank 0's 256 MiB never binds while rank 1's 48 MiB
    binds well below its share of 24.
    """

    def __init__(self, out):
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        torch.ones(4).add_(1)  # start the intra-op threads before the limit
        self.start = {k: v.clone() for k, v in pl_module.state_dict().items()}
        allowance_mib = 256 if trainer.global_rank == 0 else 48
        limit = address_space_kib() * 1024 + allowance_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))

    def on_train_start(self, trainer, pl_module):  # after the probe: it must have left no trace
        self.untouched = {
            "weights": all(torch.equal(v, self.start[k]) for k, v in pl_module.state_dict().items()),
            "rng": hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest(),
            "optimizer_state": all(len(o.state) == 0 for o in trainer.optimizers),
            "grads": all(p.grad is None for p in pl_module.parameters()),
        }
        self.micro_batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro_batches += 1
        if trainer.global_rank == 0:
            json.dump({"caps": trainer.strategy.micro_batch_caps, "accumulation": trainer.accumulate_grad_batches,
                       "shares": trainer.strategy.current_shares, "micro_batches": self.micro_batches,
                       "untouched": self.untouched}, open(self.out, "w"))

    def on_fit_end(self, trainer, pl_module):
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


class Record(lightning.Callback):
    def __init__(self, out, mode):
        self.out, self.mode, self.shares, self.steps = out, mode, [], []
        self.shown: list[tuple[float, float]] = []  # rank 0's: the loss handed on, the module's own over the accumulation

    def on_fit_start(self, trainer, pl_module):
        self.init = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        strategy = trainer.strategy
        if self.mode.startswith("rebalance"):
            self.shares.append(strategy.current_shares)
            if trainer.global_rank == 0:
                json.dump({"shares": self.shares}, open(self.out, "w"))
            return
        if trainer.global_rank == 0:  # steps 0 and 1: the first uses an estimated token scale, the next the last count
            step = trainer.global_step
            sampler = strategy.sampler
            permutation = sampler.permutation()
            indices = sampler.global_batch_indices(step, permutation)
            micro = [sampler.rank_slice(step, permutation, rank) for rank in range(trainer.world_size)]
            grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            self.steps.append({"grads": grads, "indices": indices, "micro": micro, "shares": strategy.current_shares})
            torch.save({"init": self.init, "steps": self.steps, "shown": self.shown}, self.out)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.mode.startswith("rebalance") and trainer.global_rank == 0:
            self.shown.append((float(outputs["loss"]), float(pl_module.own_loss / trainer.accumulate_grad_batches)))
            torch.save({"init": self.init, "steps": self.steps, "shown": self.shown}, self.out)
        # (the batch that ended the step: its optimizer step saved it; a later micro-batch belongs to the next step)
        if self.mode in ("samples", "samples_acc") and trainer.global_rank == 0 and self.steps and "logged" not in self.steps[-1]:
            self.steps[-1]["logged"] = float(trainer.callback_metrics["logged_loss"])  # the step's last micro-batch's
            self.steps[-1]["reduced_half"] = pl_module.reduced_half
            torch.save({"init": self.init, "steps": self.steps, "shown": self.shown}, self.out)


def run(mode: str, out: str, *extra: str, batch_type: str = "dict", caps: str = "3") -> None:
    """One fit of ``mode`` on the 2 ranks, writing OUT; ``batch_type`` and ``caps`` as HETERO_BATCH_TYPE and HETERO_CAPS."""
    lightning.seed_everything(0)
    kwargs = {"global_batch_size": 6, "shares": [2.0, 1.0]}
    if mode.endswith("_acc"):
        cap_list = [None if c == "None" else int(c) for c in caps.split(",")]
        kwargs = {"global_batch_size": 10, "shares": [2.0, 1.0], "max_micro_batch": cap_list[0] if len(cap_list) == 1 else cap_list}
    if mode.startswith("rebalance"):
        kwargs = {"global_batch_size": 24, "shares": "auto", "warmup_steps": 2, "rebalance_every": 2, "hysteresis": 0.02}
    if mode.startswith("probe"):  # probe_fixed: the caps rank 1's probe finds, given, to compare the RNG with
        kwargs = {"global_batch_size": 48, "shares": [1.0, 1.0], "max_micro_batch": "auto" if mode == "probe" else [48, int(extra[0])]}
    if mode == "bad_global":
        kwargs = {"global_batch_size": 1}
    if mode == "bad_accumulation":  # 3 micro-batches a step, each rank's 2 samples of 4 cannot fill them
        kwargs = {"global_batch_size": 4}
    strategy = HeterogeneousDDPStrategy(**kwargs)
    selective = mode.startswith(("selective", "rebalance_selective"))
    callbacks = [SelectiveTokenLoss(method="topk", keep_ratio=0.5, scope="global")] if selective else []
    callbacks = [MemoryLimit(out)] if mode.startswith("probe") else [Record(out, mode), *callbacks]
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="64-true", max_steps=14 if mode.startswith("rebalance") else 2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, accumulate_grad_batches=3 if mode == "bad_accumulation" else 1,
    )
    try:
        module_class = IteratingModule if mode == "bad_iterating_step" else Module
        loader = DataLoader(Rows(), batch_size=3, collate_fn=COLLATES[batch_type])
        trainer.fit(module_class(mode, slow_rank=1 if mode.startswith("rebalance") else None), loader)
    except ValueError as error:
        if not mode.startswith("bad_"):
            raise
        with open(out, "w") as file:
            file.write(str(error))


if __name__ == "__main__":
    if sys.argv[1] == "--runs":  # a JSON list of [mode, out, batch_type, caps]: one fit after another in these 2 processes
        for mode, out, batch_type, caps in json.load(open(sys.argv[2])):
            run(mode, out, batch_type=batch_type, caps=caps)
    else:
        run(*sys.argv[1:], batch_type=os.environ.get("HETERO_BATCH_TYPE", "dict"), caps=os.environ.get("HETERO_CAPS", "3"))
