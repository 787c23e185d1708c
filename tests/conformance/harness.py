"""The conformance matrix: one tiny model, one runner, and the list of cases.

Every case is one fit with a plugin (or all of them) and the same fit in plain Lightning, run by the
same function :func:`fit`, which records a :class:`Trace`: per optimizer step the learning rate and
momentum/betas of the optimizer the trainer actually steps, per micro-batch the sample ids and the
token-loss sum and count, per fit the final parameters. Tests compare the traces.

Axes (each value meets every plugin at least once, see :func:`cases`): precision, resume (none, at an
epoch end, mid-epoch), scheduler, loop (plain, accumulation, clipping, validation), a fit that raises
then a second fit, and strategy (one device, ddp, hetero_ddp, a resume on a different number of
processes, fsdp: FSDP2 through Lightning's ``ModelParallelStrategy`` with ``fully_shard`` per block).
After them, :data:`STREAMING_CASES`: SelectiveTokenLoss's streaming threshold on the fused head; then
:data:`AUTOFIT_CASES`; then :data:`UNFREEZE_CASES`: a ``BaseFinetuning`` callback that unfreezes the embedding and
the first block at epoch 1, under AutoFit and ``ActivationMemory(policy="auto")``, which plan again when it does.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from lightning_efficient import FusedTokenLoss, TokenLosses
from lightning_efficient.resumable import ResumableDataLoader

VOCAB, D_MODEL, SEQ, N_SAMPLES, N_VAL = 64, 16, 8, 24, 8
MICRO_BATCH = 4  # samples per optimizer step on one device (split over the ranks under ddp)
ACCUMULATE = 3
EPOCHS = 3
RAISE_AT = 2  # the first fit of a "raise" case raises in on_train_batch_end at this global step

PLUGINS = ("tokens", "tokens_select", "activations", "eightbit", "report", "hetero", "all")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
RESUMES = ("none", "epoch", "mid")
SCHEDULERS = ("lambda", "sequential", "chained", "onecycle", "plateau", "every_2")
LOOPS = ("plain", "accumulate", "clip", "validate")
RAISES = (False, True)
# Sharded strategies (FSDP2: ModelParallelStrategy, the module shards itself in configure_model).
# Adding "hetero_fsdp" is one line: append it here (HeterogeneousFSDPStrategy takes hetero_ddp's arguments).
SHARDED_STRATEGIES = ("fsdp", "hetero_fsdp")
STRATEGIES = ("single", "ddp", "hetero_ddp", "resize", *SHARDED_STRATEGIES)
MULTI_PROCESS = ("ddp", "hetero_ddp", "resize", *SHARDED_STRATEGIES)
# EightBitOptimizer under FSDP2 (bitsandbytes on each rank's local shard): False would drop its cells (eightbit under
# the sharded strategies, and the 8-bit optimizer inside "all" there)
EIGHT_BIT_SHARDED = True
ACTIVATION_POLICIES = ("checkpoint", "selective", "disk", "offload", "auto")

# SelectiveTokenLoss on the fused head (the model returns FusedTokenLoss) with the streaming threshold:
# not in PLUGINS (whose covering draws every other cell); its cells, STREAMING_CASES, come after all the others
STREAMING = "tokens_stream"
# its schedule: the full loss at steps 0 and 1 (the warm-up, then the ramp's start), keep 0.75 at step 2,
# STREAMING_KEEP from step 3 on; step 1's scores give step 2 its threshold, so every step streams
STREAMING_KEEP, STREAMING_WARMUP, STREAMING_RAMP = 0.7, 1, 2

# plugins whose step loss is the mean over all valid tokens of the step (global, all micro-batches):
# their reference is plain Lightning on one device with the step's samples in one batch
TOKEN_NORMALISED = ("tokens", "tokens_select", "hetero", "all", STREAMING)


# -- model and data ----------------------------------------------------------------------------------
class TokenData(Dataset):
    """``n`` random token sequences; item ``i`` carries its index and ``i % 4`` ignored label positions."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=generator)
        self.inputs, self.labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        for i in range(n):
            if i % 4:
                self.labels[i, -(i % 4):] = -100

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"ids": torch.tensor(i), "inputs": self.inputs[i], "labels": self.labels[i]}


class RankShuffleSampler(Sampler[int]):
    """This rank's part ``[rank::world]`` of a permutation drawn from ``seed + epoch`` (Lightning calls
    ``set_epoch``): the union over ranks of each step's batches is the single-device batch."""

    def __init__(self, n: int, rank: int, world: int, seed: int = 0) -> None:
        self.n, self.rank, self.world, self.seed, self.epoch = n, rank, world, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return iter(order[self.rank :: self.world])

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        # no bias: the keys' bias has a gradient of exactly zero in theory (softmax ignores a constant
        # per query), so in practice float noise, which Adam scales up to full-size updates
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.up, self.down = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class TinyLM(LightningModule):
    """A 2-block transformer returning :class:`TokenLosses` (``fused``: :class:`FusedTokenLoss`, the head's
    input, weight and bias); it records what each training step saw."""

    def __init__(self, scheduler: str, total_steps: int, batch_size: int, rank_split: bool = True,
                 optimizer: str = "adamw", fused: bool = False) -> None:
        super().__init__()
        generator_state = torch.get_rng_state()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        torch.set_rng_state(generator_state)
        self.scheduler_name, self.total_steps, self.batch_size, self.rank_split = scheduler, total_steps, batch_size, rank_split
        self.optimizer_name = optimizer
        self.fused = fused  # training_step returns FusedTokenLoss (hidden states, head, labels)
        self.last_record: tuple[list[int], float, int] | None = None

    def configure_model(self) -> None:
        """Under ModelParallelStrategy (FSDP2): ``fully_shard`` each block, then the whole model, on the
        data-parallel mesh (once: a second fit of the same module finds it sharded)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.device_mesh is None or isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def hidden(self, inputs: Tensor) -> Tensor:
        """The head's input: the final normalised hidden states."""
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.head(self.hidden(inputs))

    def _token_losses(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self(batch["inputs"])
        losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=-100)
        return losses.view_as(batch["labels"]), batch["labels"] != -100

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> TokenLosses | FusedTokenLoss:
        if self.fused:
            hidden = self.hidden(batch["inputs"])
            with torch.no_grad():  # the recorded losses, as the unfused model computes them
                logits = self.head(hidden)
                losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=-100)
            mask = batch["labels"] != -100
            total = float(torch.where(mask, losses.view_as(mask).double(), 0.0).sum())
            self.last_record = (batch["ids"].tolist(), total, int(mask.sum()))
            return FusedTokenLoss(hidden, self.head.weight, batch["labels"], bias=self.head.bias)
        losses, mask = self._token_losses(batch)
        total = float(torch.where(mask, losses.detach().double(), 0.0).sum())
        self.last_record = (batch["ids"].tolist(), total, int(mask.sum()))
        return TokenLosses(losses, mask)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        losses, mask = self._token_losses(batch)
        mean = torch.where(mask, losses.float(), 0.0).sum() / mask.sum()
        self.log("val_loss", mean, batch_size=int(mask.sum()), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
        name, total = self.scheduler_name, self.total_steps
        sched: Any
        if name == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
        elif name == "sequential":
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total - 3)),
            ], milestones=[3])
        elif name == "chained":
            sched = torch.optim.lr_scheduler.ChainedScheduler([
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3),
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
            ])
        elif name == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=total, pct_start=0.3,
                                                        base_momentum=0.8, max_momentum=0.95)
        elif name == "every_2":  # stepped every 2 of the user's batches (Lightning counts the frequency in batches)
            halving = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": halving, "interval": "step", "frequency": 2}}
        elif name == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"}}
        else:
            raise ValueError(name)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> ResumableDataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.rank_split else (0, 1)
        data = TokenData(N_SAMPLES, seed=1)
        return ResumableDataLoader(data, batch_size=self.batch_size, sampler=RankShuffleSampler(len(data), rank, world))

    def val_dataloader(self) -> Any:
        data = TokenData(N_VAL, seed=2)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return torch.utils.data.DataLoader(data, batch_size=4, sampler=RankShuffleSampler(len(data), rank, world))


# -- cases -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One cell of the matrix. ``plugin="plain"`` is plain Lightning; ``single_batch`` puts each step's
    samples in one batch on one device (the token-mean reference of accumulation and data parallelism)."""

    plugin: str
    precision: str = "32-true"
    resume: str = "none"
    scheduler: str = "lambda"
    loop: str = "plain"
    raises: bool = False
    strategy: str = "single"
    activation_policy: str = "checkpoint"
    single_batch: bool = False
    optimizer: str = "adamw"
    scope: str = "batch"  # SelectiveTokenLoss's scope in the streaming cells

    @property
    def name(self) -> str:
        extra = f"-{self.activation_policy}" if self.plugin in ("activations", "all") else ""
        flags = ("-raise" if self.raises else "") + ("-onebatch" if self.single_batch else "")
        flags += "-sgd" if self.optimizer == "sgd" else ""
        flags += "-global" if self.scope == "global" else ""
        return (f"{self.plugin}{extra}-{self.strategy}-{self.precision}-{self.scheduler}-{self.loop}"
                f"-resume_{self.resume}{flags}")

    @property
    def multi_process(self) -> bool:
        return self.strategy in MULTI_PROCESS

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED_STRATEGIES

    @property
    def hetero(self) -> bool:
        return self.plugin == "hetero" or self.strategy.startswith("hetero_")

    @property
    def eight_bit(self) -> bool:
        """Whether EightBitOptimizer is among the plugins (in "all" only where it works)."""
        return self.plugin == "eightbit" or (self.plugin == "all" and (EIGHT_BIT_SHARDED or not self.sharded))

    def reference(self) -> Case:
        """The same fit in plain Lightning: same strategy for plugins that keep Lightning's loss, one
        device with each step's samples in one batch for those that take the step's token mean."""
        token_mean = self.plugin in TOKEN_NORMALISED or self.hetero
        plain = replace(self, plugin="plain", activation_policy="checkpoint", scope="batch")
        if token_mean and (self.multi_process or self.loop == "accumulate"):
            return replace(plain, strategy="single", single_batch=True)
        return plain


def _allowed(plugin: str, strategy: str) -> bool:
    if plugin == "hetero":  # the strategy itself: its own cells, and a resume on another process count
        return strategy in ("hetero_ddp", "resize", "hetero_fsdp")
    if plugin == "eightbit" and strategy in SHARDED_STRATEGIES:
        return EIGHT_BIT_SHARDED
    return True


def _allowed_row(row: dict[str, Any]) -> bool:
    """A combination meant to run: a change of process count happens at a resume; Lightning's
    ModelParallelStrategy refuses 16-mixed (it supports 32-true, bf16-mixed, bf16-true, 16-true)."""
    if row["strategy"] == "resize" and row["resume"] == "none":
        return False
    if row["strategy"] in SHARDED_STRATEGIES and row["precision"] == "16-mixed":
        return False
    return _allowed(row["plugin"], row["strategy"])


def cases() -> list[Case]:
    """A deterministic greedy covering (AETG-style): every value of every axis meets every plugin at
    least once (required), and as many pairs of values of the other axes as those cases allow.

    Each new case is the best of 60 candidates drawn from a fixed-seed generator, scored by the
    required pairs it covers first and the other pairs second."""
    import itertools
    import random

    # the sharded strategies get their cells after the others (below), so that adding one leaves
    # every other cell as it was
    unsharded = tuple(s for s in STRATEGIES if s not in SHARDED_STRATEGIES)
    axes = {"plugin": PLUGINS, "precision": PRECISIONS, "resume": RESUMES, "scheduler": SCHEDULERS,
            "loop": LOOPS, "raises": RAISES, "strategy": unsharded}
    names = list(axes)
    ok = _allowed_row

    def pairs(row: dict[str, Any]) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    required = {(("plugin", p), (a, v)) for p in PLUGINS for a in names[1:] for v in axes[a]
                if a != "strategy" or _allowed(p, v)}
    # pairs of the other axes, except with the strategy: multi-process cells cost several times more
    desired = {((a, x), (b, y)) for a, b in itertools.combinations(names[1:-1], 2) for x in axes[a] for y in axes[b]}
    rng = random.Random(0)
    out: list[Case] = []
    per_plugin: dict[str, int] = {}

    def best_row(fixed: dict[str, Any]) -> dict[str, Any]:
        best, best_score = None, (-1, -1)
        for _ in range(60):
            row = {a: rng.choice(axes[a]) for a in names} | fixed
            if not ok(row):
                continue
            covered = pairs(row)
            score = (len(covered & required), len(covered & desired))
            if score > best_score:
                best, best_score = row, score
        return best

    def add(row: dict[str, Any]) -> None:
        required.difference_update(pairs(row))
        desired.difference_update(pairs(row))
        index = per_plugin.get(row["plugin"], 0)
        per_plugin[row["plugin"]] = index + 1
        out.append(Case(**row, activation_policy=ACTIVATION_POLICIES[index % len(ACTIVATION_POLICIES)]))

    # multi-process cells cost several times more: exactly one per plugin and multi-process strategy,
    # then one-device cells (hetero: hetero_ddp) until every required pair is covered
    for plugin in PLUGINS:
        for strategy in (s for s in MULTI_PROCESS if s in unsharded):
            if _allowed(plugin, strategy) and (("plugin", plugin), ("strategy", strategy)) in required:
                add(best_row({"plugin": plugin, "strategy": strategy}))
    while required:
        plugin = min(required, key=repr)[0][1]
        add(best_row({"plugin": plugin, "strategy": "hetero_ddp" if plugin == "hetero" else "single"}))
    # SGD with momentum: OneCycleLR cycles ``momentum``, which bitsandbytes' SGD8bit reads from ``betas``
    out.append(Case("eightbit", scheduler="onecycle", optimizer="sgd"))
    # one multi-process cell per plugin and sharded strategy
    for strategy in SHARDED_STRATEGIES:
        for plugin in PLUGINS:
            if _allowed(plugin, strategy):
                add(best_row({"plugin": plugin, "strategy": strategy}))
    return out + list(STREAMING_CASES) + list(AUTOFIT_CASES) + list(UNFREEZE_CASES)


# The streaming threshold on the fused head, after every other cell (so none of those changes), picked by
# hand: one device 32-true (a raised fit first, validation twice an epoch, resumed mid-epoch) and bf16-mixed
# (accumulation, resumed mid-epoch); ddp with each rank's own estimate (scope "batch": every rank's is in
# the checkpoint) under 16-mixed, clipping, resumed mid-epoch; hetero_ddp with one estimate from both ranks
# (scope "global") under bf16-true and accumulation, resumed at an epoch end
STREAMING_CASES = (
    Case(STREAMING, "32-true", "mid", "lambda", "validate", raises=True),
    Case(STREAMING, "bf16-mixed", "mid", "onecycle", "accumulate"),
    Case(STREAMING, "16-mixed", "mid", "chained", "clip", strategy="ddp"),
    Case(STREAMING, "bf16-true", "epoch", "sequential", "accumulate", strategy="hetero_ddp", scope="global"),
)


# AutoFit, after the streaming cells (so no other cell changes), picked by hand: budget "auto", 32-bit states, keep or
# checkpoint (exact), and where it searches the micro-batch only half each rank's batch allowed (``micro_batches``),
# so that every such plan splits the batch (the token mean it keeps is then held to the split tolerance). The
# micro-batch is not searched (``autofit_searches_micro_batch``) where a split cannot keep plain Lightning's update:
# under the user's own accumulation (plain Lightning takes the mean of its batches' token means, a split the step's
# token mean) and under FSDP2 (which reduces at every backward: a split takes the global token mean, plain FSDP2 the
# ranks' means).
AUTOFIT = "autofit"
AUTOFIT_CASES = (
    Case(AUTOFIT, "32-true", "mid", "onecycle", "validate", raises=True),
    Case(AUTOFIT, "bf16-mixed", "epoch", "every_2", "clip"),
    Case(AUTOFIT, "16-mixed", "mid", "sequential", "accumulate"),
    Case(AUTOFIT, "32-true", "mid", "chained", "plain", raises=True, strategy="ddp"),
    Case(AUTOFIT, "bf16-true", "epoch", "lambda", "accumulate", strategy="hetero_ddp"),
    Case(AUTOFIT, "bf16-mixed", "mid", "onecycle", "clip", strategy="fsdp"),
)


# A finetuning unfreeze (loop "unfreeze": :class:`UnfreezeAtEpochOne` beside the plugin, and beside plain Lightning in
# the reference), after the AutoFit cells (so no other cell changes), picked by hand: AutoFit measures and plans again
# when the parameters that train change, ActivationMemory(policy="auto") profiles again; one device, a raised fit, a
# resume mid-epoch 1 (after the unfreeze: BaseFinetuning freezes again when the fit starts and unfreezes at the epoch's
# start) and at the end of epoch 0 (before it)
UNFREEZE = "unfreeze"
UNFREEZE_CASES = (
    Case(AUTOFIT, "32-true", "mid", "sequential", UNFREEZE, raises=True),
    Case(AUTOFIT, "bf16-mixed", "epoch", "onecycle", UNFREEZE),
    Case("activations", "32-true", "mid", "lambda", UNFREEZE, raises=True, activation_policy="auto"),
    Case("activations", "bf16-mixed", "epoch", "chained", UNFREEZE, activation_policy="auto"),
)


class UnfreezeAtEpochOne(BaseFinetuning):
    """Trains the head, the norm and the second block in epoch 0, and everything from epoch 1 (the embedding and the
    first block were in the optimizer from the start: ``configure_optimizers`` takes every parameter)."""

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze([pl_module.embed, pl_module.blocks[0]], train_bn=True)

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.make_trainable([pl_module.embed, pl_module.blocks[0]])


def autofit_searches_micro_batch(case: Case) -> bool:
    """Whether the AutoFit cell searches the micro-batch (see AUTOFIT_CASES)."""
    return case.hetero or not (case.loop == "accumulate" or case.sharded)


# Combinations that cannot work: refused before the first step, with the reason (the test asserts the
# message). Filled from what the plugins document: see MATRIX.md.
REFUSED: dict[str, str] = {}


def steps_per_epoch(case: Case) -> int:
    return N_SAMPLES // MICRO_BATCH // (ACCUMULATE if case.loop == "accumulate" else 1)


def resume_step(case: Case) -> int:
    """The global step the checkpoint of a resume case is taken at."""
    per_epoch = steps_per_epoch(case)
    return per_epoch if case.resume == "epoch" else per_epoch + per_epoch // 2


# -- recording ---------------------------------------------------------------------------------------
class Recorder(Callback):
    """Records, per optimizer step, lr and momentum/betas of ``trainer.optimizers[0]`` as it is stepped,
    and per training batch the sample ids and token-loss sum/count the module saw; in the streaming
    cells also what SelectiveTokenLoss selected (:func:`selection_record`)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.micro: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: TinyLM, batch: Any, batch_idx: int) -> None:
        pl_module.last_record = None  # anything a plugin ran before this batch is not training
        self._step = trainer.global_step  # the optimizer step this micro-batch belongs to

    def on_train_batch_end(self, trainer: Trainer, pl_module: TinyLM, outputs: Any, batch: Any, batch_idx: int) -> None:
        ids, total, count = pl_module.last_record
        self.micro.append({"epoch": trainer.current_epoch, "ids": ids, "sum": total, "count": count,
                           "step": self._step})
        if pl_module.fused:
            self.micro[-1]["selection"] = [selection_record(trainer, outputs)]

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        group = trainer.optimizers[0].param_groups[0]
        betas = [float(b) for b in group["betas"]] if "betas" in group else None
        momentum = float(group["momentum"]) if "momentum" in group else None
        if momentum is not None and betas is not None and type(trainer.optimizers[0]).__module__.startswith("bitsandbytes"):
            # bitsandbytes' SGD applies betas[0] as its momentum: record what the optimizer really uses
            momentum, betas = betas[0], None
        self.steps.append({"step": trainer.global_step, "lr": float(group["lr"]), "betas": betas, "momentum": momentum,
                           "optimizer": type(trainer.optimizers[0]).__name__})


