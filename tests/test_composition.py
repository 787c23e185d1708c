import json
from pathlib import Path

import torch

from tests.ddp import run_script

HERE = Path(__file__).resolve().parent


def _run(out, steps, small_datamodule_kwargs, resume=None):
    return run_script(HERE / "composition_run.py", out, steps, small_datamodule_kwargs["data_path"],
                      small_datamodule_kwargs["cache_dir"], resume or "-", timeout=600)


def test_all_four_plugins_on_two_processes_and_an_exact_mid_epoch_resume(tmp_path, small_datamodule_kwargs):
    # the corpus gives 1 epoch of ~18 steps at global batch 12: step 10 is mid-epoch, 30 crosses an epoch
    _run(tmp_path, 30, small_datamodule_kwargs)
    straight = {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    assert sorted(straight) == list(range(30)) and all(v == v for v in straight.values())
    report = json.loads((tmp_path / "report.json").read_text())
    # MemoryReport shows what each plugin does
    assert report["optimizer_8bit_params"] > 0  # EightBitOptimizer
    assert report["activation_planned_bytes"] <= 0.6 * report["activation_all_kept_bytes"]  # ActivationMemory
    assert report["optimizer_state_bytes"] < 4 * report["parameter_bytes"]
    ckpt = torch.load(tmp_path / "step=10.ckpt", weights_only=False)
    loader_state = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["next_batch"] > 0  # saved mid-epoch: the sampler's position is in the checkpoint

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    _run(resumed_dir, 30, small_datamodule_kwargs, resume=str(tmp_path / "step=10.ckpt"))
    resumed = {int(k): v for k, v in json.loads((resumed_dir / "resumed_losses.json").read_text()).items()}
    assert sorted(resumed) == list(range(10, 30))
    for step in range(10, 30):  # the next 20 steps' losses equal the uninterrupted run's
        assert abs(resumed[step] - straight[step]) <= 1e-6 * max(1.0, abs(straight[step])), (step, resumed[step], straight[step])
