"""The batch sampler of ``hetero_ddp`` and ``hetero_fsdp``: each global batch sliced among the ranks by their shares.

Every rank draws the same permutation of the dataset from ``seed + epoch``. Global batch ``k`` is
``permutation[k * G : (k + 1) * G]``; rank ``r`` takes the slice after the shares of ranks
``0..r-1`` and splits it into the plan's micro-batches. Share changes are scheduled from a global
batch index onwards (the same on every rank, far enough ahead of any prefetching), so whatever the
shares and however they change, every sample is used exactly once per epoch. An epoch's short last
global batch keeps its own size, shared in proportion to the plan's shares.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from torch.utils.data import Sampler

from lightning_efficient._torch import seeded_permutation
from lightning_efficient.balance.planner import SharePlan, shrunk_capacity, shrunk_plan


class HeterogeneousBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of indices, global batch after global batch.

    Args:
        dataset_size: number of samples.
        global_batch: samples per optimizer step over all ranks.
        rank: this process's rank.
        plan: the initial shares and accumulation.
        seed: seed of the per-epoch permutation.
        shuffle: permute the dataset each epoch (else the identity order).
        drop_last: drop the last incomplete global batch (else train it at its own size, shared in proportion
            to the plan's shares, in as many micro-batches as plain data parallelism's last step has batches, scaled
            as the plan scales a step's; where fewer samples remain than a sample per rank and micro-batch, it is
            completed to that many from the start of the permutation, as ``DistributedSampler`` pads).
        name: the strategy's name, in messages.
        batches_per_step: the DataLoader batches a step of plain data parallelism holds (the user's
            ``accumulate_grad_batches``), which the plan's micro-batches a step may exceed.
        drop_last_batch: the DataLoader's ``drop_last``: of the last incomplete global batch only whole DataLoader
            batches train (``global_batch / (ranks x batches_per_step)`` samples over the ranks), as plain data
            parallelism drops each rank's incomplete last batch and still steps on the whole ones before it.
    """

    def __init__(
        self, dataset_size: int, global_batch: int, rank: int, plan: SharePlan, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False, name: str = "hetero_ddp", batches_per_step: int = 1,
        drop_last_batch: bool = False,
    ) -> None:
        if dataset_size < 1:
            raise ValueError(f"the dataset is empty: {name} needs at least one sample (global batch {global_batch})")
        if drop_last and dataset_size < global_batch:
            raise ValueError(
                f"drop_last=True with {dataset_size} samples and global_batch_size={global_batch}: no full global batch"
            )
        self.name = name
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.batches_per_step = batches_per_step
        self.drop_last_batch = drop_last_batch
        self.epoch = 0
        self.schedule: list[tuple[int, SharePlan]] = [(0, plan)]  # (from global batch index, plan)
        self.next_batch = 0  # global batches of this epoch already handed out
        self.skip_micro = 0  # micro-batches of global batch next_batch trained already (a resume between them)
        if self.batches_per_epoch == 0:
            raise ValueError(f"drop_last=True in the training DataLoader with {dataset_size} samples over {len(plan.shares)} "
                             f"rank(s): no whole batch of {Fraction(global_batch, len(plan.shares) * batches_per_step)} "
                             "samples a rank")

    @property
    def batches_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        full, remaining = divmod(self.dataset_size, self.global_batch)
        if self.drop_last or not remaining:
            return full
        return full + (self._last_step_batches(remaining) >= 1 if self.drop_last_batch else 1)

    def _last_step_batches(self, remaining: int) -> int:
        """The batches each rank's DataLoader makes of ``remaining`` samples under plain data parallelism (every rank's
        part, as ``DistributedSampler`` pads them to the ranks, in batches of G / (ranks x batches_per_step))."""
        world = len(self.schedule[0][1].shares)
        per_rank = Fraction(-(-remaining // world) * world * self.batches_per_step, self.global_batch)
        return math.floor(per_rank) if self.drop_last_batch else math.ceil(per_rank)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` and start it from its first batch (a no-op for the
        epoch already selected, so a position loaded from a checkpoint is kept).

        Lightning does not call this on a batch sampler: the strategy's loader calls it with the
        trainer's epoch each time an epoch's iteration starts.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.next_batch = self.skip_micro = 0
            self.schedule = [(0, self.schedule[-1][1])]

    def plan_at(self, batch_index: int) -> SharePlan:
        """The plan that global batch ``batch_index`` of this epoch is sliced by."""
        position = bisect.bisect_right([start for start, _ in self.schedule], batch_index) - 1
        return self.schedule[position][1]

    def step_layout(self, batch_index: int) -> tuple[int, int]:
        """``(samples, micro-batches a rank)`` of global batch ``batch_index`` of this epoch: the global batch in the
        plan's micro-batches; an epoch's short last batch, what remains, in the plan's micro-batches for the batches
        plain data parallelism's last step holds (a step of ``batches_per_step`` batches is the plan's whole step),
        completed to a sample per rank and micro-batch where fewer remain."""
        plan = self.plan_at(batch_index)
        remaining = self.dataset_size - batch_index * self.global_batch
        if self.drop_last or remaining >= self.global_batch or batch_index >= self.batches_per_epoch:
            return self.global_batch, plan.accumulation
        world = len(plan.shares)
        batches = self._last_step_batches(remaining)
        if self.drop_last_batch:  # whole DataLoader batches only
            remaining = min(remaining, math.floor(Fraction(batches * self.global_batch, self.batches_per_step)))
        # as many micro-batches as the plan makes of those batches, but no more than the ranks can fill without
        # repeating samples (where fewer remain than the ranks, each gets one: DistributedSampler pads so too), unless
        # fewer would hold a micro-batch above the plan's largest on a rank (its cap): then repeats complete them
        most = min(plan.accumulation, math.ceil(Fraction(batches * plan.accumulation, self.batches_per_step)))
        micro = min(most, max(1, remaining // world))
        while micro < most and shrunk_capacity(plan, micro) < max(remaining, world * micro):
            micro += 1
        return max(remaining, world * micro), micro

    def step_samples(self, batch_index: int) -> int:
        """The samples global batch ``batch_index`` of this epoch trains (:meth:`step_layout`)."""
        return self.step_layout(batch_index)[0]

    def step_plan(self, batch_index: int) -> SharePlan:
        """The shares global batch ``batch_index`` of this epoch is sliced by: the plan in force, shrunk in proportion
        for an epoch's short last batch (:meth:`step_layout`)."""
        samples, micro = self.step_layout(batch_index)
        return shrunk_plan(self.plan_at(batch_index), samples, micro)

    def schedule_plan(self, plan: SharePlan, from_batch: int) -> None:
        """Slice global batches from ``from_batch`` on by ``plan`` (it must keep the accumulation)."""
        if plan.accumulation != self.schedule[0][1].accumulation:
            raise ValueError("a new plan must keep the accumulation the run started with")
        self.schedule = [(start, p) for start, p in self.schedule if start < from_batch] + [(from_batch, plan)]

    def permutation(self) -> list[int]:
        """The sample order of the selected epoch (the same on every rank)."""
        return seeded_permutation(self.dataset_size, self.seed + self.epoch, self.shuffle)

    def global_batch_indices(self, batch_index: int, permutation: list[int]) -> list[int]:
        """The sample indices of global batch ``batch_index`` (:meth:`step_samples` of them: completed from the
        permutation's start where fewer remain)."""
        start, size = batch_index * self.global_batch, self.step_samples(batch_index)
        chunk = permutation[start : start + size]
        while len(chunk) < size:
            chunk += permutation[: size - len(chunk)]
        return chunk

    def rank_slice(self, batch_index: int, permutation: list[int], rank: int | None = None) -> list[list[int]]:
        """``rank``'s micro-batches of global batch ``batch_index``."""
        rank = self.rank if rank is None else rank
        plan = self.step_plan(batch_index)
        chunk = self.global_batch_indices(batch_index, permutation)
        offset = sum(plan.shares[:rank])
        mine = chunk[offset : offset + plan.shares[rank]]
        micro, out = plan.micro_batches(rank), []
        for size in micro:
            out.append(mine[:size])
            mine = mine[size:]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        if self.next_batch >= self.batches_per_epoch:  # the epoch selected is done: the next one starts
            self.set_epoch(self.epoch + 1)
        permutation = self.permutation()
        skip, self.skip_micro = self.skip_micro, 0
        while self.next_batch < self.batches_per_epoch:
            batch_index = self.next_batch
            self.next_batch += 1
            yield from self.rank_slice(batch_index, permutation)[skip:]
            skip = 0
        # the epoch stays selected until the next pass starts (above): DataLoader workers fetch indices
        # ahead and finish this generator while the last batches are still to be trained, and a
        # checkpoint taken then must name the epoch being trained

    def __len__(self) -> int:
        steps = self.batches_per_epoch
        return 0 if steps == 0 else (steps - 1) * self.schedule[0][1].accumulation + self.step_layout(steps - 1)[1]

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position (global batches of the epoch handed out), global batch, number of ranks and
        share schedule, for a mid-epoch resume."""
        return {
            "epoch": self.epoch, "next_batch": self.next_batch, "global_batch": self.global_batch,
            "world_size": len(self.schedule[0][1].shares), "dataset_size": self.dataset_size,
            "schedule": [(start, list(p.shares), p.accumulation) for start, p in self.schedule],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken, on the same or another number of ranks.

        The same ranks and global batch: the saved share schedule is restored, so the run continues
        exactly as the uninterrupted one. Another number of ranks: the epoch's remaining global
        batches (the same samples in the same order) are sliced by this sampler's own plan, so each
        remaining sample is trained exactly once. A state taken at the end of its epoch only fixes the
        epoch: the next one starts from its beginning with this sampler's plan.

        Raises:
            ValueError: mid-epoch, when the global batch or the accumulation differs from the saved
                ones (the rest of the epoch would not match the step count Lightning restores).
        """
        schedule = [(int(start), SharePlan(tuple(shares), int(acc))) for start, shares, acc in state["schedule"]]
        saved_plan = schedule[0][1]
        saved_world = int(state.get("world_size", len(saved_plan.shares)))
        saved_global = int(state.get("global_batch", sum(saved_plan.shares)))
        saved_size = int(state.get("dataset_size", self.dataset_size))
        next_batch = int(state["next_batch"])
        self.skip_micro = 0
        if (saved_size, saved_global) == (self.dataset_size, self.global_batch):
            saved_batches = self.batches_per_epoch
        elif self.drop_last:
            saved_batches = saved_size // saved_global
        else:
            saved_batches = math.ceil(saved_size / saved_global)
        self.epoch = int(state["epoch"])
        current = self.schedule[-1][1]
        same_layout = (saved_world == len(current.shares) and saved_global == self.global_batch
                       and saved_plan.accumulation == current.accumulation)
        next_micro = int(state.get("next_micro", 0))
        if next_batch >= saved_batches or (next_batch == 0 and next_micro == 0):  # at an epoch boundary: nothing to re-slice
            self.next_batch = self.batches_per_epoch if next_batch else 0
            self.schedule = schedule if same_layout else [(0, current)]
            return
        samples = f"{next_batch * saved_global} of {saved_size} samples of epoch {self.epoch} trained"
        if saved_size != self.dataset_size:
            raise ValueError(
                f"{self.name}: the checkpoint was taken mid-epoch ({samples}) on a dataset of {saved_size} samples; "
                f"this run's has {self.dataset_size}: resume from an end-of-epoch checkpoint"
            )
        if saved_global != self.global_batch:
            raise ValueError(
                f"{self.name}: the checkpoint was taken mid-epoch ({samples}) with a global batch of {saved_global} "
                f"on {saved_world} rank(s); this run's global batch is {self.global_batch}: the rest of the epoch "
                f"cannot be re-planned to another global batch (Lightning restores the epoch's step count). Resume "
                f"with global_batch_size={saved_global} (global_batch_size=None means the DataLoader's batch size "
                f"x ranks x accumulate_grad_batches), or from an end-of-epoch checkpoint"
            )
        if saved_plan.accumulation != current.accumulation:
            raise ValueError(
                f"{self.name}: the checkpoint was taken mid-epoch ({samples}) with {saved_plan.accumulation} "
                f"micro-batch(es) per step; on {len(current.shares)} rank(s) this run's plan needs "
                f"{current.accumulation} (shares {list(current.shares)}, set by max_micro_batch or "
                f"accumulate_grad_batches): resume with settings that keep {saved_plan.accumulation}, or from an "
                f"end-of-epoch checkpoint"
            )
        self.next_batch = next_batch
        # taken between a step's micro-batches (a validation or a time-based checkpoint there): the run goes on at
        # the next micro-batch, where Lightning's count of batches goes on (the gradients of the step's earlier ones
        # are not in a checkpoint, as under plain Lightning with a resumable DataLoader)
        self.skip_micro = min(next_micro, current.accumulation - 1)
        self.schedule = schedule if same_layout else [(0, current)]
