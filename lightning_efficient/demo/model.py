"""A small GPT-style decoder whose ``training_step`` returns per-token losses."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_efficient._validation import require, require_int
from lightning_efficient.tokens.module import TokenLossSteps
from lightning_efficient.tokens.output import FusedTokenLoss, TokenLosses

IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over ``[batch, seq, d_model]``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend causally and project back to ``d_model``."""
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.proj(attended.transpose(1, 2).reshape(batch, seq, d_model)))


class Block(nn.Module):
    """A pre-norm transformer block: attention then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block."""
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class DemoGPT(TokenLossSteps, LightningModule):
    """A GPT-style decoder for the demo: token and position embeddings, pre-norm blocks, a linear head.

    ``training_step`` returns :class:`~lightning_efficient.tokens.TokenLosses` (per-token losses and
    the mask of valid positions); with no plugin attached, the step loss is their mean over valid tokens.
    Validation and test log the token-weighted ``val_loss``/``val_ppl`` and ``test_loss``/``test_ppl``
    (reduced over all ranks); ``predict_step`` returns each position's most likely next token.

    Args:
        vocab_size: vocabulary size (>= 256).
        n_layers: number of blocks (>= 1), held in the ``nn.ModuleList`` ``blocks``.
        d_model: width; divisible by ``n_heads``.
        n_heads: attention heads (>= 1).
        seq_len: the longest sequence (> 0).
        dropout: dropout probability in [0, 1).
        tie_embeddings: share the token embedding with the output head.
        fused_loss: return :class:`~lightning_efficient.tokens.FusedTokenLoss` (hidden states, head
            and labels) so the full logits are never built; else per-token losses from full logits.
        learning_rate: peak learning rate of the default AdamW (> 0).
        weight_decay: AdamW weight decay for matrices (>= 0).
        warmup_steps: linear warm-up steps before the cosine decay (>= 0).

    Raises:
        ValueError: naming the argument when a setting is out of range.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        n_layers: int = 4,
        d_model: int = 256,
        n_heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        fused_loss: bool = False,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        require_int("vocab_size", vocab_size, 256)
        require_int("n_layers", n_layers, 1)
        require_int("n_heads", n_heads, 1)
        require_int("d_model", d_model, 1)
        require(d_model % n_heads == 0, "d_model", d_model, f"a multiple of n_heads={n_heads}")
        require_int("seq_len", seq_len, 1)
        require(0.0 <= dropout < 1.0, "dropout", dropout, "a probability in [0, 1)")
        require(learning_rate > 0, "learning_rate", learning_rate, "a number > 0")
        require(weight_decay >= 0, "weight_decay", weight_decay, "a number >= 0")
        require_int("warmup_steps", warmup_steps, 0)
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.emb_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """The final normalised hidden states ``[batch, seq, d_model]`` (the output head's input)."""
        seq = input_ids.shape[1]
        if seq > self.hparams.seq_len:
            raise ValueError(f"input of {seq} tokens is longer than seq_len={self.hparams.seq_len}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.emb_dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``[batch, seq, vocab]``."""
        return self.head(self.hidden_states(input_ids))

    def token_losses(self, batch: dict[str, Tensor]) -> TokenLosses | FusedTokenLoss:
        """Per-token cross-entropy of ``batch["labels"]``; positions labelled -100 are invalid."""
        if self.hparams.fused_loss:
            return FusedTokenLoss(self.hidden_states(batch["input_ids"]), self.head.weight, batch["labels"])
        logits = self(batch["input_ids"])
        labels = batch["labels"]
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        losses = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view_as(labels)
        return TokenLosses(losses, labels != IGNORE_INDEX)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The most likely next token at every position, ``[batch, seq]`` token ids."""
        return self(batch["input_ids"]).argmax(dim=-1)

    def setup(self, stage: str) -> None:
        """Check that the attached DataModule's vocabulary and sequence length fit this model."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.hparams.vocab_size:
            raise ValueError(
                f"the data's vocab_size={data_vocab} exceeds the model's vocab_size={self.hparams.vocab_size}"
            )
        data_seq = getattr(datamodule, "seq_len", None)
        if isinstance(data_seq, int) and data_seq > self.hparams.seq_len:
            raise ValueError(f"the data's seq_len={data_seq} exceeds the model's seq_len={self.hparams.seq_len}")

    def configure_optimizers(self):
        """AdamW (decay on matrices only) with linear warm-up then cosine decay to 10% per step."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(self.hparams.warmup_steps, total)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
