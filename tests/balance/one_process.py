"""Run by test_probe.py: two fits on one process under hetero_ddp. Usage: python one_process.py OUT

``paged``: max_micro_batch="auto" with a paged 8-bit Adam.

CPU has no managed memory, so bitsandbytes makes no paged buffers there; ``CpuPagedAdam8bit`` makes
its page-able buffers as bitsandbytes does on CUDA — flagged ``is_paged`` and registered with
bitsandbytes' page manager — from host tensors. OUT (JSON) gets, after the probe (at
``on_train_start``) and after the first step: the buffers the page manager lists, the optimizer's
state size and ``is_paged``, and whether the weights are the ones fit started with.

``timing``: shares "auto" re-planned every step, 4 micro-batches a step, with a clock that records
every mark it makes and every interval read, each with the micro-step (0, 1, ...) it happened in.
"""

import itertools
import json
import sys
import time

import bitsandbytes as bnb
import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_efficient import HeterogeneousDDPStrategy
from lightning_efficient._torch import DeviceClock


class CpuPagedAdam8bit(bnb.optim.Adam8bit):
    def get_state_buffer(self, p, dtype=torch.float32):
        if not self.is_paged:
            return super().get_state_buffer(p, dtype)
        buffer = torch.zeros_like(p, dtype=dtype)
        buffer.is_paged = True
        self.page_mng.paged_tensors.append(buffer)
        return buffer

    def prefetch_state(self, p):  # nothing to prefetch on the host
        pass


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 128)  # 8192 weights: 8-bit states

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return CpuPagedAdam8bit(self.parameters(), lr=1e-3, is_paged=True)


class Record(lightning.Callback):
    def __init__(self, out):
        self.out, self.record = out, {}

    def snapshot(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        return {"paged_listed": len(bnb.functional.GlobalPageManager.get_instance().paged_tensors),
                "state": len(optimizer.state), "is_paged": optimizer.is_paged,
                "weights_kept": all(torch.equal(v, self.start[k]) for k, v in pl_module.state_dict().items())}

    def on_fit_start(self, trainer, pl_module):
        self.start = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_start(self, trainer, pl_module):
        self.record["after_probe"] = self.snapshot(trainer, pl_module)
        self.record["caps"] = trainer.strategy.micro_batch_caps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["after_step"] = self.snapshot(trainer, pl_module)


class RecordingClock(DeviceClock):
    """A host clock whose marks are numbered; it logs each mark and each read with the current micro-step."""

    def __init__(self, device):
        super().__init__(device)
        self.micro_step, self.ids, self.log = -1, itertools.count(), []

    def mark(self):
        mark = (next(self.ids), time.perf_counter())
        self.log.append({"mark": mark[0], "micro_step": self.micro_step})
        return mark

    def seconds(self, start, end):
        self.log.append({"read": [start[0], end[0]], "micro_step": self.micro_step})
        return end[1] - start[1]


class InstallClock(lightning.Callback):
    def on_train_start(self, trainer, pl_module):
        self.clock = trainer.strategy.balancer.clock = RecordingClock("cpu")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.micro_step += 1


def fit(strategy, callbacks, max_steps):
    lightning.seed_everything(0)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(torch.randn(16, 64)), batch_size=4))
    return trainer


if __name__ == "__main__":
    record = Record(sys.argv[1])
    fit(HeterogeneousDDPStrategy(global_batch_size=8, max_micro_batch="auto"), [record], 1)
    clock = InstallClock()
    trainer = fit(HeterogeneousDDPStrategy(global_batch_size=8, max_micro_batch=2, warmup_steps=1, rebalance_every=1),
                  [clock], 3)
    timing = {"log": clock.clock.log, "micro_steps": clock.clock.micro_step + 1,
              "local_speed": trainer.strategy.balancer.local_speed}
    json.dump({"paged": record.record, "timing": timing}, open(sys.argv[1], "w"))
