"""A Hugging Face transformers causal LM (Llama architecture) built from a small config, no download,
trained through the fused per-token loss path with the plugins on.

    python examples/hf_causal_lm.py --steps 50 [--model-type gpt2]
"""

import argparse

import lightning as L

from lightning_efficient import ActivationMemory, CorpusDataModule, EightBitOptimizer, MemoryReport, SelectiveTokenLoss
from lightning_efficient.hf import HFCausalLM

CONFIGS = {
    "llama": {"vocab_size": 8192, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128},
    "gpt2": {"vocab_size": 8192, "n_embd": 128, "n_layer": 3, "n_head": 4, "n_positions": 128,
             "bos_token_id": 0, "eos_token_id": 0},
}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--model-type", choices=sorted(CONFIGS), default="llama")
    args = parser.parse_args(argv)
    L.seed_everything(0)
    model = HFCausalLM(args.model_type, CONFIGS[args.model_type])
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        limit_val_batches=4,
        val_check_interval=max(1, args.steps // 2),
        logger=False,
        enable_checkpointing=False,
        callbacks=[
            SelectiveTokenLoss(method="eslm", score="entropy", keep_ratio=0.7, warmup_steps=10),
            ActivationMemory(policy="selective"),  # finds LlamaDecoderLayer / GPT2Block by itself
            EightBitOptimizer(),
            MemoryReport(every_n_steps=10),
        ],
    )
    trainer.fit(model, datamodule=CorpusDataModule(batch_size=8, max_files=200))
    print(f"final validation loss {float(trainer.callback_metrics['val_loss']):.3f}")


if __name__ == "__main__":
    main()
