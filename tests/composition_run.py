"""Run by test_composition.py: all four plugins on 2 CPU processes under hetero_ddp, with MemoryReport.

Usage: python composition_run.py OUT_DIR STEPS CORPUS_DIR CACHE_DIR RESUME_CKPT_OR_DASH
Rank 0 writes OUT_DIR/losses.json (the step loss of every global step) and OUT_DIR/report.json;
a checkpoint is saved at step 10 as OUT_DIR/step=10.ckpt.
"""

import json
import sys
from pathlib import Path

import lightning
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_efficient import (
    ActivationMemory,
    CorpusDataModule,
    DemoGPT,
    EightBitOptimizer,
    HeterogeneousDDPStrategy,
    MemoryReport,
    SelectiveTokenLoss,
)


class RecordLosses(lightning.Callback):
    def __init__(self, path):
        self.path, self.losses = path, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"])
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.losses))


def main():
    out, steps, corpus, cache = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    resume = None if sys.argv[5] == "-" else sys.argv[5]
    lightning.seed_everything(0)
    report = MemoryReport(every_n_steps=5, print_table=False, json_path=str(out / "report.json"))
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        strategy=HeterogeneousDDPStrategy(global_batch_size=12, shares=[2.0, 1.0]),
        callbacks=[
            SelectiveTokenLoss(method="eslm", keep_ratio=0.6, scope="global", warmup_steps=3),
            ActivationMemory(policy="auto", budget=0.6, auto_policies=["keep", "selective", "checkpoint", "disk"],
                             offload_dir=str(out / "offload")),
            EightBitOptimizer(min_8bit_size=1024),
            report,
            RecordLosses(out / ("resumed_losses.json" if resume else "losses.json")),
            ModelCheckpoint(dirpath=out, every_n_train_steps=10, save_top_k=-1, filename="{step}"),
        ],
    )
    model = DemoGPT(vocab_size=512, n_layers=2, d_model=32, n_heads=2, seq_len=32, fused_loss=True)
    data = CorpusDataModule(data_path=corpus, vocab_size=512, seq_len=32, batch_size=6, cache_dir=cache)
    trainer.fit(model, datamodule=data, ckpt_path=resume)


if __name__ == "__main__":
    main()
