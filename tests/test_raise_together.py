"""A failure on some ranks raises on every rank (``gather_or_raise_together``): real gloo processes."""

from __future__ import annotations

import json
import subprocess
import sys

_RANKS = r"""
import json, sys, tempfile
import torch.multiprocessing as mp

CASES = {  # what each of 3 ranks fails with (None: it does not)
    "budget on rank 1": [None, ("autofit", "BudgetTooSmall"), None],
    "setting on rank 1": [None, ("validation", "SettingRefused"), None],
    "budget on two ranks": [None, ("autofit", "BudgetTooSmall"), ("autofit", "BudgetTooSmall")],
    "value errors of two classes": [None, ("validation", "SettingRefused"), ("builtins", "ValueError")],
    "a value error and another error": [None, ("builtins", "ValueError"), ("builtins", "KeyError")],
}


def error(spec):
    from lightning_efficient import _validation, autofit
    module = {"autofit": autofit, "validation": _validation, "builtins": __builtins__}[spec[0]]
    kind = getattr(module, spec[1]) if spec[0] != "builtins" else {"ValueError": ValueError, "KeyError": KeyError}[spec[1]]
    return kind(f"{spec[1]} here")


def run(rank, path, out):
    import torch.distributed as dist
    from lightning_efficient._distributed import gather_or_raise_together
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=3)
    raised = {}
    for name, specs in CASES.items():
        mine = None if specs[rank] is None else error(specs[rank])
        try:
            gather_or_raise_together(None if mine else rank, mine, "the test could not go on")
            raised[name] = None
        except Exception as caught:
            raised[name] = [type(caught).__name__, str(caught), caught is mine, getattr(caught, "__notes__", [])]
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(raised, f)


if __name__ == "__main__":
    mp.spawn(run, args=(tempfile.mktemp(), sys.argv[1]), nprocs=3)
"""


def test_the_ranks_that_did_not_fail_raise_the_failed_ranks_class_of_value_error_with_every_ranks_message(tmp_path):
    # a refusal on one rank only (its own budget) was a RuntimeError on the others, which the command line printed with
    # its traceback where the refusal is said in one line
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    out = tmp_path / "raised"
    subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=300)
    rank0, rank1, rank2 = (json.loads((tmp_path / f"raised.{rank}").read_text()) for rank in range(3))
    said = "the test could not go on: rank 1: BudgetTooSmall here"
    assert rank0["budget on rank 1"] == rank2["budget on rank 1"] == ["BudgetTooSmall", said, False, []]
    assert rank1["budget on rank 1"] == ["BudgetTooSmall", "BudgetTooSmall here", True, [said]]  # its own, with the note
    assert rank0["setting on rank 1"][:3] == ["SettingRefused", "the test could not go on: rank 1: SettingRefused here", False]
    assert rank0["budget on two ranks"][:3] == ["BudgetTooSmall", f"{said}; rank 2: BudgetTooSmall here", False]
    # failed ranks of different classes: a ValueError where each is one, else a RuntimeError (each failed rank its own)
    assert rank0["value errors of two classes"][0] == "ValueError" and rank1["value errors of two classes"][0] == "SettingRefused"
    assert rank0["a value error and another error"][0] == "RuntimeError" and rank2["a value error and another error"][0] == "KeyError"
