"""Run by test_callback.py in a fresh process (RSS figures mean something only there): a plan-only AutoFit fit of a
tiny transformers Llama in an ordinary LightningModule (a new user's). Usage: python fresh_llama_refusal.py BUDGET
MARGIN OUT.json. Writes the plan's budget and predicted peak, or where the budget is refused the least budget the
refusal names ({"refused": bytes})."""

import json
import re
import sys

import lightning
import torch
import transformers

from lightning_efficient import AutoFit
from lightning_efficient.autofit import BudgetTooSmall


class LlamaLM(lightning.LightningModule):
    """A two-layer Llama over random tokens, its DataLoader built with ``self.batch_size``."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=4, vocab_size=256)
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def train_dataloader(self):
        tokens = torch.randint(0, 256, (256, 64), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


budget, margin, out = sys.argv[1:4]
lightning.seed_everything(0)
fit = AutoFit(budget=int(budget) if budget.isdigit() else budget, margin=float(margin), plan_only=True)
trainer = lightning.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[fit])
try:
    trainer.fit(LlamaLM())
except BudgetTooSmall as refused:
    named = re.search(r"\(([\d,]+) bytes\)", str(refused)).group(1)
    json.dump({"refused": int(named.replace(",", ""))}, open(out, "w"))
else:
    json.dump({"budget": fit.plan.budgets[0], "predicted": fit.plan.ranks[0].peak_bytes}, open(out, "w"))
