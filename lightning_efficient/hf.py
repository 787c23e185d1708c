"""A LightningModule around a Hugging Face transformers causal LM, returning the fused per-token loss.

The model is built from a config (no download): ``HFCausalLM(model_type="llama", config={...})``.
``training_step`` returns :class:`~lightning_efficient.tokens.FusedTokenLoss` with the decoder's
final hidden states and the LM head, so the ``[tokens, vocab]`` logits are never built. Batches are
``{"input_ids", "labels"}`` with next-token labels already aligned (as :class:`CorpusDataModule`
gives them), -100 where a position does not count.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_efficient._validation import require
from lightning_efficient.tokens.module import TokenLossSteps
from lightning_efficient.tokens.output import FusedTokenLoss


class HFCausalLM(TokenLossSteps, LightningModule):
    """A transformers causal LM built from a config, trained through the fused token-loss path.

    Args:
        model_type: a transformers model type with a causal-LM head (``"llama"``, ``"gpt2"``, ...).
        config: keyword arguments of that model's config (sizes, vocabulary).
        learning_rate: AdamW learning rate (> 0).
        weight_decay: AdamW weight decay (>= 0).

    Raises:
        ValueError: for a model type transformers does not know, or a bad learning rate.
    """

    def __init__(self, model_type: str = "llama", config: dict[str, Any] | None = None, learning_rate: float = 1e-3,
                 weight_decay: float = 0.1) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        require(learning_rate > 0, "learning_rate", learning_rate, "a number > 0")
        require(weight_decay >= 0, "weight_decay", weight_decay, "a number >= 0")
        try:
            hf_config = AutoConfig.for_model(model_type, **(config or {}))
        except ValueError as error:
            raise ValueError(f"model_type={model_type!r} is not allowed: {error}") from error
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_config(hf_config)
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self._labels_checked = False

    def on_fit_start(self) -> None:
        """Check the labels' alignment again on this fit's first training batch."""
        self._labels_checked = False

    @property
    def vocab_size(self) -> int:
        """The LM head's vocabulary."""
        return self.model.get_output_embeddings().weight.shape[0]

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """The decoder's final hidden states (the LM head's input)."""
        return self.model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state

    def token_losses(self, batch: dict[str, Tensor]) -> FusedTokenLoss:
        """Per-token losses of ``batch["labels"]`` through the fused path.

        Raises:
            ValueError: at a fit's first training batch, for labels equal to ``input_ids`` wherever they count and not
                their next tokens (Hugging Face's convention, where the model shifts them): trained as they are, each
                position would learn to copy its own token.
        """
        if self.training and not self._labels_checked:  # (once a fit: each check waits for the device)
            self._labels_checked = True
            _refuse_unshifted_labels(batch["input_ids"], batch["labels"])
        head = self.model.get_output_embeddings()
        return FusedTokenLoss(self.hidden_states(batch["input_ids"]), head.weight, batch["labels"], bias=head.bias)

    def setup(self, stage: str) -> None:
        """Check that the data's vocabulary fits the model's."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.vocab_size:
            raise ValueError(f"the data's vocab_size={data_vocab} exceeds the model's vocabulary of {self.vocab_size}")

    def configure_optimizers(self):
        """AdamW with decay on matrices only."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=self.hparams.learning_rate)


def _refuse_unshifted_labels(input_ids: Tensor, labels: Tensor) -> None:
    """Refuse labels that are the inputs themselves (a new user's ``{"input_ids": x, "labels": x}``: the loss fell from
    5.5 to 4.1 in 30 steps, learning to copy the current token, while the next-token loss stayed at 5.4)."""
    if input_ids.dim() != 2 or input_ids.shape != labels.shape or input_ids.shape[-1] < 2:
        return
    counted = labels != -100
    copies = int(counted.sum()) > 1 and torch.equal(labels[counted], input_ids[counted])  # (one token: no evidence)
    # labels that are also the next tokens (a row of one repeated token): aligned as well, not refused (a review)
    counted_next = counted[:, :-1]
    also_next = torch.equal(labels[:, :-1][counted_next], input_ids[:, 1:][counted_next])
    if copies and not also_next:
        raise ValueError(
            "HFCausalLM: labels equal input_ids wherever they count: HFCausalLM trains each position on its label as "
            "given, the next token already aligned (as CorpusDataModule gives them), not shifted inside the model as "
            "Hugging Face's models do; trained so, each position would learn to copy its own token. Give "
            '{"input_ids": ids[:, :-1], "labels": ids[:, 1:]} (padding -100 in labels).'
        )
