import sys
from pathlib import Path

import pytest
import torch

from lightning_efficient.tokens.selection import select_tokens
from tests.ddp import run_script

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ddp_global_norm as script


@pytest.mark.parametrize(("method", "scope"), [("topk", "global"), ("none", "batch")])
def test_two_processes_equal_one_process_on_the_whole_batch(tmp_path, method, scope):
    out = tmp_path / "grads.pt"
    run_script(HERE / "ddp_global_norm.py", out, method, scope)
    saved = torch.load(out)
    model = script.Tiny().double()
    model.load_state_dict(saved["init"])
    ids, labels = script.make_batch()
    losses = model.per_token(ids, labels)
    valid = labels != -100
    keep = select_tokens(method, losses, valid, 0.5).keep
    reference = losses[keep].sum() / keep.sum()
    reference.backward()
    for name, param in model.named_parameters():
        assert (saved["grads"][name] - param.grad).abs().max() <= 1e-12, name