def selection_record(trainer: Trainer, outputs: dict[str, Any]) -> dict[str, Any]:
    """What SelectiveTokenLoss kept of this rank's micro-batch (its output's ``keep`` and ``mask``) and
    what it logged for it (the ``selection/`` metrics: ``trainer.callback_metrics`` holds this
    micro-batch's values, logged on step, this rank's own)."""
    logged = {k.removeprefix("selection/"): float(v) for k, v in trainer.callback_metrics.items() if k.startswith("selection/")}
    keep, valid = outputs["keep"], outputs["mask"]
    return {"kept_positions": keep.flatten().nonzero().flatten().tolist(), "kept": int(keep.sum()),
            "valid": int(valid.sum()), "logged": logged}


class RaiseAt(Callback):
    """Raises in ``on_train_batch_end`` at global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:  # the micro-batch that completed step ``step``
            raise RuntimeError(f"conformance: raised at step {self.step}")


class SaveAt(Callback):
    """``trainer.save_checkpoint`` at the end of epoch 0 (``epoch``) or after global step ``step`` (``mid``)."""

    def __init__(self, path: Path, where: str, step: int) -> None:
        self.path, self.where, self.step, self.saved = path, where, step, False

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.where == "epoch" and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.where == "mid" and trainer.global_step == self.step and not self.saved:
            self.saved = True  # the micro-batch that completed step ``step``, not the next ones
            trainer.save_checkpoint(self.path)


def offload_dir(workdir: Path) -> Path:
    """This process's disk-offload directory: one per rank, so a rank checking what it left behind
    never sees another rank's directory that is still being removed."""
    return workdir / f"offload-rank{os.environ.get('RANK', '0')}"


