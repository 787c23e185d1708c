import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_efficient import HeterogeneousDDPStrategy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ddp_hetero  # noqa: E402


def _launch(mode, out, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    return subprocess.run([sys.executable, str(HERE / "ddp_hetero.py"), mode, str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["samples", "tokens", "selective"])
def test_shares_two_to_one_give_the_global_batch_gradient(tmp_path, mode):
    out = tmp_path / "grads.pt"
    done = _launch(mode, out)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = torch.load(out)
    assert saved["shares"] == [4, 2]
    model = ddp_hetero.Module(mode).double()
    model.load_state_dict(saved["init"])
    rows = ddp_hetero.Rows()
    batch = {k: v[saved["indices"]] for k, v in vars(rows).items()}
    if mode in ("tokens", "selective"):
        losses = model.per_token(batch) + 0 * model.net(batch["x"]).sum()
        valid = batch["labels"] != -100
        if mode == "selective":  # one normalisation: the global top half of the global batch's tokens
            from lightning_efficient.tokens.selection import select_tokens

            valid = select_tokens("topk", losses, valid, 0.5).keep
        loss = losses[valid].sum() / valid.sum()  # the mean over the global batch's (kept) valid tokens
    else:
        loss = model.per_sample_loss(batch) + 0 * model.per_token(batch).sum()
    loss.backward()
    assert "head.weight" in saved["grads"]
    for name, param in model.named_parameters():
        if name in saved["grads"]:
            assert (saved["grads"][name] - param.grad).abs().max() <= 1e-12, name


def test_shares_converge_toward_the_speed_ratio_when_a_rank_is_slowed(tmp_path):
    out = tmp_path / "shares.json"
    done = _launch("rebalance", out)
    assert done.returncode == 0, done.stderr[-3000:]
    shares = json.loads(out.read_text())["shares"]
    assert shares[0] == [12, 12]  # equal until the first plan
    final = shares[-1]
    # rank 1 is 3x slower per sample: the shares approach 18:6 (ratio 3), accepted within [2, 4.5]
    assert sum(final) == 24 and 2.0 <= final[0] / final[1] <= 4.5, shares
    first_change = next(i for i, s in enumerate(shares) if s != [12, 12])
    assert first_change <= 8  # within 8 steps (warm-up 2, a plan every 2 steps, applied 2 batches ahead)


@pytest.mark.parametrize(("mode", "pattern"), [
    ("bad_global", r"global_batch_size=1 is smaller than the number of ranks \(2\)"),
    ("bad_shares", r"shares=\[1.0, 2.0, 3.0\] has 3 weights for 2 ranks"),
])
def test_impossible_settings_fail_before_the_first_step(tmp_path, mode, pattern):
    done = _launch(mode, tmp_path / "unused")
    assert done.returncode != 0
    assert __import__("re").search(pattern, done.stderr), done.stderr[-2000:]


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"global_batch_size": 0}, "global_batch_size=0"),
    ({"shares": [1.0, -1.0]}, r"shares=\[1.0, -1.0\]"),
    ({"shares": [0.0, 0.0]}, r"shares=\[0.0, 0.0\]"),
    ({"max_micro_batch": "big"}, "max_micro_batch='big'"),
    ({"rebalance_every": 0}, "rebalance_every=0"),
    ({"hysteresis": 1.0}, "hysteresis=1.0"),
])
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HeterogeneousDDPStrategy(**kwargs)


def test_registered_as_hetero_ddp():
    import lightning

    trainer = lightning.Trainer(strategy="hetero_ddp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HeterogeneousDDPStrategy)
