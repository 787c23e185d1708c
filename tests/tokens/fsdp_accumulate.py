"""Run by tests/autofit/test_token_mean.py: 2 CPU processes (gloo) under FSDP2 (``ModelParallelStrategy``, the tiny
model ``fully_shard``-ed), accumulation 2, two steps, AutoFit's token mean installed; rank 0 saves the initial state and
each step's full gradients. With ``shown``: accumulation 3, three steps (the second a short one, an epoch's last), and
each rank saves to OUT.pt.RANK the loss Lightning hands on beside the module's own, per micro-batch.

Usage: python fsdp_accumulate.py OUT.pt [shown]
"""

import sys

import lightning
import torch
from accumulation_model import InstallsBatchTokenMean, KeepsOwnLoss, OwnLossShown
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


class ShardedTiny(KeepsOwnLoss):
    """:class:`~accumulation_model.Tiny` in float64 (ModelParallelStrategy refuses ``precision="64-true"``), sharded over the ranks."""

    def configure_model(self):
        self.double()
        for layer in (self.emb, self.head):  # called as modules by training_step, which gathers their shards
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])


class FullStepGrads(lightning.Callback):
    """Each step's full gradients (gathered from the shards), on every rank."""

    def __init__(self):
        self.steps = []

    def on_fit_start(self, trainer, pl_module):
        self.init = {k: v.full_tensor().detach().clone() for k, v in pl_module.state_dict().items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({n: p.grad.full_tensor().detach().clone() for n, p in pl_module.named_parameters()})


if __name__ == "__main__":
    shown = sys.argv[2:] == ["shown"]
    lightning.seed_everything(0)
    grads, losses = FullStepGrads(), OwnLossShown()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        precision="32-true", max_steps=3 if shown else 2, accumulate_grad_batches=3 if shown else 2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[grads, losses, InstallsBatchTokenMean()])
    trainer.fit(ShardedTiny())
    if shown:
        torch.save({"pairs": losses.pairs, "steps": losses.steps}, f"{sys.argv[1]}.{torch.distributed.get_rank()}")
    elif torch.distributed.get_rank() == 0:
        torch.save({"init": grads.init, "steps": grads.steps}, sys.argv[1])
