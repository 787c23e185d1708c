"""hetero_fsdp (FSDP2 through ModelParallelStrategy) on 2 gloo CPU processes: one launch of
fsdp_hetero.py runs every fit (see its docstring); the tests read what each rank saved."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning
import pytest
import torch

from lightning_efficient import HeterogeneousFSDPStrategy
from tests.balance import fsdp_hetero
from tests.ddp import run_script

SCRIPT = Path(__file__).resolve().parent / "fsdp_hetero.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hetero_fsdp")
    run_script(SCRIPT, out, timeout=420)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _reference_steps(mode, saved):
    """Parameters after each SGD step (lr 1) on one process, in float64, on the whole global batch."""
    net = fsdp_hetero.Net()
    net.load_state_dict({name.removeprefix("net."): p for name, p in saved["params"][0].items()})
    rows = fsdp_hetero.Rows(48, masked=mode == "tokens")
    out = []
    for indices in saved["batches"]:
        batch = {"ids": rows.ids[indices], "labels": rows.labels[indices]}
        losses = fsdp_hetero.per_token(net, batch)
        valid = batch["labels"] != -100
        loss = losses[valid].sum() / valid.sum() if mode == "tokens" else losses.mean()
        net.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= p.grad
        out.append({f"net.{n}": p.detach().clone() for n, p in net.named_parameters()})
    return out


@pytest.mark.parametrize("mode", ["samples", "tokens"])
def test_shares_three_to_one_with_micro_batches_update_as_the_global_batch(ranks, mode):
    """Shares 3:1 of 16 samples capped at 5 per micro-batch: 12:4 in 3 micro-batches (4+4+4 and 2+1+1);
    after each of two steps the sharded parameters equal one process's SGD step on the global batch."""
    saved = ranks[0][mode]
    assert saved["plan"] == {"shares": [12, 4], "accumulation": 3, "micro": [[4, 4, 4], [2, 1, 1]]}
    assert len(saved["batches"]) == 2 and len(saved["params"]) == 3
    for step, expected in enumerate(_reference_steps(mode, saved)):
        got = saved["params"][step + 1]
        assert expected.keys() == got.keys()
        moved = max((got[n] - saved["params"][step][n]).abs().max().item() for n in got)
        assert moved > 1e-3  # the step changed the parameters (the check below is not vacuous)
        for name in expected:
            assert (got[name] - expected[name]).abs().max().item() <= 1e-10, (step, name)


def _trained_per_step(ranks, tag):
    steps = {}
    for rank in ranks:
        for micro in rank[tag]["trained"]:
            steps.setdefault(micro["step"], []).extend(micro["indices"])
    return steps


def test_two_epochs_train_every_sample_exactly_once_per_epoch(ranks):
    steps = _trained_per_step(ranks, "straight")
    assert sorted(steps) == list(range(6)) and ranks[0]["straight"]["global_step"] == 6
    for epoch in range(2):
        trained = [i for step in range(3 * epoch, 3 * epoch + 3) for i in steps[step]]
        assert Counter(trained) == Counter(range(24)), epoch
    rank0, rank1 = ([m for m in rank["straight"]["trained"] if m["step"] == 0] for rank in ranks)
    assert len(rank0[0]["indices"]) == 6 and len(rank1[0]["indices"]) == 2  # shares 3:1 of 8


def test_a_mid_epoch_resume_from_a_distributed_checkpoint_continues_the_uninterrupted_run(ranks):
    straight, resumed = _trained_per_step(ranks, "straight"), _trained_per_step(ranks, "resumed")
    assert sorted(resumed) == [2, 3, 4, 5] and ranks[0]["resumed"]["global_step"] == 6
    for step in resumed:
        assert resumed[step] == straight[step], step
    final, expected = ranks[0]["resumed"]["final"], ranks[0]["straight"]["final"]
    for name in expected:  # SGD momentum restored from the sharded checkpoint too
        assert (final[name] - expected[name]).abs().max().item() <= 1e-12, name


def test_shares_follow_forward_compute_not_the_ranks_waits_for_each_other(ranks):
    """Rank 1 is 3x slower per sample, slept before the forward, so rank 0 waits for it inside the
    root's all-gather: its forward wall-clock time is as long as rank 1's. The compute time (the
    all-gather waits left out) gives 3:1; counting the wait would keep the shares near 1:1."""
    shares = ranks[0]["rebalance"]["shares"]
    assert shares[0] == [12, 12]
    final = shares[-1]
    assert sum(final) == 24 and 2.0 <= final[0] / final[1] <= 4.5, shares


