"""AutoFit's budgets: per device, per rank, 'auto'."""

import pytest
import torch

from lightning_efficient.autofit.budget import AUTO_RESERVE, auto_budget, rank_budget, validate_budget


def test_sizes_lists_and_auto_resolve_per_rank():
    cpu = torch.device("cpu")
    assert rank_budget("1GiB", 0, 2, cpu) == 2**30
    assert rank_budget(1000, 1, 2, cpu) == 1000
    assert [rank_budget(["1GiB", "500MB"], r, 2, cpu) for r in range(2)] == [2**30, 500 * 10**6]
    with pytest.raises(ValueError, match="has 2 entries, but this fit runs 3 ranks: give one budget per rank"):
        rank_budget(["1GiB", "500MB"], 0, 3, cpu)
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    one, two = auto_budget(cpu, 1), auto_budget(cpu, 2)
    assert 0 < two < one <= available * (1 - AUTO_RESERVE) * 1.05
    assert rank_budget("auto", 0, 1, cpu) > 0
    # "auto" in a list is that rank's own (a new user's ["auto", "1GiB"] was refused by a message allowing it)
    for budget in (["auto"], ["auto", "1GiB"], ("1GiB", "auto")):
        validate_budget(budget)
    assert 0.9 < rank_budget(["auto", "1GiB"], 0, 2, cpu, local_ranks=2) / two < 1.1
    assert rank_budget(["auto", "1GiB"], 1, 2, cpu, local_ranks=2) == 2**30


@pytest.mark.parametrize("budget", [0, -5, "0GiB", "lots", 1.5, True, [], ["auto", "lots"], [["1GiB"]], None])
def test_bad_budgets_are_refused_naming_the_argument(budget):
    with pytest.raises(ValueError, match=r"budget=.* is not allowed"):
        validate_budget(budget)
