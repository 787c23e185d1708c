"""EightBitOptimizer under FSDP2 (Lightning's ModelParallelStrategy, 2 gloo processes on CPU).

One run of ``fsdp_run.py`` (every fit in one pair of processes) serves every test here.
"""

from pathlib import Path

import lightning
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_efficient import DemoGPT, EightBitOptimizer
from tests.ddp import run_script
from tests.optim.fsdp_run import KWARGS, MIN_8BIT, Rows

HERE = Path(__file__).resolve().parent


class OneDevice(DemoGPT):
    """The script's model without sharding."""

    def train_dataloader(self):
        return DataLoader(Rows(), batch_size=2)


def one_device_trainer(steps, callbacks):
    return lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp8bit")
    lightning.seed_everything(0)
    t = one_device_trainer(1, [EightBitOptimizer(min_8bit_size=MIN_8BIT)])
    t.fit(OneDevice(**KWARGS))
    t.save_checkpoint(tmp / "unsharded.ckpt")
    run_script(HERE / "fsdp_run.py", tmp / "out", tmp / "unsharded.ckpt", timeout=900)
    ranks = [torch.load(tmp / f"out.rank{r}.pt", weights_only=False) for r in (0, 1)]
    return tmp, ranks


def test_each_rank_steps_its_local_shard_exactly_as_bitsandbytes_alone(fsdp):
    _, ranks = fsdp
    for steps in (r["steps"] for r in ranks):
        assert steps["all_dtensor"] and steps["type"] == "LocalShardAdamW8bit"
        assert steps["checked"] == 4 * 28 and steps["mismatches"] == []  # 28 parameters, 4 steps, bitwise
        assert steps["eight_bit"] == 8  # qkv, proj, two mlp matrices per block
        assert steps["local_numel"] * 2 == pytest.approx(steps["global_numel"], rel=0.01)


def test_a_rank_holds_about_2_05_bytes_per_local_8bit_parameter(fsdp):
    _, ranks = fsdp
    for steps in (r["steps"] for r in ranks):
        assert 2.0 < steps["8bit_bytes"] / steps["8bit_numel"] <= 2.05
        assert steps["32bit_bytes"] == 8 * steps["32bit_numel"]
        assert steps["state_bytes"] == steps["8bit_bytes"] + steps["32bit_bytes"] + steps["qmap_bytes"]
        assert steps["8bit_numel"] + steps["32bit_numel"] == steps["local_numel"]


@pytest.mark.parametrize("kind", ["distributed", "full"])
def test_resume_is_exact(fsdp, kind):
    _, ranks = fsdp
    for rank in ranks:
        resumed = rank[f"resume_{kind}"]
        assert resumed["is_dir"] == (kind == "distributed")
        for name, value in rank["straight"].items():
            assert torch.equal(value, resumed["params"][name]), name
        for index, state in rank["straight_states"].items():
            for key, value in state.items():
                other = resumed["states"][index][key]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (index, key)


@pytest.mark.parametrize("kind", ["distributed", "full"])
@pytest.mark.parametrize("target_bits", [8, 32])
def test_32bit_and_8bit_checkpoints_convert_shard_by_shard(fsdp, kind, target_bits):
    _, ranks = fsdp
    for rank in ranks:
        converted = rank[f"convert_{kind}_to_{target_bits}"]
        assert converted["type"] == ("LocalShardAdamW8bit" if target_bits == 8 else "AdamW")
        assert converted["count"] == 28 and converted["mismatches"] == [] and converted["finite"]


def test_refusals_before_the_first_step(fsdp):
    _, ranks = fsdp
    errors = ranks[0]["errors"]
    assert "offload='cpu' is not allowed with sharded (DTensor) parameters" in errors["offload"]
    assert "CPUOffloadPolicy" in errors["offload"]
    assert "saved without sharding, this run is sharded over a device mesh of shape [2]" in errors["unsharded_checkpoint"]


def test_a_sharded_8bit_checkpoint_is_refused_on_one_device(fsdp):
    tmp, _ = fsdp
    t = one_device_trainer(3, [EightBitOptimizer(min_8bit_size=MIN_8BIT)])
    with pytest.raises(ValueError, match=r"saved sharded over a device mesh of shape \[2\], this run is without sharding"):
        t.fit(OneDevice(**KWARGS), ckpt_path=tmp / "out.B" / "step=2.ckpt")


def test_tensor_parallel_shards_step_locally_and_resume_exactly(fsdp):
    _, ranks = fsdp
    for tp in (r["tensor_parallel"] for r in ranks):
        assert tp["type"] == "LocalShardAdamW8bit"
        assert tp["placements"] == {"up.weight": "(Shard(dim=0),)", "up.bias": "(Shard(dim=0),)",
                                    "down.weight": "(Shard(dim=1),)", "down.bias": "(Replicate(),)"}
        assert tp["checked"] == 4 * 4 and tp["mismatches"] == [] and tp["eight_bit"] == 2
        assert tp["resume_exact"]