def test_a_rank_without_a_speed_reading_keeps_the_shares(ranks):
    """A re-plan due while rank 1 has no reading yet is skipped: rank 1 is not given a made-up speed of
    1 sample/s (which handed nearly the whole batch to rank 0)."""
    for rank in ranks:
        assert rank["unmeasured"]["shares"] == [[12, 12]] * 4, rank["unmeasured"]
        assert rank["unmeasured"]["speeds"] == [1.0, 1.0]  # the gathered NaN never became the speeds


def test_gradient_sync_off_skips_the_reduce_scatter_and_switches_it_back_on(ranks):
    for rank in ranks:
        assert rank["sync_off"] == {"unset_inside": True, "set_after": True}


def test_a_parameter_that_no_fully_shard_manages_is_refused_before_the_first_step(ranks):
    """Plain tensors, and DTensors replicated over the data-parallel mesh (not fully_shard's), are refused
    by fit; validate of the same module is not (no gradient to average)."""
    for rank in ranks:
        for tag in ("unsharded", "replicated"):
            message = rank[tag]
            assert message.startswith("ValueError: hetero_fsdp: 3 trainable parameter(s) are not sharded by "
                                      "fully_shard over the 2 data-parallel ranks"), (tag, message)
            assert "net.emb.weight" in message and "each rank would train its own copy" in message
        assert isinstance(rank["validate_unsharded"], float), rank["validate_unsharded"]


def test_a_mid_epoch_resume_from_a_full_checkpoint_continues_the_uninterrupted_run(ranks):
    """save_distributed_checkpoint=False: the single-file checkpoint of the same moment resumes as exactly."""
    straight, resumed = _trained_per_step(ranks, "straight"), _trained_per_step(ranks, "resumed_full")
    assert sorted(resumed) == [2, 3, 4, 5] and ranks[0]["resumed_full"]["global_step"] == 6
    for step in resumed:
        assert resumed[step] == straight[step], step
    final, expected = ranks[0]["resumed_full"]["final"], ranks[0]["straight"]["final"]
    for name in expected:
        assert (final[name] - expected[name]).abs().max().item() <= 1e-12, name


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"max_micro_batch": "auto"}, "max_micro_batch='auto' is not allowed: .*FSDP2's all-gathers need every rank"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 is not allowed: expected 1 under hetero_fsdp"),
    ({"data_parallel_size": 0}, "data_parallel_size=0 is not allowed"),
    ({"shares": [1.0, -1.0]}, r"shares=\[1.0, -1.0\]"),
    ({"global_batch_size": 0}, "global_batch_size=0"),
])
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HeterogeneousFSDPStrategy(**kwargs)


def test_registered_as_hetero_fsdp_with_the_settings_readable():
    trainer = lightning.Trainer(strategy="hetero_fsdp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HeterogeneousFSDPStrategy)
    strategy = HeterogeneousFSDPStrategy(global_batch_size=12, shares=[3.0, 1.0], max_micro_batch=[4, 2])
    assert (strategy.global_batch_size, strategy.shares, strategy.max_micro_batch) == (12, [3.0, 1.0], [4, 2])
    strategy.shares = [1.0, 2.0]  # settable, as Lightning strategies' settings are
    assert strategy.shares == [1.0, 2.0] == strategy.balancer.shares


def test_lightning_cli_builds_it_by_class_path_and_by_name(tmp_path):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    def build(strategy_yaml):
        config = tmp_path / "config.yaml"
        config.write_text("trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:" + strategy_yaml)  # (2 shares)
        return LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None).trainer.strategy

    strategy = build(
        "\n    class_path: lightning_efficient.HeterogeneousFSDPStrategy\n"
        "    init_args:\n      global_batch_size: 12\n      shares: [3.0, 1.0]\n      save_distributed_checkpoint: false\n"
    )
    assert isinstance(strategy, HeterogeneousFSDPStrategy)
    assert strategy.shares == [3.0, 1.0] and strategy.global_batch_size == 12
    assert strategy._save_distributed_checkpoint is False
    assert isinstance(build(" hetero_fsdp\n"), HeterogeneousFSDPStrategy)
