"""Run by test_report.py: MemoryReport under 2 gloo processes with hetero_ddp shares 1:3 and a global
batch of 8 (rank 0 trains 2 samples a step, rank 1 six). Usage: python ddp_report.py DATA CACHE OUT.

Rank 0 writes the report to OUT (json_path); every rank writes its own report() to OUT.rank<i>.
"""

import json
import sys

import lightning

from lightning_efficient import CorpusDataModule, DemoGPT, HeterogeneousDDPStrategy, MemoryReport


def main(data_path: str, cache_dir: str, out: str) -> None:
    lightning.seed_everything(0)
    report = MemoryReport(every_n_steps=2, log=False, json_path=out)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy=HeterogeneousDDPStrategy(global_batch_size=8, shares=[1, 3]),
        max_steps=4, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[report],
    )
    model = DemoGPT(vocab_size=512, n_layers=2, d_model=32, n_heads=2, seq_len=32)
    data = CorpusDataModule(data_path=data_path, vocab_size=512, seq_len=32, batch_size=4, cache_dir=cache_dir)
    trainer.fit(model, datamodule=data)
    with open(f"{out}.rank{trainer.global_rank}", "w") as handle:
        json.dump(report.report(), handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
