"""AutoFit's plan before the first step: what it may choose (micro-batches, block policies, optimizer-state
options), the readings it takes, and the search, confirmed by reading the pick."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_hasattr

from lightning_efficient._validation import refuse_unless, require
from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.activations.discovery import find_blocks, transformers_checkpointing
from lightning_efficient.autofit.budget import check_budget_ranks, rank_budget
from lightning_efficient.autofit.fit_inputs import (
    loader_batch_size,
    users_loader,
)
from lightning_efficient.autofit.measure import (
    OptimizerSpec,
    can_resize,
)
from lightning_efficient.autofit.model import (
    BudgetTooSmall,
    FitPlan,
    RankProfile,
    blocks_matter,
    divisors,
    search,
)
from lightning_efficient.autofit.notes import NOT_PROFILED, _allocator_notes
from lightning_efficient.autofit.readings import (
    _measuring_batches,
    _ran_out,
    _size_to_read,
    _Unprofiled,
    _unread,
)
from lightning_efficient.autofit.token_mean import is_heterogeneous
from lightning_efficient.memory import is_fsdp2
from lightning_efficient.optim.callback import EightBitOptimizer
from lightning_efficient.optim.sharded import has_sharded_params
from lightning_efficient.optim.twins import eight_bit_classes, find_twin, is_stateless, paged_refusal

CONFIRM_ROUNDS = 3
"""Readings of picks beyond the measured micro-batch sizes, at most, each time the pick is checked (after the search,
and again after the pick's block policies were priced up)."""


_CUDA_ONLY = ("8-bit paged", "8-bit offload")


def _ladder(candidates: list[int], below: int, most: int = 3) -> tuple[int, ...]:
    """Up to ``most`` of ``candidates`` under ``below``, geometrically spaced (each at most half the one above it).
    One is among them where it is near enough: it is left out when measured where the model cannot train on one sample
    or the ranks run in step (see :func:`~lightning_efficient.autofit.measure.measure_rank`)."""
    chosen: list[int] = []
    limit = below // 2
    while len(chosen) < most:
        fitting = [m for m in candidates if 1 <= m <= limit]
        if not fitting:
            break
        chosen.append(max(fitting))
        limit = chosen[-1] // 2
    return tuple(sorted(chosen))


def _cannot_build(name: str, optimizers: list[torch.optim.Optimizer]) -> str | None:
    """Why the optimizer option ``name`` cannot hold these optimizers' states (None: it can)."""
    for index, optimizer in enumerate(optimizers):
        if isinstance(optimizer, eight_bit_classes()) or is_stateless(optimizer):
            continue
        if find_twin(optimizer) is None:
            return f"optimizer {index} ({type(optimizer).__name__}) has no bitsandbytes 8-bit twin"
        if name == "8-bit paged" and paged_refusal(optimizer):
            return f"optimizer {index}: {paged_refusal(optimizer)}"
        if name == "8-bit offload" and has_sharded_params(optimizer):
            return f"optimizer {index} steps sharded (DTensor) parameters, which host offload refuses"
    return None


class _Planning:
    """The plan before the first step, for :class:`~lightning_efficient.autofit.callback.AutoFit` (a part of
    it: the state it reads and sets is AutoFit's, set up in its ``__init__``; its other parts' methods are AutoFit's too)."""

    # AutoFit's settings and state this part reads or sets
    budget: int | float | str | list[int | float | str]
    margin: float
    search_micro_batch: bool
    micro_batches: list[int] | None
    activation_policies: tuple[str, ...]
    optimizer_options: tuple[str, ...]
    blocks: Any
    min_8bit_size: int
    _micro_batch_sizes: list[int] | None
    _micro_searched: bool
    _profiles: list[RankProfile]
    _unprofiled: _Unprofiled | None
    _user_activations: ActivationMemory | None
    _user_optimizer: EightBitOptimizer | None
    _users_batch_size: int | None

    def _heterogeneous(self, trainer: Trainer) -> bool:
        return is_heterogeneous(trainer.strategy)

    def _samples_per_step(self, trainer: Trainer, loader: Any = None) -> int:
        """The global batch the user set (before AutoFit changes anything)."""
        loader = users_loader(trainer) if loader is None else loader
        batch_size = loader_batch_size(loader)
        accumulation = trainer.accumulate_grad_batches
        if self._heterogeneous(trainer):
            if trainer.strategy.global_batch_size:
                return trainer.strategy.global_batch_size
            # the user's, not what the strategy's plan set where the loader was built already (in configure_optimizers)
            accumulation = trainer.strategy.balancer.requested_accumulation(trainer)
        return batch_size * trainer.world_size * accumulation

    def _allowed_micro_batches(self, per_rank: int, samples: int, heterogeneous: bool) -> list[int] | None:
        """The user's ``micro_batches`` the search can take (None: every size it allows), refused where none is."""
        if self._micro_batch_sizes is None:
            return None
        limit = samples if heterogeneous else per_rank
        allowed = [m for m in self._micro_batch_sizes if m <= limit and (heterogeneous or per_rank % m == 0)]
        refuse_unless(bool(allowed), "AutoFit", "micro_batches", self.micro_batches,
                       f"sizes up to the global batch of {samples} samples" if heterogeneous
                       else f"sizes dividing each rank's {per_rank} samples a step: {divisors(per_rank)}")
        return allowed

    def _plan_now(self, trainer: Trainer, pl_module: LightningModule, keep_micro_batch: FitPlan | None = None) -> FitPlan:
        """Measure every rank and search. ``keep_micro_batch``: the checkpoint's plan, whose micro-batch is kept
        when it still fits (a resume mid-epoch must keep the samples per step of each DataLoader batch)."""
        strategy = trainer.strategy
        loader = users_loader(trainer)
        require(isinstance(loader, torch.utils.data.DataLoader), "train_dataloader", type(loader).__name__,
                "one DataLoader (AutoFit measures its samples)")
        heterogeneous = self._heterogeneous(trainer)
        batch_size = self._users_batch_size = loader_batch_size(loader)
        world = trainer.world_size
        check_budget_ranks(self.budget, world)  # the same on every rank: raised before anything is measured
        notes: list[str] = _allocator_notes(pl_module)
        resizable = can_resize(loader)
        samples = self._samples_per_step(trainer, loader)
        if heterogeneous:
            per_rank = samples
            searched = resizable and self.search_micro_batch
            refuse_unless(searched or self.micro_batches is None, "AutoFit", "micro_batches", self.micro_batches,
                           "None for this DataLoader, whose micro-batches cannot be sized (its own batch_sampler, or a "
                           "dataset not drawn by index)")
            # a cap the user set stays an upper limit on the plan's (a new user's trial: [2, None] beside AutoFit trained
            # rank 0 at 12 a micro-batch); "auto", the probe, AutoFit's measurement replaces
            users_caps = None if strategy.max_micro_batch in (None, "auto") else strategy.balancer.caps()
            if strategy.max_micro_batch == "auto":
                notes.append("the strategy's max_micro_batch='auto' is replaced by the plan's caps (its own measurement)")
            elif users_caps is not None:
                notes.append(f"the strategy's max_micro_batch={strategy.max_micro_batch!r} is kept: each rank's cap is "
                             "within yours")
        else:
            users_caps = None
            per_rank = samples // world
            # a DataLoader given to fit() is not rebuilt from the `batch_size` attribute (Lightning's batch-size finder
            # refuses such loaders too)
            from_hook = trainer.fit_loop._data_source.is_module()
            searched = self.search_micro_batch and resizable and from_hook and lightning_hasattr(pl_module, "batch_size")
            if self.search_micro_batch and not searched:
                why = ("it was passed to fit(), which nothing rebuilds; return it from train_dataloader() built with "
                       "self.batch_size for AutoFit to choose the micro-batch" if resizable and not from_hook
                       else "no `batch_size` attribute on the module or datamodule to set" if resizable
                       else "it batches with its own batch_sampler" if loader.batch_size is None
                       else "its dataset cannot be drawn by index")
                # (every rank alike: nothing measured yet)
                refuse_unless(self.micro_batches is None, "AutoFit", "micro_batches", self.micro_batches,
                               f"None for this DataLoader, whose micro-batch AutoFit cannot choose: {why}")
                notes.append("micro-batch kept at the DataLoader's: " + why)
        self._micro_searched = searched
        if searched:
            m2 = min(max(batch_size, 2), per_rank)
            sizes = (max(1, m2 // 2), m2)
            micro_batches = self._allowed_micro_batches(per_rank, samples, heterogeneous)
            epoch = None if heterogeneous else self._rank_epoch(trainer)
            last = None if epoch is None or epoch[1] else epoch[0] % batch_size  # (your short last batch, if any)
            if last and micro_batches is None:
                # only a micro-batch dividing your batch splits the short batch alone, which AutoFit weighs as plain
                # Lightning's step weighs it (a new user's 64 merging two batches of 32 trained a last window of 32 + 4
                # samples as one mean, not the mean of the two means)
                dividing = [m for m in divisors(per_rank) if batch_size % m == 0]
                if len(dividing) < len(divisors(per_rank)):  # (under your own accumulation: sizes left out)
                    micro_batches = dividing
                    notes.append(f"micro-batches dividing your batch of {batch_size} only: each epoch ends on a short "
                                 f"batch of {last} samples, which a plan weighs as plain Lightning's step does only then")
            # smaller candidates are timed too (a CPU's time per sample is not a line in the micro-batch, below the
            # smallest timed size least of all: the demo's grid read one sample faster a sample than two, which the
            # line through two and four put slower): up to three, each at most half the one above; on a resume that
            # keeps the checkpoint's micro-batch, that one alone (its time read, not extrapolated from the line)
            candidates = micro_batches or ([2**k for k in range(per_rank.bit_length())] if heterogeneous else divisors(per_rank))
            ladder = _ladder(candidates, sizes[0]) if keep_micro_batch is None else tuple(keep_micro_batch.micro_batches[:1])
        else:
            sizes = (batch_size, batch_size)
            micro_batches = [batch_size]
            ladder = ()
            epoch = last = None
        batches = _measuring_batches(strategy, loader)
        blocks, fixed, policies = self._blocks(pl_module, notes)
        options = self._optimizer_specs(trainer, pl_module, notes)
        # the blocks the user fixed policies for are profiled now (their peak depends on them); the others once the
        # search shows that their policies matter
        profiles = self._every_ranks_profile(
            trainer, batches, sizes, options=options, blocks=blocks if fixed is not None else [], policies=policies,
            fixed=fixed, budget=lambda: rank_budget(self.budget, trainer.global_rank, world, pl_module.device, max(1, trainer.num_devices)),
            margin=self.margin, ladder=ladder)
        if blocks and fixed is None:
            unprofiled = _Unprofiled(batches, blocks, policies)
            # every rank decides alike (from the gathered profiles); profiled now on a resume (its micro-batch must be kept,
            # which the block policies may be what makes fit) and under FSDP2 (profiling mid-fit would leave gradients on
            # FSDP2's unsharded parameters, as measuring does before the first step, where they are cleared)
            later = keep_micro_batch is None and not any(is_fsdp2(m) for m in pl_module.modules()) and not blocks_matter(
                profiles, samples_per_step=samples, heterogeneous=heterogeneous, margin=self.margin, micro_batches=micro_batches,
                caps=users_caps)
            if later:  # profiled only if the pick's reading or a measured peak asks for a re-plan
                notes.append(NOT_PROFILED)
                self._unprofiled = unprofiled
            else:
                profiles = self._with_blocks(profiles, strategy, unprofiled)
        self._profiles = profiles
        # (every rank alike: from the gathered profiles) your sizes all below what the model trains on, where the batch
        # you set trains: a new user's micro_batches=[1] beside a BatchNorm was planned, and the first step failed in it
        smallest = max(p.smallest_micro_batch for p in profiles)
        refuse_unless(micro_batches is None or any(m >= smallest for m in micro_batches) or batch_size < smallest,
                      "AutoFit", "micro_batches", self.micro_batches,
                      f"sizes of at least {smallest}, as a training step on fewer samples failed while measuring (a "
                      "batch-norm layer's does on one sample): " + (f"up to the global batch of {samples} samples" if heterogeneous
                      else f"{[d for d in divisors(per_rank) if d >= smallest]}, dividing each rank's {per_rank} samples a step"))
        if last is not None and smallest > 1 and searched:
            # nor one whose epoch ends on a micro-batch smaller than that, where your last batch is not (a new user's
            # BatchNorm: 35 samples in batches of 8 at micro-batch 2 ended on one sample, and the fit failed there)
            ends_trainable = [m for m in (micro_batches or divisors(per_rank)) if epoch[0] % m in (0, *range(smallest, m))]
            if last == 0 or last >= smallest:
                refuse_unless(bool(ends_trainable), "AutoFit", "micro_batches", self.micro_batches,
                              f"a size whose epoch of {epoch[0]} samples does not end on a micro-batch of fewer than "
                              f"{smallest} (a training step on fewer failed while measuring; your last batch holds {last})")
                micro_batches = ends_trainable
        plan = None
        saved = keep_micro_batch
        if saved is not None and not heterogeneous and saved.accumulation is not None and searched:
            try:
                plan = search(profiles, samples_per_step=samples, heterogeneous=False, margin=self.margin, policies=policies,
                              micro_batches=saved.micro_batches[:1])
                kept = saved.micro_batches[0]
                outside = "" if micro_batches is None or kept in micro_batches else f", outside micro_batches={self.micro_batches}"
                notes.append(f"micro-batch {kept} kept from the checkpoint's plan{outside} (a resume mid-epoch needs it)")
            except BudgetTooSmall:
                notes.append(f"the checkpoint's micro-batch {saved.micro_batches[0]} does not fit this budget: chosen again")
        settings = {"samples_per_step": samples, "heterogeneous": heterogeneous, "margin": self.margin,
                    "micro_batches": micro_batches if plan is None else saved.micro_batches[:1], "caps": users_caps}
        if plan is None:
            plan = search(profiles, policies=policies, **settings)

        def again(found: list[RankProfile], margin: float | None = None) -> FitPlan:
            # a pick's peak read above the budget: the rest of the planning keeps the wider margin, once a plan meets it
            trial = settings if margin is None else {**settings, "margin": margin}
            if self._unprofiled is not None and blocks_matter(found, **trial):  # the pick's reading moved the line
                found = self._with_blocks(found, strategy, self._unprofiled)
                self._unprofiled, self._profiles = None, found
                notes.remove(NOT_PROFILED)
            planned = search(found, policies=policies, **trial)
            settings.update(trial)
            return planned

        def beyond_measured(plan: FitPlan) -> bool:
            # measured where it is safe to: every block kept at the pick is predicted within the budget
            return searched and any(_unread(p, r.micro_batch) and p.peak_at(r.micro_batch) <= p.budget_bytes
                                    for r, p in zip(plan.ranks, self._profiles))

        def to_read(plan: FitPlan) -> list[int]:
            return [_size_to_read(p, r.micro_batch) for r, p in zip(plan.ranks, self._profiles)]

        def confirmed(plan: FitPlan) -> FitPlan:
            # each reading that moves the pick onto another micro-batch beyond the measured sizes (one that ran out of
            # memory moves it down) reads that one too, a few times at most; a size once read is not read again
            read: list[set[int]] = [set() for _ in self._profiles]

            def settled(plan: FitPlan) -> bool:
                return not beyond_measured(plan) or all(s in done for s, done in zip(to_read(plan), read))

            for _ in range(CONFIRM_ROUNDS):
                if settled(plan):
                    return plan
                for size, done in zip(to_read(plan), read):
                    done.add(size)
                plan = self._confirmed(plan, self._profiles, strategy, batches, notes, again)
            if settled(plan):
                return plan
            # the readings ran out with a pick still unread: where one ran out of memory, no plan goes beyond the largest
            # size that trained
            capped = [p if p.out_of_memory_at is None else _ran_out(p, max(m for m, _ in p.time_points()) + 1)
                      for p in self._profiles]
            if capped == self._profiles:
                return plan
            self._profiles = capped
            return again(capped)

        plan = confirmed(plan)
        if fixed is None and self._unprofiled is None:  # AutoFit chose the block policies
            timed = plan
            plan = self._priced(plan, trainer, pl_module, batches, notes, again)
            if plan is not timed:  # priced out of its pick, perhaps onto a micro-batch not read yet
                plan = confirmed(plan)
        notes.extend(f"rank {rank}: no micro-batch of {p.out_of_memory_at} or more (a reading at or above it ran out of "
                     "memory while measuring)" for rank, p in enumerate(self._profiles) if p.out_of_memory_at is not None)
        if last and batch_size % plan.ranks[0].micro_batch:  # (your micro_batches: a size not dividing your batch)
            notes.append(f"micro-batch {plan.ranks[0].micro_batch} does not divide your batch of {batch_size}: each epoch's "
                         f"short last batch of {last} samples weighs otherwise than in plain Lightning's step")
        plan.notes.extend(notes)
        return plan

    def _blocks(self, pl_module: LightningModule, notes: list[str]) -> tuple[list, list[str] | None, tuple[str, ...]]:
        """The blocks to profile, the policies the user fixed (None: AutoFit chooses), the policies allowed."""
        policies = tuple(p for p in self.activation_policies if p != "offload" or pl_module.device.type == "cuda")
        user = self._user_activations
        if user is not None and user.plan is not None:
            notes.append(f"block policies kept as set by ActivationMemory(policy={user._policy_text()}) (already applied, measured as they are)")
            return [], None, ("keep",)
        try:
            blocks = find_blocks(pl_module, user.blocks if user is not None else self.blocks)
        except ValueError as error:
            notes.append(f"block policies not planned: {error}")
            return [], None, ("keep",)
        if user is not None:
            # where the user's callback turns transformers' checkpointing off at its own start, it is off for the
            # measuring too (the fit's peak is that without it)
            user._take_over_transformers_checkpointing(pl_module, blocks)
            fixed = user.policy * len(blocks) if len(user.policy) == 1 else list(user.policy)
            notes.append(f"block policies kept as set by ActivationMemory(policy={user._policy_text()})")
            return blocks, fixed, tuple(dict.fromkeys(("keep", *fixed)))
        if policies == ("keep",):
            return [], None, policies
        if transformers_checkpointing(pl_module, blocks):  # the user's setting, kept as AutoFit keeps theirs
            notes.append("block policies kept as transformers' gradient checkpointing sets them (gradient_checkpointing_enable(): "
                         "every layer recomputed; measured as it is)")
            return [], None, ("keep",)
        return blocks, None, policies

    def _optimizer_specs(self, trainer: Trainer, pl_module: LightningModule, notes: list[str]) -> list[OptimizerSpec]:
        strategy = trainer.strategy

        def own() -> list[torch.optim.Optimizer]:
            return list(strategy.optimizers)

        user = self._user_optimizer
        if user is not None:
            # (the same words whether it converted the optimizers before AutoFit's turn or not: a new user's trial)
            set_as = (f"EightBitOptimizer(bits={user.bits}" + (", paged=True" if user.paged else "")
                      + (f", offload={user.offload!r}" if user.offload else "") + ")")
            notes.append(f"optimizer states kept as set by {set_as}")
            if any(isinstance(o, eight_bit_classes()) for o in strategy.optimizers) or user.bits == 32:
                return [OptimizerSpec("as set", own, own=True)]
            return [self._twin_spec("as set", trainer, pl_module, paged=user.paged, offload=bool(user.offload), like=user)]
        on_cuda = pl_module.device.type == "cuda"
        if all(is_stateless(o) for o in strategy.optimizers):
            notes.append("the optimizer keeps no state: nothing to hold in 8 bits")
            return [OptimizerSpec("32-bit", own, own=True)]
        specs = [OptimizerSpec("32-bit", own, own=True)] if "32-bit" in self.optimizer_options else []
        names = [n for n in self.optimizer_options if n != "32-bit" and (on_cuda or n not in _CUDA_ONLY)]
        if not specs and not names:  # only CUDA options asked for, on CPU
            notes.append("the optimizer options asked for need CUDA; 8-bit measured instead")
            names = ["8-bit"]
        for name in names:
            reason = _cannot_build(name, strategy.optimizers)
            if not reason and not EightBitOptimizer(min_8bit_size=self.min_8bit_size).holds_8bit_states(own(), pl_module):
                reason = (f"no parameter would hold 8-bit states (each below min_8bit_size={self.min_8bit_size:,} or an "
                          "embedding, kept 32-bit)")
            if reason:
                notes.append(f"optimizer states {name} not considered: {reason}")
                continue
            specs.append(self._twin_spec(name, trainer, pl_module, paged=name == "8-bit paged", offload=name == "8-bit offload"))
        if not specs:
            notes.append("optimizer states kept as the module built them")
            specs.append(OptimizerSpec("32-bit", own, own=True))
        return specs

    def _twin_spec(self, name: str, trainer: Trainer, pl_module: LightningModule, *, paged: bool, offload: bool,
                   like: EightBitOptimizer | None = None) -> OptimizerSpec:
        settings = {} if like is None else {"keep_32bit": like.keep_32bit or None, "embeddings_32bit": like.embeddings_32bit,
                                            "strict": like.strict}
        builder = EightBitOptimizer(min_8bit_size=like.min_8bit_size if like else self.min_8bit_size, **settings)
        return OptimizerSpec(name, lambda: builder.build_twins(list(trainer.strategy.optimizers), pl_module, paged=paged, offload=offload),
                             builder.drop_overrides)
