"""Run by test_static_graph.py: 2 CPU processes (gloo), ``DDPStrategy(static_graph=True)``, two steps of the tiny token
model (``plain``: TokenLosses and no plugin; ``fused``: FusedTokenLoss and no plugin; ``selective``: TokenLosses under
SelectiveTokenLoss(method="none"); ``subclass``: a subclass of TokenLosses). Rank 0 saves every step's largest difference between the ranks' gradients.

Usage: python ddp_static_graph.py OUT.pt MODE
"""

import sys

import lightning
import torch
import torch.distributed as dist
from accumulation_model import Tiny
from lightning.pytorch.strategies import DDPStrategy

from lightning_efficient import SelectiveTokenLoss, TokenLosses


class MyLosses(TokenLosses):
    """A user's own output class."""


class SubclassTiny(Tiny):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return MyLosses(out["token_losses"], out["mask"])


class RankDifference(lightning.Callback):
    """Each step's largest |rank 0's gradient - rank 1's| (0 where DDP synchronised them)."""

    def __init__(self):
        self.differences = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        mine = torch.cat([p.grad.flatten() for p in pl_module.parameters()])
        theirs = mine.clone()
        dist.broadcast(theirs, 1)
        self.differences.append(float((mine - theirs).abs().max()))


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    lightning.seed_everything(0)
    seen = RankDifference()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(static_graph=True), precision="64-true", max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[seen, *([SelectiveTokenLoss(method="none")] if mode == "selective" else [])])
    trainer.fit(SubclassTiny() if mode == "subclass" else Tiny(fused=mode == "fused"))
    if dist.get_rank() == 0:
        torch.save(seen.differences, out)
