"""Run by test_unfreeze.py: 2 CPU processes (gloo), the finetuning fit of test_unfreeze.py (the backbone unfrozen at
epoch 1) under ``MODE`` (``ddp``, ``hetero_ddp`` with shares 1:1, or ``fsdp2``: ``ModelParallelStrategy``, ``fully_shard`` per
block and on the root), in plain Lightning and with AutoFit (a budget every plan
fits); each rank saves both fits' parameters and AutoFit's plan at the end of each epoch to ``OUT_DIR/rank<r>.pt``.

Usage: python ddp_unfreeze.py OUT_DIR MODE DATA_KWARGS_JSON
"""

import json
import sys
from pathlib import Path

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from test_unfreeze import PlanPerEpoch

from lightning_efficient import AutoFit, CorpusDataModule, HeterogeneousDDPStrategy
from tests.finetuning import MODEL, FinetunedGPT, Unfreeze


class ShardedGPT(FinetunedGPT):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


STRATEGIES = {
    "ddp": lambda: DDPStrategy(process_group_backend="gloo"),
    "hetero_ddp": lambda: HeterogeneousDDPStrategy(shares=[1.0, 1.0], process_group_backend="gloo"),
    "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"),
}


def fit(mode: str, data_kwargs: dict, callbacks: list) -> dict:
    """The fit's parameters at its end (whole, under FSDP2)."""
    lightning.seed_everything(0)
    model = (ShardedGPT if mode == "fsdp2" else FinetunedGPT)(**MODEL)
    data = CorpusDataModule(**{**data_kwargs, "batch_size": 4, "seq_len": MODEL["seq_len"]})
    strategy = STRATEGIES[mode]()
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, limit_train_batches=3,
                                limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[Unfreeze(), *callbacks])
    trainer.fit(model, data)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    out, mode, data_kwargs = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    plain = fit(mode, data_kwargs, [])
    autofit = AutoFit(budget="8GiB", search_micro_batch=False, optimizer_options=["32-bit"], report_after_steps=1)
    seen = PlanPerEpoch(autofit)
    fitted = fit(mode, data_kwargs, [autofit, seen])
    torch.save({"plain": plain, "autofit": fitted, "plans": [p.to_dict() for p in seen.plans]}, out / f"rank{dist.get_rank()}.pt")
