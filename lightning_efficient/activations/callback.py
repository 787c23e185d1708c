"""``ActivationMemory``: per-block keep / checkpoint / selective / offload / disk, or an ``auto`` plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_efficient._distributed import gather_objects, gather_or_raise_together
from lightning_efficient._samples import batch_samples
from lightning_efficient._step import restored_run_state, skipped_at, step_loss
from lightning_efficient._torch import Trainable
from lightning_efficient._validation import SettingRefused, refuse_unless, require, require_bool, require_int, require_path
from lightning_efficient.activations.discovery import find_blocks, transformers_checkpointing
from lightning_efficient.activations.offload import DiskOffload, HostOffload
from lightning_efficient.activations.planner import BlockProfile, Plan, parse_budget, plan_blocks
from lightning_efficient.activations.policies import POLICIES, policy_counts, selective_refusal, unwrap_block, wrap_block
from lightning_efficient.activations.profile import profile_blocks
from lightning_efficient.memory import ParameterStorages, SavedTensorCounter, outside_training

Policy = Literal["keep", "checkpoint", "selective", "offload", "disk"]
_RECOMPUTED = ("checkpoint", "selective")


class ActivationMemory(Callback):
    """Keeps, recomputes or moves off the device the activations of each repeated block.

    Works under DDP and under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` per block): a
    policy wraps the block's own forward inside FSDP2's all-gather hooks, so ``checkpoint`` and
    ``selective`` recompute with the parameters FSDP2 gathers again for backward; parameters, sharded
    or all-gathered, are never taken for activations (not offloaded, not profiled, not counted).

    Args:
        policy: one of ``keep``, ``checkpoint``, ``selective``, ``offload``, ``disk`` for every block, a
            list with one per block, or ``auto`` (with ``budget``): profile one real training step
            and choose per block the policy of least time cost that fits the budget. Under data
            parallelism each rank profiles its own first micro-batch and plans for it.
        blocks: ``"auto"`` (the largest ModuleList/Sequential of same-class modules) or a list of
            class names / qualified-name patterns (a block FSDP2's ``fully_shard`` made ``FSDP<Name>``
            matches ``<Name>``).
        budget: for ``auto``: activation bytes held for backward per rank, as bytes, a string like
            ``"6GiB"``, or a float in (0, 1] — that fraction of the measured every-block-kept figure.
        offload_dir: the directory where ``disk`` makes its private directory (None: the system temp directory;
            made, with its parents, where it does not exist; an existing file is refused).
        use_streams: ``offload`` copies on a side stream and prefetches in backward (CUDA).
        min_offload_bytes: saved tensors smaller than this stay on the device under offload/disk.
        reentrant: reentrant checkpointing (refused with DDP's ``find_unused_parameters=True``).
        auto_policies: the policies ``auto`` may choose from.
        disk_pending_bytes: under ``disk``, the most bytes of saved tensors waiting for the writer thread; beyond it
            forward waits for the disk (memory, on the device and in the host, then stays bounded).

    Raises:
        ValueError: naming the argument for an unknown policy, a missing/invalid budget, or a bad
            block specification; before the first step, for a budget no plan meets (with the minimum),
            on every rank when it is so on any rank.
    """

    def __init__(
        self,
        policy: Policy | Literal["auto"] | list[Policy] = "checkpoint",
        blocks: Literal["auto"] | list[str] = "auto",
        budget: int | float | str | None = None,
        offload_dir: str | None = None,
        use_streams: bool = True,
        min_offload_bytes: int = 2**16,
        reentrant: bool = False,
        auto_policies: list[Policy] | None = None,
        disk_pending_bytes: int = 2**30,
    ) -> None:
        allowed = (*POLICIES, "auto")
        require(isinstance(policy, str) or (isinstance(policy, (list, tuple)) and len(policy) > 0), "policy", policy,
                "a policy name or a non-empty list of them, one per block")
        policies = [policy] if isinstance(policy, str) else list(policy)
        for item in policies:
            require(item in allowed, "policy", policy, "one of " + ", ".join(allowed) + " (or a list of them, one per block)")
        require(not (len(policies) > 1 and "auto" in policies), "policy", policy, "'auto' alone, not inside a list")
        is_auto = policies == ["auto"]
        require(budget is None or is_auto, "budget", budget, "None unless policy='auto'")
        require(budget is not None or not is_auto, "budget", budget, "a byte count, a size string or a fraction when policy='auto'")
        if budget is not None:
            parse_budget(budget)  # validates now; a fraction is resolved once the baseline is measured
        require(blocks == "auto" or (isinstance(blocks, list) and blocks and all(isinstance(b, str) for b in blocks)),
                "blocks", blocks, "'auto' or a non-empty list of class names / name patterns")
        require_bool("use_streams", use_streams)
        require_bool("reentrant", reentrant)
        require_path("offload_dir", offload_dir)
        require(offload_dir is None or not Path(offload_dir).expanduser().is_file(), "offload_dir", offload_dir,
                "a directory (or None), not an existing file")
        require_int("disk_pending_bytes", disk_pending_bytes, 1)
        require(auto_policies is None or (isinstance(auto_policies, list) and len(auto_policies) > 0), "auto_policies",
                auto_policies, "None (every policy) or a non-empty list of policies")
        require_int("min_offload_bytes", min_offload_bytes, 0)
        self.auto_policies = tuple(auto_policies or ("keep", "selective", "checkpoint", "offload", "disk"))
        self._auto_policies_chosen = auto_policies is not None  # the user's list: a policy left out of it is said
        for item in self.auto_policies:
            require(item in POLICIES, "auto_policies", auto_policies, "a list of " + ", ".join(POLICIES))
        self.policy = policies
        self.blocks = blocks
        self.budget = budget
        self.offload_dir = offload_dir
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.reentrant = reentrant
        self.disk_pending_bytes = disk_pending_bytes
        self._block_list: list[tuple[str, torch.nn.Module]] = []
        self._plan: list[str] | None = None
        self._rank_plans: list[dict[str, Any]] | None = None  # each rank's auto plan and its figures
        self._trainable_planned: Trainable | None = None  # what trained when auto profiled the blocks
        self._auto_plans: dict[Trainable, dict[str, Any]] = {}  # this fit's auto plans, by what trained when profiled
        self._restored: dict[str, Any] | None = None
        self._disk: DiskOffload | None = None
        self._host: HostOffload | None = None
        self._profiles: list[BlockProfile] = []
        self._plan_summary: Plan | None = None
        self._use_cache_off: list[Any] = []
        self._transformers_checkpointing_off: list[Any] = []  # modules whose transformers checkpointing was turned off
        self._closed_disk: DiskOffload | None = None  # the last fit's disk offload, closed: its byte counts
        self._warned_cpu_offload = False
        self._exclude: ParameterStorages | None = None
        self._policies_chosen_by: str | None = None  # who set ``policy`` when not the user (AutoFit's plan)

    # -- wiring ------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.reentrant and getattr(trainer.strategy, "_ddp_kwargs", {}).get("find_unused_parameters"):
            raise ValueError(
                "reentrant=True is refused with DDP's find_unused_parameters=True: reentrant checkpointing "
                "runs the block's backward outside the autograd graph DDP inspects, so DDP marks its "
                "parameters ready twice or never; use reentrant=False."
            )
        self._plan, self._rank_plans, self._plan_summary, self._profiles = None, None, None, []
        self._trainable_planned, self._auto_plans = None, {}
        self._closed_disk = None
        self._block_list = find_blocks(pl_module, self.blocks)
        self._take_over_transformers_checkpointing(pl_module)
        if self._exclude is not None:
            self._exclude.stop()
        # weights are not activations: offload, disk and the profiler leave them alone (under FSDP2 too,
        # where the storages of the all-gathered parameters change at every forward)
        self._exclude = ParameterStorages(pl_module).track()
        if self.policy == ["auto"]:
            if pl_module.automatic_optimization is False:
                raise ValueError("policy='auto' profiles one training step, which needs automatic optimization")
            return  # restored or planned at on_train_start / the first batch, once the checkpoint is loaded
        plan = self.policy * len(self._block_list) if len(self.policy) == 1 else self.policy
        refuse_unless(len(plan) == len(self._block_list), "ActivationMemory", "policy", self.policy,
                      f"one policy or a list of {len(self._block_list)} (one per block found)")
        self._apply(plan, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the checkpoint's state is loaded by now whatever the strategy: before on_fit_start usually, but
        # after it where strategy.restore_checkpoint_after_setup is True (ModelParallelStrategy, hetero_fsdp)
        restored, self._restored = self._restored, None  # used once: a later fit without a checkpoint starts afresh
        if self.policy == ["auto"]:
            if self._plan is None:
                plan = self._restorable(restored, trainer)
                if plan is not None:
                    self._apply(plan, pl_module)
        elif restored is not None and restored.get("plan") is not None and restored["plan"] != self._plan:
            now = (f"{self._policies_chosen_by}'s plan sets the policies now" if self._policies_chosen_by is not None
                   else f"policy={self._policy_text()} set now wins")
            rank_zero_info(f"ActivationMemory: the checkpoint's plan ({policy_counts(restored['plan'])}) is not restored: {now}.")

    def _policy_text(self) -> str:
        return repr(self.policy[0] if len(self.policy) == 1 else self.policy)

    def _restorable(self, restored: dict[str, Any] | None, trainer: Trainer) -> list[str] | None:
        """The checkpoint's auto plan for this rank, if it was made for the same settings and model
        (else None: plan again); one info line says which."""
        if restored is None or restored.get("plan") is None:
            return None
        saved = restored["plan"]
        names = [name for name, _ in self._block_list]
        plans = restored.get("plans_by_rank") or [{"policies": saved}]
        reason = None
        if restored.get("policy") != ["auto"]:
            reason = f"it was made for policy={restored.get('policy')!r}, not an auto plan"
        elif restored.get("budget") != self.budget:
            reason = f"budget={self.budget!r} differs from the checkpoint's {restored.get('budget')!r}"
        elif list(restored.get("auto_policies") or ()) != list(self.auto_policies):
            reason = f"auto_policies={list(self.auto_policies)} differ from the checkpoint's {restored.get('auto_policies')}"
        elif restored.get("blocks") != names:
            reason = f"the blocks differ ({len(names)} now, {len(restored.get('blocks') or [])} in the checkpoint)"
        elif len(plans) != trainer.world_size:
            reason = f"it was made for {len(plans)} ranks, not {trainer.world_size}"
        if reason is not None:
            rank_zero_info(f"ActivationMemory: the checkpoint's plan ({policy_counts(saved)}) is not restored: {reason}; "
                           "planning again on the first batch.")
            return None
        mine = plans[trainer.global_rank]
        # (what trained when it was profiled: where other parameters train at a step, the blocks are profiled again)
        self._trainable_planned = Trainable.saved(restored.get("trainable")) or Trainable.of(trainer.lightning_module)
        if mine.get("held_bytes") is not None:
            self._plan_summary = Plan(list(mine["policies"]), mine["held_bytes"], mine["cost_s"], mine["baseline_bytes"])
        self._rank_plans = [dict(p) for p in plans]
        rank_zero_info(f"ActivationMemory: the checkpoint's auto plan is restored ({policy_counts(saved)}, budget={self.budget!r}); "
                       "not profiled again while the parameters that train are those it was profiled with.")
        return list(mine["policies"])

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.policy != ["auto"]:
            return
        if self._plan is not None and self._trainable_planned is not None:
            trainable = self._trainable_planned.changed_at_step_start(pl_module, batch_idx, trainer.accumulate_grad_batches)
            if trainable is not None:
                # a BaseFinetuning callback unfroze blocks (which saved nothing for backward when profiled), or froze some;
                # every rank must change what trains at the same step (it does): every rank profiles there, together
                changed = (f"ActivationMemory: {trainable.elements:,} parameters train now, "
                           f"{self._trainable_planned.elements:,} when the blocks were profiled")
                self._unwrap_blocks()
                self._plan = None
                known = self._auto_plans.get(trainable)
                if all(gather_objects(known is not None)):  # (every rank alike: where one would profile, every rank does)
                    assert known is not None
                    rank_zero_info(f"{changed}: profiled for these earlier in this fit, that plan is taken back.")
                    self._profiles, self._plan_summary, self._rank_plans = known["profiles"], known["summary"], known["rank_plans"]
                    self._apply(list(known["policies"]), pl_module)
                    self._trainable_planned = trainable
                    return
                rank_zero_info(f"{changed}: profiling them again.")
        if self._plan is None:
            with outside_training(pl_module.device):  # (not this step's work for a MemoryReport's counts)
                self._plan_automatically(trainer, pl_module, batch, batch_idx)
            self._trainable_planned = Trainable.of(pl_module)
            self._auto_plans[self._trainable_planned] = {"policies": list(self._plan), "summary": self._plan_summary,
                                                         "rank_plans": self._rank_plans, "profiles": self._profiles}

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._disk is not None:
            self._disk.check()  # a failed background write stops the fit here at the latest

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._disk is not None:
            self._disk.check(wait=True)

    def _hooks_for(self, policy: str, index: int):
        if policy == "disk":
            if self._disk is None:
                self._disk = DiskOffload(self.offload_dir, self.min_offload_bytes, self._exclude,
                                         max_pending_bytes=self.disk_pending_bytes)
            return lambda: self._disk.hooks(index)
        if policy == "offload":
            if self._host is None:
                self._host = HostOffload(self.min_offload_bytes, self.use_streams, self._exclude)
            return lambda: self._host.hooks(index)
        return None

    def _apply(self, plan: list[str], pl_module: LightningModule) -> None:
        on_cuda = pl_module.device.type == "cuda"
        if "offload" in plan and not on_cuda and not self._warned_cpu_offload:
            rank_zero_warn("ActivationMemory: policy 'offload' moves CUDA tensors to host memory; on CPU it does nothing.")
            self._warned_cpu_offload = True
        refused = [f"{name} ({reason})" for (name, block), policy in zip(self._block_list, plan)
                   if policy == "selective" and (reason := selective_refusal(block)) is not None]
        if refused:
            raise SettingRefused(f"ActivationMemory: policy 'selective' cannot recompute {len(refused)} block(s) exactly: "
                                 f"{'; '.join(refused[:3])}{' ...' if len(refused) > 3 else ''}. Give them 'checkpoint' "
                                 "(it recomputes the whole block, exactly) or another policy.")
        for index, ((_, block), policy) in enumerate(zip(self._block_list, plan)):
            effective = "keep" if policy == "offload" and not on_cuda else policy
            wrap_block(block, effective, hooks=self._hooks_for(effective, index), reentrant=self.reentrant)
        self._plan = list(plan)
        self._turn_off_use_cache(pl_module, [block for (_, block), policy in zip(self._block_list, plan) if policy in _RECOMPUTED])
        rank_zero_info(f"ActivationMemory: {len(plan)} blocks ({self._block_list[0][0]} ...): {policy_counts(plan)}")

    def _take_over_transformers_checkpointing(self, pl_module: LightningModule,
                                              blocks: list[tuple[str, Any]] | None = None) -> None:
        """transformers' own gradient checkpointing (``gradient_checkpointing_enable()``) recomputes every layer
        whatever policy wraps it: a block sent to disk would be recomputed and save nothing, and ``auto`` would profile
        recomputed blocks. Where a policy other than keep applies, it is off while the fit runs, the policies deciding
        each block (a policy of keep only leaves it on: the user's setting); restored when the fit ends. Its
        ``use_cache=False``, which transformers forces only while its checkpointing is on, stays off the same while:
        the layers would otherwise build a cache of every key and value in each training forward. ``blocks``: where
        AutoFit measures before this callback's ``on_fit_start``, the blocks it found."""
        if all(policy == "keep" for policy in self.policy):
            return
        blocks = self._block_list if blocks is None else blocks
        found = transformers_checkpointing(pl_module, blocks)
        for _, module in found:
            module.gradient_checkpointing = False
        self._transformers_checkpointing_off += [module for _, module in found]
        if found:
            rank_zero_warn(f"ActivationMemory: transformers' gradient checkpointing is on in {found[0][0] or type(found[0][1]).__name__}"
                           f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}; turned off while the fit runs, so that "
                           f"policy={self._policy_text()} decides each block (restored when fit ends)")
            self._turn_off_use_cache(pl_module, [block for _, block in blocks])

    def _turn_off_use_cache(self, pl_module: LightningModule, blocks: list[Any]) -> None:
        """A transformers model caches keys and values when ``config.use_cache``: a recomputed layer
        would add its keys and values to the cache a second time. Off while its layers (``blocks``) are recomputed,
        as transformers' own gradient checkpointing does; restored when fit ends."""
        if not blocks:
            return
        names = []
        for name, module in pl_module.named_modules():
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", None) is not True or any(c is config for c in self._use_cache_off):
                continue
            inside = set(module.modules())
            if any(block in inside for block in blocks):
                config.use_cache = False
                self._use_cache_off.append(config)
                names.append(name or type(module).__name__)
        if names:
            rank_zero_info(f"ActivationMemory: config.use_cache set to False on {', '.join(names)} while its layers are "
                           "recomputed (as transformers' gradient checkpointing does); restored when fit ends.")

    # -- auto ---------------------------------------------------------------------------------
    def _profile(self, trainer: Trainer, batch: Any, batch_idx: int, policies: tuple[str, ...]) -> tuple[list[BlockProfile], int]:
        """Per-block profiles and the bytes saved outside the blocks, from one step of the class's
        ``training_step`` (no plugin's wrapper) in the precision plugin's context, state restored."""
        strategy = trainer.strategy
        module = strategy.lightning_module
        outside: dict[str, int] = {}

        def step_output() -> Tensor:
            return step_loss(strategy, batch, batch_idx)

        def run_step() -> None:
            with SavedTensorCounter(exclude=self._exclude) as counter:
                loss = step_output()
            outside["bytes"] = counter.bytes
            loss.backward()

        skipped_before = skipped_at(module, batch_idx)
        for _ in range(1 if skipped_before else 2):
            with restored_run_state(strategy):
                profiles = profile_blocks(
                    run_step, step_output, self._block_list, self._exclude, module.device,
                    min_offload_bytes=self.min_offload_bytes, policies=policies, offload_dir=self.offload_dir,
                )
            # again where the step skipped this batch's index, found only now: the profile's first call ran the skipped
            # index too, whose forward before the skip the blocks' hooks counted with the trained one's (a review)
            if not skipped_at(module, batch_idx):
                break
        # inside blocks the profiler's own hooks shadow this outer count: it sees the tensors saved
        # outside the blocks (embeddings, head, loss), which no policy changes
        return profiles, outside["bytes"]

    def _plan_automatically(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        policies = tuple(p for p in self.auto_policies if p != "offload" or pl_module.device.type == "cuda")
        if len(policies) < len(self.auto_policies) and self._auto_policies_chosen:
            rank_zero_warn(f"ActivationMemory: auto_policies={list(self.auto_policies)!r} includes 'offload', which needs CUDA: "
                           f"planned on {pl_module.device.type} without it (with {sorted({'keep', *policies})!r}).")
        micro_batch = batch_samples(batch) or 1
        plan: Plan | None = None
        failure: BaseException | None = None
        try:
            self._profiles, fixed = self._profile(trainer, batch, batch_idx, policies)
            baseline = fixed + sum(p.held_bytes["keep"] for p in self._profiles)
            budget = parse_budget(self.budget, baseline)
            plan = plan_blocks(self._profiles, budget, fixed, policies)
        except Exception as error:  # noqa: BLE001 - every rank learns of it below and raises it together
            failure = error
        # each rank plans for its own micro-batch (hetero_ddp gives ranks different ones). A rank whose
        # profile or plan raises makes every rank fail with its message, rather than leaving the others
        # in the gather below, provided every rank reaches that gather. Under DDP the profile steps run
        # without collectives (the class's training_step, outside DDP's forward), so they do. Under
        # FSDP2 they do not: the profile steps themselves run FSDP2's collectives (the parameter
        # all-gathers of every forward and backward), so a rank that fails mid-profile (e.g. out of
        # memory) leaves the others waiting in one of those collectives until the process group's
        # timeout, and the run ends with a timeout error rather than this rank's message.
        outcome = None if plan is None else {
            "micro_batch": micro_batch, "policies": plan.policies, "held_bytes": plan.held_bytes,
            "cost_s": plan.cost_s, "baseline_bytes": plan.baseline_bytes,
        }
        outcomes = gather_or_raise_together(outcome, failure, "ActivationMemory(policy='auto') could not plan",
                                            f"micro-batch {micro_batch}")
        assert plan is not None
        self._rank_plans = [{k: o[k] for k in ("policies", "held_bytes", "cost_s", "baseline_bytes")} for o in outcomes]
        self._plan_summary = plan
        self._print_plan(plan, budget, outcomes)
        self._apply(plan.policies, pl_module)

    def _print_plan(self, plan: Plan, budget: int, outcomes: list[dict[str, Any]]) -> None:
        lines = [f"ActivationMemory auto plan: budget {budget / 2**20:,.2f} MiB, every block kept "
                 f"{plan.baseline_bytes / 2**20:,.2f} MiB, planned {plan.held_bytes / 2**20:,.2f} MiB, "
                 f"estimated cost {plan.cost_s * 1e3:,.1f} ms/step",
                 f"  {'block':<28} {'policy':<11} {'freed MiB':>10} {'cost ms':>9}"]
        for name, policy, saved, cost in plan.rows(self._profiles):
            lines.append(f"  {name:<28} {policy:<11} {saved / 2**20:>10.2f} {cost * 1e3:>9.2f}")
        if len(outcomes) > 1:
            lines.append("  per rank: " + "; ".join(
                f"rank {rank} (micro-batch {o['micro_batch']}): {policy_counts(o['policies'])}, planned {o['held_bytes'] / 2**20:,.2f} MiB"
                for rank, o in enumerate(outcomes)))
        rank_zero_info("\n".join(lines))

    # -- reporting, checkpoints, clean-up -----------------------------------------------------
    def memory_figures(self) -> dict[str, int]:
        """The planned activation bytes and what disk offload took out of memory and wrote, for :class:`MemoryReport`."""
        figures: dict[str, int] = {}
        if self._plan_summary is not None:
            figures["activation_planned_bytes"] = self._plan_summary.held_bytes
            figures["activation_all_kept_bytes"] = self._plan_summary.baseline_bytes
        disk = self._disk or self._closed_disk
        if disk is not None:
            # handed to it (every saved storage it took; on a device copied out at once, on CPU held until written), and
            # written (less the files whose block's backward ran before the writer reached them: that share varies)
            figures["activation_disk_offloaded_bytes"] = disk.bytes_offloaded
            figures["activation_disk_written_bytes"] = disk.bytes_written
        return figures

    @property
    def plan(self) -> list[str] | None:
        """The policy applied to each block (None before it is known)."""
        return None if self._plan is None else list(self._plan)

    @property
    def plan_summary(self) -> Plan | None:
        """This rank's ``auto`` plan with its planned and every-block-kept bytes and its estimated
        cost (None for a fixed policy, or before the first batch)."""
        return self._plan_summary

    @property
    def profiles(self) -> list[BlockProfile]:
        """What ``auto`` measured per block in this fit (empty when the plan came from a checkpoint)."""
        return list(self._profiles)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": self._plan,
            "blocks": [name for name, _ in self._block_list],
            "policy": list(self.policy),
            "budget": self.budget,
            "auto_policies": list(self.auto_policies),
            "plans_by_rank": self._rank_plans,
            "trainable": None if self._trainable_planned is None else list(self._trainable_planned),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def _unwrap_blocks(self) -> None:
        """Unwrap every block and restore the ``use_cache`` recomputing them turned off."""
        for _, block in self._block_list:
            unwrap_block(block)
        for config in self._use_cache_off:
            config.use_cache = True
        self._use_cache_off = []

    def _undo(self) -> None:
        """Unwrap every block, stop disk offload (threads, files, directory), restore ``use_cache``."""
        self._unwrap_blocks()
        if self._exclude is not None:
            self._exclude.stop()
        for module in self._transformers_checkpointing_off:
            module.gradient_checkpointing = True
        self._transformers_checkpointing_off = []
        disk, self._disk, self._host = self._disk, None, None
        if disk is not None:
            disk.close()  # its flush may still write
            self._closed_disk = disk

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restored = None  # a fit that raised before on_train_start must not hand its checkpoint to the next
        self._undo()  # Lightning skips teardown when fit raises

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restored = None  # a fit that never reached on_train_start (resumed at its end) leaves none behind
        self._undo()

