"""The plugins under FSDP2, in one launch: ``python plugins_run.py OUT_DIR``.

The parent starts two gloo processes (rank, world size and a free port in their environment, so every
Trainer in them joins one process group) that run every case of :data:`CASES` in turn: the conformance
harness's 2-block transformer, ``fully_shard`` on each block and on the model in ``configure_model``,
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``, 3 optimizer steps of AdamW.
Each rank writes ``OUT_DIR/rank{r}.pt``: per case the step losses, the local gradient shards of every
step, the final (whole) parameters, and what the plugins report. A case that fails records its error.

The one-device references (``one_device_fit``) are run by the test in its own process.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from tests.conformance.harness import TinyLM, offload_dir
from tests.ddp import launch_ranks

STEPS = 3
BATCH = 4  # the global batch: 2 samples per rank


class Model(TinyLM):
    """The harness's TinyLM (sharded by its ``configure_model`` under ModelParallelStrategy), in
    ``dtype``; its loaders give rank ``r`` of ``w`` every ``w``-th sample of each global batch."""

    def __init__(self, batch_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__("lambda", STEPS, batch_size)
        self.to(dtype)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)


class HeadOutside(Model):
    """:class:`Model` whose forward stops before the head: the loss multiplies by ``self.head.weight``
    after ``self(x)`` returned, as ``FusedTokenLoss(hidden, self.head.weight, labels)`` does. Under FSDP2
    the head is the root's (fully_shard on the model), still gathered then."""

    def forward(self, inputs: Tensor) -> Tensor:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def _token_losses(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = torch.nn.functional.linear(self(batch["inputs"]), self.head.weight, self.head.bias)
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none",
                                                   ignore_index=-100)
        return losses.view_as(batch["labels"]), batch["labels"] != -100


class Probe(Callback):
    """Records per step the token-loss sum and count, the local gradient shards and the local bytes of
    parameters and gradients computed from shapes (numel x element size), and at the end the optimizer
    state's local bytes the same way."""

    def __init__(self) -> None:
        self.losses: list[tuple[float, int]] = []
        self.grads: list[dict[str, Tensor]] = []
        self.shape_bytes: dict[str, int] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: TinyLM, outputs: Any, batch: Any, batch_idx: int) -> None:
        _, total, count = pl_module.last_record
        self.losses.append((total, count))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        grads = {n: _local(p.grad).detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        self.grads.append(grads)
        self.shape_bytes["parameter_bytes"] = sum(_nbytes(p) for p in pl_module.parameters())
        self.shape_bytes["gradient_bytes"] = sum(_nbytes(g) for g in grads.values())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        states = [t for state in trainer.optimizers[0].state.values() for t in state.values() if isinstance(t, Tensor)]
        self.shape_bytes["optimizer_state_bytes"] = sum(_nbytes(t) for t in states)


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: Tensor) -> int:
    return _local(tensor).numel() * tensor.element_size()


def full_params(module: LightningModule) -> dict[str, Tensor]:
    """The whole parameters (sharded ones gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in module.state_dict().items()}


def trainer(callbacks: list[Callback], world: int, tensor_parallel: int = 1) -> Trainer:
    if world == 1:
        strategy: Any = "auto"
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world // tensor_parallel, tensor_parallel_size=tensor_parallel,
                                         process_group_backend="gloo", timeout=timedelta(seconds=90))
    return Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, limit_val_batches=0,
                   num_sanity_val_steps=0, callbacks=callbacks, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)


def plugins(case: str, workdir: Path) -> list[Callback]:
    """The plugin callbacks of ``case`` (fresh)."""
    from lightning_efficient import ActivationMemory, MemoryReport, SelectiveTokenLoss

    directory = str(offload_dir(workdir))
    if case.startswith("activations-"):
        policy = case.split("-", 1)[1]
        if policy == "auto":
            return [ActivationMemory("auto", budget=0.5, min_offload_bytes=0, offload_dir=directory,
                                     auto_policies=["keep", "checkpoint", "disk"])]
        if policy == "selective-by-class":  # blocks named by their class, which fully_shard made FSDPBlock
            return [ActivationMemory("selective", blocks=["Block"])]
        if policy == "checkpoint-reentrant":
            return [ActivationMemory("checkpoint", reentrant=True)]
        return [ActivationMemory(policy, min_offload_bytes=0, offload_dir=directory)]
    if case in ("report", "report-head-outside"):
        return [MemoryReport(every_n_steps=1, log=False, print_table=False)]
    if case.startswith("tokens"):
        return [SelectiveTokenLoss(method="none")]
    assert case.startswith("plain"), case
    return []


#: every case of the launch; "*64" ones train in float64 (the token-normalisation check); "tokens-tp2"
#: (tensor_parallel_size=2, refused before the first step) comes last
CASES = ["plain", "activations-keep", "activations-checkpoint", "activations-selective-by-class",
         "activations-offload", "activations-disk", "activations-auto", "activations-checkpoint-reentrant",
         "report", "report-head-outside", "plain64", "tokens64", "tokens-tp2"]


def fit(case: str, workdir: Path, world: int, batch: int | None = None) -> dict[str, Any]:
    """One fit of ``case`` on ``world`` processes (1: one device) with ``batch`` samples per process
    (default: the global batch split over the processes)."""
    dtype = torch.float64 if case.endswith("64") else torch.float32
    module = (HeadOutside if case.endswith("head-outside") else Model)(batch or BATCH // world, dtype)
    probe = Probe()
    callbacks = plugins(case, workdir)
    hooks_before = _hook_count(module)
    trainer(callbacks + [probe], world, tensor_parallel=2 if case.endswith("-tp2") else 1).fit(module)
    out: dict[str, Any] = {"losses": probe.losses, "grads": probe.grads, "params": full_params(module),
                           "shape_bytes": probe.shape_bytes, "hooks_left": _hook_count(module) - hooks_before,
                           "block_classes": sorted({type(b).__name__ for b in module.blocks})}
    for callback in callbacks:
        if hasattr(callback, "report"):
            out["report"] = callback.report()
        if hasattr(callback, "plan_summary"):
            out["plan"] = callback.plan
            summary = callback.plan_summary
            out["baseline_bytes"] = None if summary is None else summary.baseline_bytes
            out["profiles"] = [(p.name, dict(p.held_bytes)) for p in callback.profiles]
            out["figures"] = callback.memory_figures()
    return out


def _hook_count(module: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def main(out: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = os.environ.get("LOCAL_RANK")
    if rank is None:
        codes = launch_ranks(__file__, out, timeout=600)
        assert codes == [0, 0], codes
        return
    results: dict[str, Any] = {}
    for case in CASES:
        try:
            results[case] = fit(case, out / case, world=2)
        except Exception as exc:  # noqa: BLE001 (reported against the case by the test)
            results[case] = {"error": f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])}
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
