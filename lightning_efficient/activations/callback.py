"""``ActivationMemory``: per-block keep / checkpoint / selective / offload / disk, or an ``auto`` plan."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_efficient._validation import require, require_int
from lightning_efficient.activations.discovery import find_blocks
from lightning_efficient.activations.offload import DiskOffload, HostOffload
from lightning_efficient.activations.planner import Plan, parse_budget, plan_blocks
from lightning_efficient.activations.policies import POLICIES, unwrap_block, wrap_block
from lightning_efficient.activations.profile import profile_blocks
from lightning_efficient.memory import SavedTensorCounter


def _storage_exclusion(pl_module: LightningModule):
    excluded = {t.untyped_storage().data_ptr() for t in [*pl_module.parameters(), *pl_module.buffers()]}
    return lambda t: t.untyped_storage().data_ptr() in excluded


class ActivationMemory(Callback):
    """Keeps, recomputes or moves off the device the activations of each repeated block.

    Args:
        policy: one of ``keep``, ``checkpoint``, ``selective``, ``offload``, ``disk`` for every block, a
            list with one per block, or ``auto`` (with ``budget``): profile one real training step
            and choose per block the policy of least time cost that fits the budget.
        blocks: ``"auto"`` (the largest ModuleList/Sequential of same-class modules) or a list of
            class names / qualified-name patterns.
        budget: for ``auto``: activation bytes held for backward, as bytes, a string like ``"6GiB"``,
            or a float in (0, 1] — that fraction of the measured every-block-kept figure.
        offload_dir: where ``disk`` makes its private directory (None: the system temp directory).
        use_streams: ``offload`` copies on a side stream and prefetches in backward (CUDA).
        min_offload_bytes: saved tensors smaller than this stay on the device under offload/disk.
        reentrant: reentrant checkpointing (refused with DDP's ``find_unused_parameters=True``).
        auto_policies: the policies ``auto`` may choose from.

    Raises:
        ValueError: naming the argument for an unknown policy, a missing/invalid budget, or a bad
            block specification; before the first step, for a budget no plan meets (with the minimum).
    """

    def __init__(
        self,
        policy: str | list[str] = "checkpoint",
        blocks: str | list[str] = "auto",
        budget: int | float | str | None = None,
        offload_dir: str | None = None,
        use_streams: bool = True,
        min_offload_bytes: int = 2**16,
        reentrant: bool = False,
        auto_policies: list[str] | None = None,
    ) -> None:
        allowed = (*POLICIES, "auto")
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
        require_int("min_offload_bytes", min_offload_bytes, 0)
        self.auto_policies = tuple(auto_policies or ("keep", "selective", "checkpoint", "offload", "disk"))
        for item in self.auto_policies:
            require(item in POLICIES, "auto_policies", auto_policies, "a list of " + ", ".join(POLICIES))
        self.policy = policies
        self.blocks = blocks
        self.budget = budget
        self.offload_dir = offload_dir
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.reentrant = reentrant
        self._block_list: list[tuple[str, torch.nn.Module]] = []
        self._plan: list[str] | None = None
        self._restored_plan: list[str] | None = None
        self._disk: DiskOffload | None = None
        self._host: HostOffload | None = None
        self._profiles: list = []
        self._plan_summary: Plan | None = None
        self._warned_cpu_offload = False

    # -- wiring ------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.reentrant and getattr(trainer.strategy, "_ddp_kwargs", {}).get("find_unused_parameters"):
            raise ValueError(
                "reentrant=True is refused with DDP's find_unused_parameters=True: reentrant checkpointing "
                "runs the block's backward outside the autograd graph DDP inspects, so DDP marks its "
                "parameters ready twice or never; use reentrant=False."
            )
        self._block_list = find_blocks(pl_module, self.blocks)
        self._exclude = _storage_exclusion(pl_module)
        if self._restored_plan is not None:
            if len(self._restored_plan) != len(self._block_list):
                raise ValueError(
                    f"the checkpoint's plan has {len(self._restored_plan)} blocks but the model has {len(self._block_list)}"
                )
            self._apply(self._restored_plan, pl_module)
        elif self.policy != ["auto"]:
            plan = self.policy * len(self._block_list) if len(self.policy) == 1 else self.policy
            require(len(plan) == len(self._block_list), "policy", self.policy,
                    f"one policy or a list of {len(self._block_list)} (one per block found)")
            self._apply(plan, pl_module)
        elif pl_module.automatic_optimization is False:
            raise ValueError("policy='auto' profiles one training step, which needs automatic optimization")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._plan is None and self.policy == ["auto"]:
            self._plan_automatically(trainer, pl_module, batch, batch_idx)

    def _hooks_for(self, policy: str, index: int):
        if policy == "disk":
            if self._disk is None:
                self._disk = DiskOffload(self.offload_dir, self.min_offload_bytes, self._exclude)
            return lambda: self._disk.hooks(index)
        if policy == "offload":
            if self._host is None:
                self._host = HostOffload(self.min_offload_bytes, self.use_streams, self._exclude)
            return lambda: self._host.hooks(index)
        return None

    def _apply(self, plan: list[str], pl_module: LightningModule) -> None:
        on_cuda = pl_module.device.type == "cuda"
        if "offload" in plan and not on_cuda:
            if not self._warned_cpu_offload:
                rank_zero_warn("ActivationMemory: policy 'offload' moves CUDA tensors to host memory; on CPU it does nothing.")
                self._warned_cpu_offload = True
        for index, ((_, block), policy) in enumerate(zip(self._block_list, plan)):
            effective = "keep" if policy == "offload" and not on_cuda else policy
            wrap_block(block, effective, hooks=self._hooks_for(effective, index), reentrant=self.reentrant)
        self._plan = list(plan)
        counts = {p: plan.count(p) for p in dict.fromkeys(plan)}
        rank_zero_info(f"ActivationMemory: {len(plan)} blocks ({self._block_list[0][0]} ...): " +
                       ", ".join(f"{n} {p}" for p, n in counts.items()))

    # -- auto ---------------------------------------------------------------------------------
    def _plan_automatically(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        policies = tuple(p for p in self.auto_policies if p != "offload" or pl_module.device.type == "cuda")
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

        def step_output() -> Tensor:
            out = pl_module.training_step(batch, batch_idx)
            return out["loss"] if isinstance(out, dict) else out

        def run_step() -> None:
            with SavedTensorCounter(exclude=[*pl_module.parameters(), *pl_module.buffers()]) as counter:
                loss = step_output()
            self._profiled_total = counter.bytes
            loss.backward()

        try:
            self._profiles = profile_blocks(
                run_step, step_output, self._block_list, self._exclude, pl_module.device,
                min_offload_bytes=self.min_offload_bytes, policies=policies, offload_dir=self.offload_dir,
            )
        finally:
            pl_module.zero_grad(set_to_none=True)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        # inside blocks the profiler's own hooks shadow this outer count: it sees the tensors saved
        # outside the blocks (embeddings, head, loss), which no policy changes
        fixed = self._profiled_total
        baseline = fixed + sum(p.held_bytes["keep"] for p in self._profiles)
        budget = parse_budget(self.budget, baseline)
        plan = plan_blocks(self._profiles, budget, fixed, policies)
        plan = trainer.strategy.broadcast(plan, src=0)  # every rank runs rank 0's plan
        self._plan_summary = plan
        self._print_plan(plan, budget)
        self._apply(plan.policies, pl_module)

    def _print_plan(self, plan: Plan, budget: int) -> None:
        lines = [f"ActivationMemory auto plan: budget {budget / 2**20:,.1f} MiB, every block kept "
                 f"{plan.baseline_bytes / 2**20:,.1f} MiB, planned {plan.held_bytes / 2**20:,.1f} MiB, "
                 f"estimated cost {plan.cost_s * 1e3:,.1f} ms/step",
                 f"  {'block':<28} {'policy':<11} {'saved MiB':>10} {'cost ms':>9}"]
        for name, policy, saved, cost in plan.rows(self._profiles):
            lines.append(f"  {name:<28} {policy:<11} {saved / 2**20:>10.2f} {cost * 1e3:>9.2f}")
        rank_zero_info("\n".join(lines))

    # -- reporting, checkpoints, clean-up -----------------------------------------------------
    def memory_figures(self) -> dict[str, int]:
        """The planned activation bytes and what disk offload wrote, for :class:`MemoryReport`."""
        figures: dict[str, int] = {}
        if self._plan_summary is not None:
            figures["activation_planned_bytes"] = self._plan_summary.held_bytes
            figures["activation_unplanned_bytes"] = self._plan_summary.baseline_bytes
        if self._disk is not None:
            figures["activation_disk_written_bytes"] = self._disk.bytes_written
        return figures

    @property
    def plan(self) -> list[str] | None:
        """The policy applied to each block (None before it is known)."""
        return None if self._plan is None else list(self._plan)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"plan": self._plan, "blocks": [name for name, _ in self._block_list]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_plan = state_dict.get("plan")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._disk is not None:
            self._disk.clear()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for _, block in self._block_list:
            unwrap_block(block)
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        self._host = None
