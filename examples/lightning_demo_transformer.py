"""Lightning's own demo model, ``lightning.pytorch.demos.Transformer`` (an nn.Transformer encoder-
decoder), trained on the standard-library corpus with per-token losses and the plugins on.

    python examples/lightning_demo_transformer.py --steps 50
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer

from lightning_efficient import ActivationMemory, CorpusDataModule, EightBitOptimizer, MemoryReport, SelectiveTokenLoss, TokenLosses


class DemoTransformerLM(L.LightningModule):
    """Wraps the demo Transformer; its forward returns log-probabilities ``[batch * seq, vocab]``."""

    def __init__(self, vocab_size: int = 8192):
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=128, nhead=4, nhid=256, nlayers=2, dropout=0.1)

    def training_step(self, batch, batch_idx):
        inputs, labels = batch["input_ids"], batch["labels"]
        # a causal language model: the decoder reads the inputs under its causal mask; the encoder gets
        # nothing (it sees its whole sequence, so inputs there would show it the next tokens, and labels
        # given to the decoder would show it the very token it predicts)
        log_probs = self.model(torch.zeros_like(inputs), inputs)
        losses = F.nll_loss(log_probs, labels.flatten(), reduction="none", ignore_index=-100)
        return TokenLosses(losses.view_as(labels), labels != -100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=[
            SelectiveTokenLoss(method="random", keep_ratio=0.7),
            ActivationMemory(policy="checkpoint"),  # both the encoder and the decoder stacks
            EightBitOptimizer(),
            MemoryReport(every_n_steps=10),
        ],
    )
    trainer.fit(DemoTransformerLM(), datamodule=CorpusDataModule(batch_size=8, seq_len=64, max_files=200))


if __name__ == "__main__":
    main()
