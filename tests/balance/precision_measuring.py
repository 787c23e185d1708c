"""Run by test_probe.py: float32 data under precision "64-true" / "bf16-true" (Lightning's loop converts each batch)
through AutoFit's measuring steps and hetero_ddp's max_micro_batch="auto" probe, against the same fits in plain
Lightning; and ("augmented") a seeded augmentation in on_before_batch_transfer drawing from a generator the module
holds and from NumPy's and Python's global streams. Usage: python precision_measuring.py OUT (one process; JSON: per
case and run, the final weights)."""

import json
import random
import sys

import lightning
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import AutoFit, HeterogeneousDDPStrategy


class Regression(lightning.LightningModule):
    """A linear model on float32 rows; its batch size an attribute train_dataloader reads (AutoFit may set it)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8
        self.layer = torch.nn.Linear(4, 1)
        generator = torch.Generator().manual_seed(0)
        self.rows = TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator))

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Augmented(Regression):
    """Noise added in on_before_batch_transfer (a CPU augmentation) from a seeded generator of its own and the global
    streams: the measured batches pass the hook too, and must not move them."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(1)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        # (drawn per element: AutoFit's micro-batches draw the same numbers as the user's batches, in the same order)
        python = torch.tensor([random.random() for _ in range(x.numel())]).view(x.shape)
        noise = torch.rand(x.shape, generator=self.generator) + torch.from_numpy(np.random.rand(*x.shape)) + python
        return x + noise.to(x.dtype), y


def fit(precision: str, run: str, module_class: type = Regression) -> list[float]:
    lightning.seed_everything(0)
    model = module_class()
    strategy = HeterogeneousDDPStrategy(max_micro_batch="auto") if run == "probe" else "ddp" if run == "ddp" else "auto"
    callbacks = [AutoFit(budget="1GiB", activation_policies=["keep"], optimizer_options=["32-bit"])] if run == "autofit" else []
    trainer = lightning.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=3,
                                accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model)
    return [float(v) for p in model.parameters() for v in p.detach().double().flatten()]


if __name__ == "__main__":
    runs = ("plain", "autofit", "ddp", "probe")
    found = {precision: {run: fit(precision, run) for run in runs} for precision in ("64-true", "bf16-true")}
    found["augmented"] = {run: fit("64-true", run, Augmented) for run in runs}
    json.dump(found, open(sys.argv[1], "w"))
