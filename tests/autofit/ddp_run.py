"""Run by test_distributed.py: AutoFit on 2 gloo CPU processes. Usage: ``python ddp_run.py OUT_DIR MODE [MODE ...]``.

The launching process (which imports neither torch nor Lightning) starts two processes (rank, world
size and a free port in their environment, so every Trainer in them joins one process group); each
runs one short plain fit (what a process allocates once), then the modes given in turn, and writes
OUT_DIR/rank<r>.json after every mode (so a later failure leaves the earlier results). Modes are the
strategies: ``ddp``, ``hetero_ddp`` (shares 1:1), ``fsdp2`` (``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1)``, ``fully_shard`` per block and on the root) and ``hetero_fsdp`` (shares 1:1).
Each runs, on a tiny demo GPT (4 optimizer steps of a global batch of 16, 2 epochs of 32 rows):

1. ``infeasible``: AutoFit with budget ``[512 MiB, 64 KiB]``: the error fit raises on each rank (before
   any batch), and what AutoFit measured (its profiles, set before the search refuses);
2. from rank 1's profile there, rank 1's budget for the next fit: what the leanest block policies
   need at micro-batch 4 (so rank 1 can run at most about 4 samples at once, rank 0 up to the whole batch);
3. ``autofit``: AutoFit with budget ``[512 MiB, that]``: the plan as applied and at the end, each rank's
   settings during the fit (micro-batch, accumulation or caps, its ActivationMemory policies, the
   optimizer class) and after it, every micro-batch's size and loss, AutoFit's measured figures (after 2 steps; under
   ``ddp`` and ``fsdp2`` also a checkpoint at the end of epoch 0);
4. ``reference``: a plain Lightning fit of the same strategy with the plan's settings set by hand
   (micro-batch and accumulation, or the caps; ``ActivationMemory(policy=[...])`` of this rank's
   policies; ``EightBitOptimizer(bits=8)`` when the plan chose 8-bit states; ``StepTokenMean()`` where it
   splits the batch): each micro-batch's loss;
5. ``resumed`` (``ddp`` and ``fsdp2``): a fresh AutoFit with the same settings resumed from the epoch-0
   checkpoint (its profiles, plan, settings, info lines, Lightning's warnings of checkpointed callbacks
   missing, and losses), and the plain fit resumed the same way; under ``ddp`` also ``resumed_unread``, the same
   resume where rank 1 read no AutoFit state (its profiles, plan, micro-batches, settings and info lines), and
   ``resumed_own_budget``, the same resume where rank 1 sets another budget (its profiles, micro-batches, lines);
6. ``measured_resume`` (``fsdp2`` only): as 5. with another margin and only the other optimizer states (32-bit
   after an 8-bit plan, 8-bit after a 32-bit one), so that AutoFit measures again (before ModelParallelStrategy
   loads the checkpoint) and the states are converted as they load, and the plain fit resumed with that plan set by
   hand (``EightBitOptimizer(bits=32)`` dequantizing an 8-bit checkpoint);
7. ``resumed_32bit_only`` (``ddp`` and ``fsdp2``; under FSDP2 from a distributed checkpoint recording no
   settings, as older ones, and from a full-state file): a plain fit with ``EightBitOptimizer(min_8bit_size=1024)``
   and a checkpoint at the end of epoch 0, resumed by an AutoFit that may pick 32-bit states only (micro-batch not
   searched) and by plain Lightning with ``EightBitOptimizer(bits=32, min_8bit_size=1024)``: the plan, each
   micro-batch's loss, the optimizer's class; under FSDP2 also ``resumed_8bit_other_settings``, the distributed one
   resumed by ``EightBitOptimizer()`` (min_8bit_size 4096): the error and the micro-batches trained.

Mode ``replan`` (DDP): a measured peak above the prediction on one rank (see :func:`run_replan`). Mode
``out_of_memory`` (DDP and hetero_ddp): rank 1's device runs out of memory above 3 samples (see
:func:`run_out_of_memory`). Mode ``estimated_steps`` (DDP and hetero_ddp): the DataLoader built while the optimizers
are configured (see :func:`run_estimated_steps`).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
import time
import traceback
import warnings
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any


def launch(out: str, modes: list[str]) -> None:
    """Start rank 0 and rank 1 (this script again, with the rank in its environment) and wait for both."""
    from tests.ddp import launch_ranks

    codes = launch_ranks(__file__, out, *modes, timeout=540, env={"OMP_NUM_THREADS": "1"})
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__" and "LOCAL_RANK" not in os.environ:
    launch(sys.argv[1], sys.argv[2:])  # the launching process imports neither torch nor Lightning: seconds saved
    sys.exit(0)

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_efficient import ActivationMemory, DemoGPT, EightBitOptimizer, HeterogeneousDDPStrategy, StepTokenMean
from lightning_efficient._step import first_samples_batch
from lightning_efficient.activations.discovery import find_blocks
from lightning_efficient.autofit import AutoFit, BudgetTooSmall, FitPlan, RankProfile
from lightning_efficient.autofit.measure import measure_blocks
from lightning_efficient.autofit.model import _leanest, _predict, _scaled
from lightning_efficient.balance.fsdp import HeterogeneousFSDPStrategy
from lightning_efficient.memory import ParameterStorages
from lightning_efficient.optim.twins import eight_bit_classes

VOCAB, SEQ, ROWS = 8192, 32, 32  # a large vocabulary: the logits make the memory grow with the micro-batch
KWARGS = {"vocab_size": VOCAB, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": SEQ}
GLOBAL_BATCH, LOADER_BATCH, ACCUMULATE, STEPS = 16, 4, 2, 4  # uniform: 2 ranks x 4 samples x 2 micro-steps
BIG = 512 * 2**20
POLICIES = ["keep", "selective", "checkpoint"]
# the blocks hold most activations: several MiB each at micro-batch 8, far above the readings' noise
REPLAN_MODEL = {"vocab_size": 512, "n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": SEQ}
RESUMED = ("ddp", "fsdp2")  # the modes also resumed from a checkpoint (a file under DDP, a directory under FSDP2)
MIN_8BIT_SIZE = 1024  # step 7's 8-bit fit: the attention's 3,072-element weights 8-bit too (AutoFit's 4,096 keeps them 32-bit)
TIMEOUT = timedelta(seconds=90)  # a rank left alone in a collective fails instead of hanging


class Rows(Dataset):
    """``ROWS`` reproducible rows of ``SEQ`` token ids and labels below ``vocab``."""

    def __init__(self, vocab: int = VOCAB) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids, labels = (torch.randint(0, self.vocab, (SEQ,), generator=g) for _ in range(2))
        return {"input_ids": ids, "labels": labels}


class Tiny(DemoGPT):
    """The demo GPT with a ``batch_size`` its DataLoader reads (which AutoFit sets), sharded with
    ``fully_shard`` per block and on the root under FSDP2."""

    def __init__(self, batch_size: int = LOADER_BATCH, sharded: bool = False, model: dict | None = None) -> None:
        torch.manual_seed(0)
        super().__init__(**(model or KWARGS), warmup_steps=0, learning_rate=1e-2)
        self.batch_size = batch_size
        self.sharded = sharded

    def configure_model(self) -> None:
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Rows(self.hparams.vocab_size), batch_size=self.batch_size)


class Record(lightning.Callback):
    """Each micro-batch's optimizer step, size and loss; the settings in force when training starts;
    AutoFit's info lines and warnings (set by :func:`fit`)."""

    def __init__(self) -> None:
        self.micro: list[list[Any]] = []
        self.during: dict[str, Any] = {}
        self.lines: list[str] = []  # AutoFit's info lines (rank 0) and warnings
        self.missing: list[str] = []  # callbacks the checkpoint holds state for that are not there (Lightning's warning)

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        memory = [c for c in trainer.callbacks if isinstance(c, ActivationMemory)]
        planner = [c for c in trainer.callbacks if isinstance(c, AutoFit)]
        self.during = {
            "plan": planner[0].plan.to_dict() if planner else None,  # as applied (a re-plan may change it later)
            "batch_size": pl_module.batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "caps": list(strategy.micro_batch_caps) if hasattr(strategy, "balancer") else None,
            "max_micro_batch": getattr(strategy, "max_micro_batch", None),
            "policies": memory[0].plan if memory else None,
            "eight_bit": [isinstance(o, eight_bit_classes()) for o in trainer.optimizers],
        }

    def on_train_end(self, trainer, pl_module):
        memory = [c for c in trainer.callbacks if isinstance(c, ActivationMemory)]
        self.during["policies_at_end"] = memory[0].plan if memory else None  # after any re-plan

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.micro.append([trainer.global_step, len(batch["input_ids"])])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.micro[-1].append(float(outputs["loss"]))


