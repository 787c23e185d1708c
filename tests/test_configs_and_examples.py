import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _run(command, cwd):
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)


def test_every_config_parses_and_runs_two_steps(tmp_path):
    # the demo config is the packaged default alone (lightning_efficient/demo/default.yaml; tests/test_cli.py)
    assert {c.stem for c in CONFIGS} == {"tokens", "activations", "optim", "balance", "hf_llama", "autofit"}

    def run(config):
        cwd = tmp_path / config.stem
        cwd.mkdir()
        command = [sys.executable, "-m", "lightning_efficient.cli", "fit", "--config", str(config),
                   "--trainer.max_steps", "2", "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"]
        return config.stem, _run(command, cwd)

    with ThreadPoolExecutor(2) as pool:  # two at a time: most of each run is start-up
        results = list(pool.map(run, CONFIGS))
    for name, done in results:
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        assert "`Trainer.fit` stopped: `max_steps=2` reached" in done.stdout + done.stderr, name
        assert not (tmp_path / name / "config.yaml").exists(), name  # logger: false saves no config in cwd


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_each_example_runs_a_few_steps(example, tmp_path):
    done = _run([sys.executable, str(example), "--steps", "2"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MemoryReport" in done.stdout