def plugin_callbacks(case: Case, workdir: Path) -> list[Callback]:
    """The plugin callbacks of ``case`` (fresh instances)."""
    from lightning_efficient import (
        ActivationMemory,
        AutoFit,
        EightBitOptimizer,
        MemoryReport,
        SelectiveTokenLoss,
    )

    def activations() -> Callback:  # disk writes every saved tensor; auto plans for half the kept bytes
        budget = 0.5 if case.activation_policy == "auto" else None
        return ActivationMemory(policy=case.activation_policy, budget=budget, min_offload_bytes=0,
                                offload_dir=str(offload_dir(workdir)))

    made: dict[str, list[Callback]] = {
        "plain": [], "hetero": [],
        "tokens": [SelectiveTokenLoss(method="none")],
        "tokens_select": [SelectiveTokenLoss(method="eslm", keep_ratio=0.5, warmup_steps=1, ramp_steps=2)],
        STREAMING: [SelectiveTokenLoss(method="eslm", keep_ratio=STREAMING_KEEP, warmup_steps=STREAMING_WARMUP,
                                       ramp_steps=STREAMING_RAMP, threshold="streaming", scope=case.scope)],
        "activations": [activations()],
        "eightbit": [EightBitOptimizer(min_8bit_size=512)],
        "report": [MemoryReport(every_n_steps=2, log=False, print_table=False)],
        AUTOFIT: [AutoFit(budget="auto", activation_policies=["keep", "checkpoint"], optimizer_options=["32-bit"],
                          search_micro_batch=autofit_searches_micro_batch(case),
                          micro_batches=[MICRO_BATCH // (2 if case.multi_process else 1) // 2]
                          if autofit_searches_micro_batch(case) else None)],
        "all": [SelectiveTokenLoss(method="none"), activations(),
                *([EightBitOptimizer(min_8bit_size=512)] if case.eight_bit else []),
                MemoryReport(every_n_steps=2, log=False, print_table=False)],
    }
    return made[case.plugin]


def _strategy(case: Case, world: int) -> Any:
    if not case.hetero and world == 1:
        return "auto"
    if case.sharded and not case.hetero:
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo",
                                     timeout=timedelta(seconds=90))
    if case.hetero and case.sharded:
        from lightning_efficient import HeterogeneousFSDPStrategy

        global_batch = MICRO_BATCH * (ACCUMULATE if case.loop == "accumulate" else 1)
        return HeterogeneousFSDPStrategy(global_batch_size=global_batch, warmup_steps=2, rebalance_every=2,
                                         process_group_backend="gloo", timeout=timedelta(seconds=90))
    if case.hetero:
        from lightning_efficient import HeterogeneousDDPStrategy

        global_batch = MICRO_BATCH * (ACCUMULATE if case.loop == "accumulate" else 1)
        return HeterogeneousDDPStrategy(global_batch_size=global_batch, warmup_steps=2, rebalance_every=2,
                                        process_group_backend="gloo", timeout=timedelta(seconds=90))
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90))


