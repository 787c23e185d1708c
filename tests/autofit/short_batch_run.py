"""Run by test_short_batch.py: AutoFit's short-batch weight on 2 gloo CPU processes, ``python short_batch_run.py OUT``.

The parent starts two processes (rank, world size and a free port in their environment, so every Trainer in them
joins one process group). Each fits a float64 linear regression on 50 samples (25 a rank under Lightning's
DistributedSampler: batches of 6, 6, 6, 6 and 1) for 2 epochs of SGD, under ``ddp`` and under FSDP2
(``ModelParallelStrategy``, which refuses ``64-true``: ``32-true`` on the float64 model; ``fully_shard`` on the linear layer), in plain Lightning and under
``AutoFit(micro_batches=[2])``, and writes ``OUT/rank<r>.pt``: per strategy and fit every step's (whole) gradient of
the weight and the final weight, or the error.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.ddp import launch_ranks

SAMPLES, BATCH, MICRO = 50, 6, 2


class Regression(lightning.LightningModule):
    """A linear regression returning its (micro-)batch's mean squared error; each step's whole gradient recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = BATCH
        self.linear = nn.Linear(4, 1, dtype=torch.float64)
        self.gradients: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, lightning.pytorch.strategies.ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.linear, mesh=self.device_mesh["data_parallel"])

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(SAMPLES, 4, generator=g, dtype=torch.float64),
                             torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64))
        return DataLoader(data, batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grad = self.linear.weight.grad
        self.gradients.append((grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(strategy: str, autofit: bool) -> dict[str, Any]:
    from lightning_efficient import AutoFit

    lightning.seed_everything(0)
    model = Regression()
    chosen = (lightning.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                                 timeout=timedelta(seconds=120))
              if strategy == "fsdp2" else lightning.pytorch.strategies.DDPStrategy(timeout=timedelta(seconds=120)))
    callbacks = [AutoFit(budget="1GiB", micro_batches=[MICRO], optimizer_options=["32-bit"], activation_policies=["keep"])] if autofit else []
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=chosen, max_epochs=2, logger=False,
                                precision="32-true" if strategy == "fsdp2" else "64-true",  # (FSDP2: the float64 model as it is)
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model)
    weight = model.linear.weight
    return {"gradients": model.gradients, "weight": (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).detach().clone(),
            "accumulation": callbacks[0].plan.accumulation if autofit else 1}


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
    for strategy in ("ddp", "fsdp2"):
        for autofit in (False, True):
            key = f"{strategy}-{'autofit' if autofit else 'plain'}"
            try:
                results[key] = fit(strategy, autofit)
            except Exception as exc:  # noqa: BLE001 (reported against the case by the test)
                results[key] = {"error": f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])}
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
