"""Run by tests/autofit/test_token_mean.py: 2 CPU processes (gloo) under FSDP2 (``ModelParallelStrategy``, the tiny
model ``fully_shard``-ed), accumulation 2, two steps, AutoFit's token mean installed; rank 0 saves the initial state and
each step's full gradients.

Usage: python fsdp_accumulate.py OUT.pt
"""

import sys

import lightning
import torch
from accumulation_model import InstallsBatchTokenMean, Tiny
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


class ShardedTiny(Tiny):
    """:class:`Tiny` in float64 (ModelParallelStrategy refuses ``precision="64-true"``), sharded over the ranks."""

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
    lightning.seed_everything(0)
    grads = FullStepGrads()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        precision="32-true", max_steps=2, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[grads, InstallsBatchTokenMean()])
    trainer.fit(ShardedTiny())
    if torch.distributed.get_rank() == 0:
        torch.save({"init": grads.init, "steps": grads.steps}, sys.argv[1])
