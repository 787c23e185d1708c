"""Run by test_callback.py in a fresh process (RSS figures mean something only there): a fit of the wide-head
demo GPT with AutoFit. Usage: python fresh_fit.py CORPUS CACHE BUDGET OUT.json [plan_only].
Writes the plan's predicted peak, the measured peak (AutoFit.measured) and the budget in bytes."""

import json
import sys

import lightning

from lightning_efficient import AutoFit, CorpusDataModule, DemoGPT

corpus, cache, budget, out = sys.argv[1:5]
plan_only = sys.argv[5:] == ["plan_only"]
lightning.seed_everything(0)
model = DemoGPT(vocab_size=8192, n_layers=2, d_model=32, n_heads=2, seq_len=256)
data = CorpusDataModule(data_path=corpus, cache_dir=cache, vocab_size=512, seq_len=256, batch_size=8)
fit = AutoFit(budget=int(budget) if budget.isdigit() else budget, optimizer_options=["32-bit"], report_after_steps=3,
              plan_only=plan_only)
trainer = lightning.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, callbacks=[fit])
trainer.fit(model, data)
profile = fit.profiles[0]
json.dump({"budget": fit.plan.budgets[0], "predicted": fit.plan.ranks[0].peak_bytes, "micro_batch": fit.plan.micro_batches[0],
           "policies": fit.plan.ranks[0].policies, "measured": None if fit.measured is None else fit.measured[0]["peak_bytes"],
           "line": profile.line(profile.peak_bytes), "blocks_keep": sum(b.held_bytes["keep"] for b in profile.blocks),
           "blocks_leanest": sum(min(b.held_bytes.values()) for b in profile.blocks)}, open(out, "w"))
