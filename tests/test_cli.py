import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_config_fits_three_steps(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [
        sys.executable, "-m", "lightning_efficient.cli", "fit", "--config", str(REPO / "configs" / "demo.yaml"),
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MemoryReport" in done.stdout
    assert "tokens_per_s" in done.stdout