def make_trainer(case: Case, world: int, callbacks: list[Callback]) -> Trainer:
    accumulate = ACCUMULATE if case.loop == "accumulate" and not case.single_batch else 1
    validate = case.loop == "validate" or case.scheduler == "plateau"
    # Trainer(precision="16-mixed") on CPU silently becomes bf16-mixed (Lightning 2.6): fp16 autocast with a
    # GradScaler is only reached through the plugin itself
    precision: Any = {"precision": case.precision}
    if case.precision == "16-mixed":
        from lightning.pytorch.plugins import MixedPrecision

        precision = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    if case.loop == UNFREEZE:
        callbacks = [UnfreezeAtEpochOne(), *callbacks]
    return Trainer(
        accelerator="cpu", devices=world, strategy=_strategy(case, world), **precision,
        max_epochs=EPOCHS, accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5 if case.loop == "clip" else None, gradient_clip_algorithm="norm",
        val_check_interval=0.5 if case.loop == "validate" else 1.0, limit_val_batches=1.0 if validate else 0,
        num_sanity_val_steps=0, callbacks=callbacks, logger=False, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        default_root_dir=None,
    )


def make_module(case: Case, world: int) -> TinyLM:
    if case.single_batch:
        batch = MICRO_BATCH * (ACCUMULATE if case.loop == "accumulate" else 1)
    else:
        batch = MICRO_BATCH // world
    # under hetero_ddp the strategy slices global batches itself; the loader's batch size only sets the default
    return TinyLM(case.scheduler, EPOCHS * steps_per_epoch(case), batch, optimizer=case.optimizer,
                  fused=case.plugin == STREAMING)


