"""Run by test_callback.py: ActivationMemory(policy="auto") under hetero_ddp with shares 1:3 (micro-batches
2 and 6 of a global batch of 8) on 2 CPU processes. Usage: python ddp_auto_plan.py BUDGET OUT_DIR.

Each rank writes OUT_DIR/rank<r>.json: its micro-batch, its plan, the bytes its first real step saved
for backward (counted around the step, after the plan is applied), or the error its fit raised.
"""

import json
import sys
import time
from pathlib import Path

import lightning
from script_data import Rows
from torch.utils.data import DataLoader

from lightning_efficient import ActivationMemory, DemoGPT, HeterogeneousDDPStrategy
from lightning_efficient.memory import SavedTensorCounter


class Report(lightning.Callback):
    def __init__(self, out_dir, memory):
        self.out_dir, self.memory, self.result = Path(out_dir), memory, {}

    def write(self, trainer):
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.result))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:  # ActivationMemory (listed first) has planned and applied its plan by now
            self.counter = SavedTensorCounter(exclude=[*pl_module.parameters(), *pl_module.buffers()]).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.counter.__exit__(None, None, None)
            self.result.update(micro_batch=len(batch["input_ids"]), plan=self.memory.plan, saved_bytes=self.counter.bytes,
                               planned_bytes=self.memory.plan_summary.held_bytes)
            self.write(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self.result.update(error=f"{type(exception).__name__}: {exception}", notes=getattr(exception, "__notes__", []))
        self.write(trainer)
        if trainer.global_rank == 0:  # Lightning kills the other rank after this hook: let it report first
            other = self.out_dir / "rank1.json"
            deadline = time.monotonic() + 60
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.1)


if __name__ == "__main__":
    budget, out_dir = int(sys.argv[1]), sys.argv[2]
    lightning.seed_everything(0)
    memory = ActivationMemory(policy="auto", budget=budget, auto_policies=["keep", "checkpoint"])
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=HeterogeneousDDPStrategy(global_batch_size=8, shares=[1.0, 3.0]),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[memory, Report(out_dir, memory)],
    )
    try:
        trainer.fit(DemoGPT(vocab_size=512, n_layers=4, d_model=32, n_heads=2, seq_len=32), DataLoader(Rows(), batch_size=4))
    except ValueError:
        pass  # each rank wrote its error
