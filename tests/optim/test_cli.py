import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent.parent


def test_cli_optimizer_adamw_with_the_callback(tmp_path, small_datamodule_kwargs):
    config = {
        "trainer": {
            "accelerator": "cpu", "max_steps": 2, "logger": False, "enable_checkpointing": False,
            "limit_val_batches": 0, "enable_progress_bar": False,
            "callbacks": [{"class_path": "lightning_efficient.EightBitOptimizer", "init_args": {"min_8bit_size": 1024}}],
        },
        "model": {"class_path": "lightning_efficient.DemoGPT", "init_args": {"vocab_size": 512, "n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32}},
        "data": {"class_path": "lightning_efficient.CorpusDataModule", "init_args": small_datamodule_kwargs},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.002, "weight_decay": 0.05}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_efficient.cli", "fit", "--config", str(path)],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "EightBitOptimizer: optimizer states by precision" in output
    assert "kernels-community" not in output  # bitsandbytes' note about optional CPU kernels is not shown
    eight_bit_line = next(line for line in output.splitlines() if line.strip().startswith("8bit"))
    assert int(eight_bit_line.split()[1]) > 0  # some tensors hold 8-bit states


def test_choice_arguments_are_literals_the_cli_parser_checks():
    from argparse import ArgumentError

    import pytest
    from jsonargparse import ArgumentParser

    from lightning_efficient import EightBitOptimizer

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(EightBitOptimizer, "eight_bit")
    parsed = parser.parse_args(["--eight_bit.bits=32", "--eight_bit.offload=cpu"])
    assert parsed.eight_bit.bits == 32 and parsed.eight_bit.offload == "cpu"
    for bad, key in (("--eight_bit.bits=16", "bits"), ("--eight_bit.offload=disk", "offload")):
        with pytest.raises(ArgumentError, match=rf'"eight_bit\.{key}"(.|\n)*Expected a typing\.Literal\['):
            parser.parse_args([bad])