# -- the runner --------------------------------------------------------------------------------------
def _leftovers(module: nn.Module, workdir: Path) -> dict[str, Any]:
    """What a plugin may leave behind after a fit: instance wrappers, threads, temp dirs, bnb overrides."""
    import sys

    def patched(mod: nn.Module, key: str) -> bool:
        # Lightning's own forward redirection (DDP) leaves ``module.forward`` set to the module's own
        # bound method: harmless, not a wrapper
        value = vars(mod).get(key)
        own = getattr(value, "__self__", None) is mod and getattr(value, "__func__", None) is getattr(type(mod), key, None)
        return key in vars(mod) and not own

    wrapped = sorted(f"{name or 'module'}.{key}" for name, mod in module.named_modules()
                     for key in ("training_step", "forward", "_lightning_efficient_policy") if patched(mod, key))
    bnb = sys.modules.get("bitsandbytes")
    overrides = len(bnb.optim.GlobalOptimManager.get_instance().pid2config) if bnb is not None else 0
    temp = sorted(p.name for p in Path(tempfile.gettempdir()).glob("lightning_efficient_*"))
    mine = offload_dir(workdir)
    temp += sorted(str(p.relative_to(workdir)) for p in mine.rglob("*")) if mine.exists() else []
    return {"wrapped": wrapped, "threads": sorted(t.name for t in threading.enumerate()), "overrides": overrides,
            "temp": temp}


def _params(module: nn.Module) -> dict[str, Tensor]:
    """The final parameters, whole (a sharded one is gathered: a collective, every rank in the same order)."""
    from torch.distributed.tensor import DTensor

    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
    return {k: v.detach().double().cpu().clone() for k, v in state.items()}


def _one_fit(case: Case, world: int, module: TinyLM, extra: list[Callback], workdir: Path,
             callbacks: list[Callback] | None = None, ckpt_path: str | None = None) -> dict[str, Any]:
    recorder = Recorder()
    callbacks = plugin_callbacks(case, workdir) if callbacks is None else callbacks
    trainer = make_trainer(case, world, [*callbacks, recorder, *extra])  # record a batch before raising after it
    error = None
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except Exception as exc:  # noqa: BLE001 (a "raise" case's raise, a refusal or a crash: reported against the cell)
        error = f"{type(exc).__name__}: {exc}"
    return {"steps": recorder.steps, "micro": recorder.micro, "params": _params(module), "error": error,
            "callbacks": callbacks, "trainable_sets_planned": _trainable_sets_planned(callbacks)}


def _trainable_sets_planned(callbacks: list[Callback]) -> int:
    """How many sets of trainable parameters AutoFit or ActivationMemory(policy="auto") planned for in the fit (each
    keeps its plans by the set they were made for: a finetuning unfreeze adds one)."""
    plans = [getattr(c, "_plans_by_what_trains", None) or getattr(c, "_auto_plans", None) for c in callbacks]
    return max((len(p) for p in plans if p), default=0)


def fit(case: Case, workdir: Path, world: int = 1, resume_world: int | None = None) -> dict[str, Any]:
    """Run ``case`` and return its trace: ``main`` (the full fit), ``raised`` (the fit that raised, with
    ``before``/``after`` leftovers) and ``resumed`` (the fit resumed from ``main``'s checkpoint; skipped
    here when ``resume_world`` differs from ``world``: the caller resumes it with :func:`resume`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    trace: dict[str, Any] = {"case": asdict(case)}
    module = make_module(case, world)
    callbacks = plugin_callbacks(case, workdir)
    if case.raises:
        before = _leftovers(module, workdir)
        raised = _one_fit(case, world, module, [RaiseAt(RAISE_AT)], workdir, callbacks)
        raised.pop("callbacks")
        trace["raised"] = {**raised, "before": before, "after": _leftovers(module, workdir)}
    extra: list[Callback] = []
    ckpt = workdir / "resume.ckpt"
    if case.resume != "none":
        extra.append(SaveAt(ckpt, case.resume, resume_step(case)))
    main = _one_fit(case, world, module, extra, workdir, callbacks)
    main.pop("callbacks")
    trace["main"] = main
    if main["error"]:
        return trace
    if case.resume != "none" and (resume_world or world) == world:
        trace["resumed"] = resume(case, workdir, world)
    return trace


def resume(case: Case, workdir: Path, world: int) -> dict[str, Any]:
    """A new module, new plugin callbacks and a new Trainer on ``world`` processes, from the checkpoint."""
    module = make_module(case, world)
    out = _one_fit(case, world, module, [], workdir, ckpt_path=str(workdir / "resume.ckpt"))
    out.pop("callbacks")
    return out


# -- derived views -----------------------------------------------------------------------------------
def merge_ranks(fits: list[dict[str, Any]]) -> dict[str, Any]:
    """One fit's trace from every rank's: micro-batches of the same step and micro index are merged."""
    first = fits[0]
    micro: list[dict[str, Any]] = []
    for entries in zip(*(f["micro"] for f in fits)):
        micro.append({"epoch": entries[0]["epoch"], "step": entries[0]["step"],
                      "ids": [i for e in entries for i in e["ids"]],
                      "sum": sum(e["sum"] for e in entries), "count": sum(e["count"] for e in entries)})
        if "selection" in entries[0]:  # one record per rank, in rank order
            micro[-1]["selection"] = [s for e in entries for s in e["selection"]]
    return {**first, "micro": micro}


def step_losses(fit_trace: dict[str, Any]) -> dict[int, float]:
    """Per optimizer step: the mean over every valid token of the step (all micro-batches and ranks)."""
    sums: dict[int, list[float]] = {}
    for m in fit_trace["micro"]:
        entry = sums.setdefault(m["step"], [0.0, 0])
        entry[0] += m["sum"]
        entry[1] += m["count"]
    return {s: t / max(c, 1) for s, (t, c) in sorted(sums.items())}


def step_samples(fit_trace: dict[str, Any]) -> dict[int, list[int]]:
    """Per optimizer step: the sorted ids of its samples."""
    out: dict[int, list[int]] = {}
    for m in fit_trace["micro"]:
        out.setdefault(m["step"], []).extend(m["ids"])
    return {s: sorted(v) for s, v in sorted(out.items())}


def epoch_samples(micro: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Per epoch: the sorted ids trained (a sample twice appears twice)."""
    out: dict[int, list[int]] = {}
    for m in micro:
        out.setdefault(m["epoch"], []).extend(m["ids"])
    return {e: sorted(v) for e, v in sorted(out.items())}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No Lightning chatter inside (info logs and warnings off: the tests assert, they do not print);
    everything as it was afterwards, so no later test loses the log lines it checks."""
    import logging

    loggers = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_efficient")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