class Hog(lightning.Callback):
    """Holds ``nbytes`` more on rank ``rank`` during every micro-step: memory AutoFit did not see when it measured."""

    def __init__(self, rank: int, nbytes: int) -> None:
        self.rank, self.nbytes, self.held = rank, nbytes, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank:
            self.held = torch.ones(self.nbytes // 4)  # written: resident

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.held = None


class AimedHog(Hog):
    """A :class:`Hog` sized when training starts, from AutoFit's plan: the re-plan's wider margin (the plan's plus the
    hold over the budget) then lands three quarters of the way from what keeping every block to what the leanest block
    policies are predicted to need on its rank, where a few % of the budget of noise in the readings moves it across
    neither (the readings take part of the hold only)."""

    def __init__(self, rank: int, fitter: AutoFit) -> None:
        super().__init__(rank, 0)
        self.fitter = fitter

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank != self.rank:
            return
        plan, profile = self.fitter.plan, self.fitter.profiles[self.rank]
        if not profile.blocks:  # AutoFit left them unprofiled (every block kept fits): profiled here, as it would
            exclude = ParameterStorages(pl_module).track()
            try:
                blocks = measure_blocks(trainer.strategy, lambda size: first_samples_batch(trainer.strategy, trainer.train_dataloader, size),
                                        profile.sizes[0], blocks=find_blocks(pl_module), exclude=exclude, policies=tuple(POLICIES))
            finally:
                exclude.stop()
            profile = replace(profile, blocks=blocks, blocks_size=profile.sizes[0])
        mine, budget = plan.ranks[self.rank], plan.budgets[self.rank]
        option = next(o for o in profile.options if o.name == plan.optimizer)
        lean = _leanest(profile, mine.micro_batch, option, tuple(POLICIES)).peak_bytes
        # (three quarters of the way to the leanest: a CI run read the hold as 4.2% of the budget where half way needed
        # 5.5%, the process's peak taking part of it from memory freed before; the leanest still fits the widened margin
        # were it read in full)
        aimed = (mine.peak_bytes + 3 * lean) / 4
        self.nbytes = max(0, int(budget * (1 - plan.margin) - aimed))


class Lines(logging.Handler):
    """Lightning's info lines (``rank_zero_info``: on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LINES = Lines()


def strategy_for(mode: str, caps: list[int] | None = None, distributed_checkpoint: bool = True) -> Any:
    common = {"process_group_backend": "gloo", "timeout": TIMEOUT}
    if mode == "ddp":
        return DDPStrategy(**common)
    if mode == "hetero_ddp":
        return HeterogeneousDDPStrategy(global_batch_size=GLOBAL_BATCH, shares=[1.0, 1.0], max_micro_batch=caps, **common)
    if mode == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     save_distributed_checkpoint=distributed_checkpoint, **common)
    assert mode == "hetero_fsdp", mode
    return HeterogeneousFSDPStrategy(global_batch_size=GLOBAL_BATCH, shares=[1.0, 1.0], max_micro_batch=caps, **common)


def heterogeneous(mode: str) -> bool:
    return mode.startswith("hetero")


def fit(mode: str, callbacks: list, *, batch_size: int = LOADER_BATCH, accumulate: int | None = None, caps=None,
        ckpt_dir: Path | None = None, ckpt_path: Path | None = None, model: dict | None = None, steps: int = STEPS,
        distributed_checkpoint: bool = True, module_class: type = Tiny,
        max_epochs: int | None = None) -> tuple[lightning.Trainer, Tiny, Record, Exception | None]:
    """One fit of ``mode``; a ValueError it raised is returned, not raised (a plan-only fit returns normally)."""
    record = Record()
    if ckpt_dir is not None:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=ckpt_dir, filename="epoch{epoch}", auto_insert_metric_name=False,
                                                 every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)]
    if accumulate is None:
        accumulate = 1 if heterogeneous(mode) else ACCUMULATE
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=strategy_for(mode, caps, distributed_checkpoint), max_steps=steps,
        max_epochs=max_epochs, logger=False,
        enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, accumulate_grad_batches=accumulate, callbacks=[*callbacks, record],
    )
    module = module_class(batch_size, sharded="fsdp" in mode, model=model)
    start = len(LINES.lines)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, ckpt_path=ckpt_path)
        except ValueError as raised:
            error = raised
    record.lines = [line for line in LINES.lines[start:] + [str(w.message) for w in caught] if "AutoFit" in line]
    record.missing = [key for w in caught if "callbacks used to create the checkpoint" in str(w.message)
                      for key in ast.literal_eval(str(w.message).split("following callbacks: ", 1)[1].rstrip("."))
                      if not key.startswith("ModelCheckpoint")]  # a resumed fit saves no checkpoints of its own
    return trainer, module, record, error


def autofit(budget: list[int]) -> AutoFit:
    # measured after 2 steps: before the end-of-epoch checkpoint is written (what writing one holds, a distributed
    # checkpoint's in particular, is not what AutoFit plans for)
    return AutoFit(budget=budget, activation_policies=POLICIES, optimizer_options=["32-bit", "8-bit"], report_after_steps=2)


def unread_on_rank_one(budget: list[int]) -> AutoFit:
    """:func:`autofit`, whose rank 1 forgets the state a checkpoint gives it (as where its node could not read the
    file's callback states)."""

    class UnreadOnRankOne(AutoFit):
        @property
        @override
        def state_key(self) -> str:
            return "AutoFit"  # the checkpointed AutoFit's: Lightning hands this one its state

        @override
        def on_load_checkpoint(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                               checkpoint: dict[str, Any]) -> None:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
            if int(os.environ["RANK"]) == 1:
                self._restored = None

        @override
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            if int(os.environ["RANK"]) == 1:
                self._restored = None

    return UnreadOnRankOne(budget=budget, activation_policies=POLICIES, optimizer_options=["32-bit", "8-bit"], report_after_steps=2)


class SettingsUnrecorded(EightBitOptimizer):
    """:class:`EightBitOptimizer` saving the state its checkpoints held before they recorded which parameters were
    8-bit (``min_8bit_size``, ``keep_32bit``, ``embeddings_32bit``)."""

    @property
    @override
    def state_key(self) -> str:
        return "EightBitOptimizer"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k not in ("min_8bit_size", "keep_32bit", "embeddings_32bit")}


def rank_one_budget(profiles: list[RankProfile], margin: float) -> int:
    """Rank 1's budget: 1.3x what its leanest block policies are predicted to need at micro-batch 4 (32-bit states)."""
    profile = profiles[1]
    option = next(o for o in profile.options if o.name == "32-bit")
    # 30% above the edge: what a fit holds beyond the measured steps (gloo's buffers, the loop's first allocations)
    # is a few MiB, which at these sizes is what the margin leaves
    return int(_leanest(profile, 4, option, tuple(POLICIES)).peak_bytes / (1.0 - margin) * 1.3) + 1


def keep_all_budget(profiles: list[RankProfile], margin: float) -> int:
    """A budget (the same for every rank) 5% above what keeping every block at micro-batch 8 is predicted to need."""
    needed = []
    for profile in profiles:
        option = next(o for o in profile.options if o.name == "32-bit")
        blocks = _scaled(profile.blocks, 8 / profile.blocks_size)
        needed.append(_predict(profile, blocks, ["keep"] * len(blocks), 8, option)[0])
    return int(max(needed) / (1.0 - margin) * 1.05)


def run_replan(rank: int) -> dict[str, Any]:
    """DDP, a model whose blocks hold most of the activations, a budget where every block is kept at the
    largest micro-batch, and rank 1 holding more than AutoFit measured during each micro-step: after 3 steps the
    measured peak is above the prediction, and AutoFit plans the block policies again.

    The budget comes from a first fit's measurements, the prediction from the second fit's, which read up to
    ~9% of the budget lower at these sizes (a few MiB). A fixed hold (15% of the budget) left the widened
    margin now and then on the wrong side of keeping every block; :class:`AimedHog` sizes the hold from the
    second fit's own plan, so the widened margin falls three quarters of the way from keeping every block to the leanest."""
    probe = AutoFit(budget=[BIG, BIG], activation_policies=POLICIES, optimizer_options=["32-bit"], plan_only=True)
    _, _, _, error = fit("ddp", [probe], model=REPLAN_MODEL)
    assert error is None, error
    budget = keep_all_budget(probe.profiles, probe.margin)
    callback = AutoFit(budget=[budget, budget], activation_policies=POLICIES, optimizer_options=["32-bit"])
    _, _, record, error = fit("ddp", [callback, AimedHog(1, callback)], model=REPLAN_MODEL)
    if error is not None:
        raise error
    return {"budget": budget, "applied": record.during["plan"], "plan": callback.plan.to_dict(), "measured": callback.measured,
            "policies": record.during["policies"], "policies_at_end": record.during["policies_at_end"], "lines": record.lines}


def small_device(holds: int, ranks: tuple[int, ...] = (1,)) -> type:
    """:class:`Tiny` whose rank 1 (each rank of ``ranks``) holds at most ``holds`` samples a micro-step: its last block
    raises the error a CUDA device raises when it runs out of memory on more; every forward costs 20 ms more (a launch
    overhead: the larger micro-batches are clearly the faster a sample, so the search reaches beyond the sizes
    measured)."""

    def run_out(block, inputs, output):
        if torch.distributed.get_rank() in ranks and output.shape[0] > holds:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {output.shape[0]} samples' activations")

    class SmallDevice(Tiny):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.blocks[-1].register_forward_hook(run_out)

        @override
        def forward(self, input_ids, *args, **kwargs):
            time.sleep(0.02)
            return super().forward(input_ids, *args, **kwargs)

    return SmallDevice


def run_out_of_memory(rank: int) -> dict[str, Any]:
    """AutoFit with a large budget where rank 1's device runs out of memory: under ``ddp`` above 5 samples (the sizes
    measured, 2 and 4, fit; the pick beyond them, 8, runs out on rank 1 only when read), under ``hetero_ddp`` above 3
    (the second size measured, 4, runs out): each rank's profile, the plan, the micro-batches each rank trained."""
    found = {}
    for mode, holds in (("ddp", 5), ("hetero_ddp", 3)):
        callback = AutoFit(budget=[BIG, BIG], activation_policies=["keep"], optimizer_options=["32-bit"])
        _, _, record, error = fit(mode, [callback], module_class=small_device(holds))
        if error is not None:
            raise error
        found[mode] = {"out_of_memory_at": [p.out_of_memory_at for p in callback.profiles], "plan": callback.plan.to_dict(),
                       "micro": record.micro}
    return found


def run_estimated_steps(rank: int) -> dict[str, Any]:
    """A ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (a OneCycleLR's total steps; with
    ``max_epochs`` set it builds the training DataLoader, before AutoFit plans) under ``ddp`` (the plan's micro-batch,
    8 at a large budget where a forward's launch overhead makes the larger micro-batches the faster a sample, against
    the DataLoader's 4) and ``hetero_ddp`` (rank 1's device runs out of memory above 3
    samples: its cap from the plan, where the shares alone would give it 8): the plan, each rank's micro-batches and
    the total steps the scheduler was given."""
    found = {}
    # under ddp no rank runs out (8 samples a rank a step at most); the 20 ms a forward costs makes 8 the pick on any
    # CPU, where on Tiny alone the fastest per sample was at times the DataLoader's own 4 (the test then proved nothing)
    for mode, holds in (("ddp", GLOBAL_BATCH // 2), ("hetero_ddp", 3)):
        base = small_device(holds)

        class OneCycle(base):  # type: ignore[misc, valid-type]
            def configure_optimizers(self):
                optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
                self.total_steps = self.trainer.estimated_stepping_batches
                scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=self.total_steps)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        callback = AutoFit(budget=[BIG, BIG], activation_policies=["keep"], optimizer_options=["32-bit"])
        _, module, record, error = fit(mode, [callback], module_class=OneCycle, max_epochs=1)
        if error is not None:
            raise error
        found[mode] = {"plan": callback.plan.to_dict(), "micro": record.micro, "total_steps": module.total_steps}
    # hetero_ddp with accumulate_grad_batches=2 (a new user's config) where both ranks hold at most 3 samples: the caps
    # AutoFit plans hold 2 micro-batches of each rank's share away from the global batch, and the strategy takes more
    callback = AutoFit(budget=[BIG, BIG], activation_policies=["keep"], optimizer_options=["32-bit"])
    trainer, _, record, error = fit("hetero_ddp", [callback], module_class=small_device(3, ranks=(0, 1)),
                                    accumulate=ACCUMULATE)
    if error is not None:
        raise error
    found["hetero_ddp_accumulating"] = {"plan": callback.plan.to_dict(), "micro": record.micro, "during": record.during,
                                        "accumulation_after": trainer.accumulate_grad_batches}
    # a cap the user set on rank 0 only (a new user's trial: AutoFit replaced [2, None] and trained rank 0 at 12)
    callback = AutoFit(budget=[BIG, BIG], activation_policies=["keep"], optimizer_options=["32-bit"])
    trainer, _, record, error = fit("hetero_ddp", [callback], caps=[2, None])
    if error is not None:
        raise error
    found["hetero_ddp_users_caps"] = {"plan": callback.plan.to_dict(), "micro": record.micro,
                                      "caps_after": trainer.strategy.max_micro_batch}
    return found


def by_hand(plan: FitPlan, rank: int, min_8bit_size: int, resumed_from: FitPlan | None = None) -> list:
    """The callbacks that set ``plan``'s block policies (this rank's) and optimizer states by hand, and where it splits
    the batch (more micro-steps than ``ACCUMULATE``), ``StepTokenMean`` (as ``lightning-efficient plan`` prints it: the
    step's token mean AutoFit keeps);
    resumed from a checkpoint of ``resumed_from`` with 8-bit states into a 32-bit plan, the states dequantized as they
    load."""
    # (without StepTokenMean: FSDP2 resumed from the end of epoch 0 at micro-batch 2 x 4, where Lightning trains one
    # micro-batch as a step of its own, plain Lightning weighs it 1/4 and AutoFit as the mean of its tokens; a plan of
    # 2 x 4 came with a busy machine's timings)
    callbacks: list = [StepTokenMean()] if (plan.accumulation or 0) > ACCUMULATE else []
    mine = plan.ranks[rank]
    if any(p != "keep" for p in mine.policies):
        callbacks.append(ActivationMemory(policy=list(mine.policies)))
    if plan.optimizer == "8-bit":
        callbacks.append(EightBitOptimizer(bits=8, min_8bit_size=min_8bit_size))
    elif resumed_from is not None and resumed_from.optimizer == "8-bit":
        callbacks.append(EightBitOptimizer(bits=32, min_8bit_size=min_8bit_size))
    return callbacks


def settings_by_hand(mode: str, plan: FitPlan, rank: int) -> dict[str, Any]:
    """The micro-batch and accumulation (or the caps under hetero) of ``plan``, for :func:`fit`."""
    if heterogeneous(mode):
        return {"caps": plan.micro_batches}
    return {"batch_size": plan.ranks[rank].micro_batch, "accumulate": plan.accumulation}


def run_mode(mode: str, out: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    tiny = 64 * 2**10  # far below anything a step needs
    # 1. rank 1 cannot fit: every rank raises, before any batch
    callback = autofit([BIG, tiny])
    trainer, module, record, error = fit(mode, [callback])
    result["infeasible"] = {
        "error": None if error is None else f"{type(error).__name__}: {error}", "budget_too_small": isinstance(error, BudgetTooSmall),
        "profiles": len(callback.profiles), "batches": len(record.micro), "batch_size_after": module.batch_size,
        "measured_lines": [(p.sizes, p.peak_bytes, p.step_s) for p in callback.profiles],
        "max_micro_batch_after": getattr(trainer.strategy, "max_micro_batch", None),
    }
    profiles = callback.profiles
    # 2. rank 1's budget from what it measured
    budget = [BIG, rank_one_budget(profiles, callback.margin)]
    result["budget"] = budget
    # 3. AutoFit
    callback = autofit(budget)
    trainer, module, record, error = fit(mode, [callback], ckpt_dir=out / "ckpt" if mode in RESUMED else None)
    if error is not None:
        raise error
    strategy = trainer.strategy
    plan = callback.plan
    result["autofit"] = {
        "plan": plan.to_dict(), "profiles": len(callback.profiles), "measured": callback.measured, "micro": record.micro,
        "measured_lines": [(p.sizes, p.peak_bytes, p.step_s) for p in callback.profiles],
        "during": record.during, "lines": record.lines,
        "after": {"batch_size": module.batch_size, "accumulate_grad_batches": trainer.accumulate_grad_batches,
                  "max_micro_batch": getattr(strategy, "max_micro_batch", None)},
    }
    # 4. the same fit in plain Lightning with the settings of the plan as applied (before any re-plan) set by hand
    plan = FitPlan.from_dict(record.during["plan"])
    _, _, reference, error = fit(mode, by_hand(plan, rank, callback.min_8bit_size), ckpt_dir=out / "ckpt_ref" if mode in RESUMED else None,
                                 **settings_by_hand(mode, plan, rank))
    if error is not None:
        raise error
    result["reference"] = {"micro": reference.micro, "during": reference.during}
    # 5. resumed from the end of epoch 0 with the same settings: the plan comes from the checkpoint; and
    # the plain fit resumed the same way
    if mode in RESUMED:
        callback = autofit(budget)
        _, _, resumed, error = fit(mode, [callback], ckpt_path=out / "ckpt" / "epoch0.ckpt")
        if error is not None:
            raise error
        _, _, reference_resumed, error = fit(mode, by_hand(plan, rank, callback.min_8bit_size),
                                             ckpt_path=out / "ckpt_ref" / "epoch0.ckpt", **settings_by_hand(mode, plan, rank))
        if error is not None:
            raise error
        result["resumed"] = {"profiles": len(callback.profiles), "plan": callback.plan.to_dict(), "micro": resumed.micro,
                             "lines": resumed.lines, "missing": resumed.missing, "during": resumed.during,
                             "reference_micro": reference_resumed.micro}
    # 5b. (``ddp``) resumed where rank 1 read no AutoFit state from the checkpoint (its node could not read the file's
    # callback states): rank 0's state goes on on every rank (the plan reused on both), and the fit trains to its end
    if mode == "ddp":
        callback = unread_on_rank_one(budget)
        _, _, resumed, error = fit(mode, [callback], ckpt_path=out / "ckpt" / "epoch0.ckpt")
        # an error (the ranks deciding apart: a collective's timeout) fails its own test, not every test of the run
        result["resumed_unread"] = {"error": repr(error)} if error is not None else {
            "error": None, "profiles": len(callback.profiles), "plan": callback.plan.to_dict(), "micro": resumed.micro,
            "lines": resumed.lines, "during": resumed.during}
    # 5c. (``ddp``) resumed where rank 1 sets another budget for itself (rank 0's settings are the checkpoint's): the
    # plan is reusable on rank 0 alone, so every rank plans again, and the fit trains to its end
    if mode == "ddp":
        callback = autofit(budget if rank == 0 else [budget[0], budget[1] + 2**20])
        _, _, resumed, error = fit(mode, [callback], ckpt_path=out / "ckpt" / "epoch0.ckpt")
        result["resumed_own_budget"] = {"error": repr(error)} if error is not None else {
            "error": None, "profiles": len(callback.profiles), "micro": resumed.micro, "lines": resumed.lines}
    # 6. (``fsdp2``) resumed with another margin and the other optimizer states only: AutoFit measures again, before
    # the checkpoint is loaded, and the states are converted shard by shard as they load; and the plain fit resumed
    # the same way with that plan set by hand
    if mode == "fsdp2":
        other = ["32-bit"] if plan.optimizer == "8-bit" else ["8-bit"]
        callback = AutoFit(budget=budget, margin=0.15, activation_policies=POLICIES, optimizer_options=other,
                           report_after_steps=2)
        _, _, resumed, error = fit(mode, [callback], ckpt_path=out / "ckpt" / "epoch0.ckpt")
        if error is not None:
            raise error
        again = callback.plan
        _, _, reference_resumed, error = fit(mode, by_hand(again, rank, callback.min_8bit_size, resumed_from=plan),
                                             ckpt_path=out / "ckpt_ref" / "epoch0.ckpt", **settings_by_hand(mode, again, rank))
        if error is not None:
            raise error
        result["measured_resume"] = {"profiles": len(callback.profiles), "plan": again.to_dict(), "micro": resumed.micro,
                                     "reference_micro": reference_resumed.micro, "checkpointed_optimizer": plan.optimizer,
                                     "eight_bit": resumed.during["eight_bit"]}
    # 7. (``ddp`` and ``fsdp2``) a plain 8-bit fit with another min_8bit_size than AutoFit's, resumed by an AutoFit
    # that may pick 32-bit states only (the micro-batch kept): the states are dequantized as they load; and the plain
    # fit resumed with EightBitOptimizer(bits=32) given the saving run's min_8bit_size. Under FSDP2 twice: from a
    # distributed checkpoint whose EightBitOptimizer state records no settings (as before they were recorded: which
    # parameters were 8-bit read from its keys), and from a full-state file (read from the settings it records)
    if mode in RESUMED:
        result["resumed_32bit_only"] = {}
        for variant in ("distributed", "full-state file") if mode == "fsdp2" else ("file",):
            where, distributed = out / f"ckpt8-{variant.split()[0]}", variant == "distributed"
            saving = (SettingsUnrecorded if distributed else EightBitOptimizer)(min_8bit_size=MIN_8BIT_SIZE)
            _, _, _, error = fit(mode, [saving], ckpt_dir=where, distributed_checkpoint=distributed)
            if error is not None:
                raise error
            callback = AutoFit(budget=[BIG, BIG], activation_policies=["keep"], optimizer_options=["32-bit"],
                               search_micro_batch=False)
            _, _, resumed, error = fit(mode, [callback], ckpt_path=where / "epoch0.ckpt", distributed_checkpoint=distributed)
            if error is not None:
                raise error
            # the saving run's settings given by hand: which parameters were 8-bit is then known, not read
            _, _, reference_resumed, error = fit(mode, [EightBitOptimizer(bits=32, min_8bit_size=MIN_8BIT_SIZE)],
                                                 ckpt_path=where / "epoch0.ckpt", distributed_checkpoint=distributed)
            if error is not None:
                raise error
            result["resumed_32bit_only"][variant] = {"plan": callback.plan.to_dict(), "micro": resumed.micro,
                                                     "eight_bit": resumed.during["eight_bit"],
                                                     "reference_micro": reference_resumed.micro}
        if mode == "fsdp2":
            # resumed 8-bit with AutoFit's (the default) min_8bit_size: the attention's weights were 8-bit, 32-bit now;
            # refused before anything loads (their 8-bit codes landed in the 32-bit states, silently)
            _, _, record, error = fit(mode, [EightBitOptimizer()], ckpt_path=out / "ckpt8-distributed" / "epoch0.ckpt")
            result["resumed_8bit_other_settings"] = {"error": None if error is None else str(error), "micro": record.micro}
    return result


def main(out: Path, modes: list[str], rank: int) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").addHandler(LINES)
    torch.set_num_threads(1)
    # a first fit in the process allocates for good what later ones reuse (thread pools, gloo, lazy
    # initialisation): without it the first AutoFit here would measure it, not what its fit holds
    fit("ddp", [], steps=1)
    results: dict[str, Any] = {}
    for mode in modes:
        started = time.perf_counter()
        try:
            extra = {"replan": run_replan, "out_of_memory": run_out_of_memory, "estimated_steps": run_estimated_steps}
            results[mode] = extra[mode](rank) if mode in extra else run_mode(mode, out / mode, rank)
        except Exception as error:  # noqa: BLE001 - reported against the mode by the test
            results[mode] = {"error": "".join(traceback.format_exception(error))[-3000:]}
        results[mode]["seconds"] = time.perf_counter() - started
        (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:], int(os.environ["LOCAL_RANK"]))
