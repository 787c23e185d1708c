"""Case ``optim``: optimizer-state bytes per parameter and step time on the demo model, and the
validation loss after 300 steps, 32-bit against 8-bit."""

from __future__ import annotations

import functools
import time

import torch

from benchmarks.harness import Case, register
from lightning_efficient.memory import optimizer_state_bytes

FULL_MODEL = {"vocab_size": 8192, "n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 128}
QUALITY_MODEL = {"vocab_size": 8192, "n_layers": 2, "d_model": 128, "n_heads": 4, "seq_len": 128}


def _demo(quick: bool):
    from lightning_efficient import DemoGPT

    return DemoGPT(**({**FULL_MODEL, "n_layers": 2} if quick else FULL_MODEL))


def _build(kind: str, model) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    from lightning_efficient.optim.twins import build_twin

    params = list(model.parameters())
    if kind == "torch_adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "torch_adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "bnb_adamw8bit":
        return bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=0.01)
    # ours: the callback's conversion of a torch AdamW, embeddings kept 32-bit or not
    manager = bnb.optim.GlobalOptimManager.get_instance()
    if kind == "ours":
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.override_config(module.weight, "optim_bits", 32)
    return build_twin(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), min_8bit_size=4096, paged=False)


def state_and_step(kind: str, quick: bool) -> dict[str, float]:
    """State bytes per parameter and the mean optimizer step time (random gradients, 2 warm-up steps)."""
    model = _demo(quick)
    optimizer = _build(kind, model)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    repeats = 5 if quick else 20
    for _ in range(2):
        optimizer.step()
    start = time.perf_counter()
    for _ in range(repeats):
        optimizer.step()
    step = (time.perf_counter() - start) / repeats
    figures = {"state_bytes_per_param": optimizer_state_bytes(optimizer) / numel, "step_time_s": step, "parameters": numel}
    if (kind != "torch_adamw_fused" and not quick) or kind in ("torch_adamw_foreach", "ours"):
        figures["val_loss_300"] = _val_loss(kind, quick)
    return figures


def _val_loss(kind: str, quick: bool) -> float:
    """Validation loss of the small demo after 300 steps with 32-bit AdamW or our 8-bit conversion."""
    import lightning

    from lightning_efficient import CorpusDataModule, DemoGPT, EightBitOptimizer

    lightning.seed_everything(0)
    callbacks = [EightBitOptimizer()] if kind == "ours" else []
    if kind == "ours_embeddings_8bit":
        callbacks = [EightBitOptimizer(embeddings_32bit=False)]
    if kind == "bnb_adamw8bit":
        callbacks = [EightBitOptimizer(embeddings_32bit=False, min_8bit_size=4096)]
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=5 if quick else 300, limit_val_batches=2 if quick else 32, val_check_interval=5 if quick else 300,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    data = CorpusDataModule(batch_size=4 if quick else 16, max_files=60 if quick else None)
    trainer.fit(DemoGPT(**QUALITY_MODEL), datamodule=data)
    return float(trainer.callback_metrics["val_loss"])


KINDS = ("torch_adamw_foreach", "torch_adamw_fused", "bnb_adamw8bit", "ours", "ours_embeddings_8bit")

register(
    Case(
        name="optim",
        description=(
            "The demo GPT (4 layers, d_model 256, vocab 8192 tied: 5.3 M parameters, 2.1 M of them the "
            "embedding): optimizer-state bytes per parameter and step time (random gradients), for torch "
            "AdamW (foreach, fused), bitsandbytes AdamW8bit used directly and our conversion (embeddings "
            "32-bit, the default, and 8-bit); validation loss after 300 steps of the small demo (2 layers, "
            "d_model 128). `val_loss_300` of bnb_adamw8bit is our conversion with embeddings 8-bit."
        ),
        baseline="torch_adamw_foreach",
        variants={kind: functools.partial(state_and_step, kind) for kind in KINDS},
        timeout_s=1800.0,
    )
)
