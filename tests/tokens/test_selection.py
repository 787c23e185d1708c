import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_efficient.tokens.selection import KeepRatioSchedule, kept_count, select_tokens, threshold_keep


def reference_keep(scores: list[float], valid: list[bool], keep_ratio: float) -> list[bool]:
    """Plain Python: sort the valid scores, VaR at alpha = 1 - r, keep those at or above it."""
    in_scope = sorted(s for s, v in zip(scores, valid) if v)
    if not in_scope:
        return [False] * len(scores)
    alpha = 1.0 - keep_ratio
    var = in_scope[min(len(in_scope) - 1, math.floor(alpha * len(in_scope) + 1e-9))]
    return [v and s >= var for s, v in zip(scores, valid)]


cases = st.integers(1, 60).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(-5, 5).map(float), min_size=n, max_size=n),  # small integers: many ties
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.7, 0.9, 1.0]),
    )
)


@settings(max_examples=150, deadline=None)
@given(cases)
def test_eslm_and_topk_keep_the_value_at_risk_tail(case):
    scores, valid, ratio = case
    losses = torch.tensor(scores).view(1, -1)
    mask = torch.tensor(valid).view(1, -1)
    expected = reference_keep(scores, valid, ratio)
    for method in ("eslm", "topk"):
        got = select_tokens(method, losses, mask, ratio)
        assert got.keep.view(-1).tolist() == expected


@settings(max_examples=100, deadline=None)
@given(cases)
def test_rho1_keeps_the_highest_excess_loss(case):
    scores, valid, ratio = case
    reference = [s * 0.5 - 1 for s in reversed(scores)]
    excess = [s - r for s, r in zip(scores, reference)]
    got = select_tokens(
        "rho1", torch.tensor(scores).view(1, -1), torch.tensor(valid).view(1, -1), ratio,
        reference_losses=torch.tensor(reference).view(1, -1),
    )
    assert got.keep.view(-1).tolist() == reference_keep(excess, valid, ratio)


def test_entropy_score_selects_by_entropy_not_loss():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    entropy = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    got = select_tokens("eslm", losses, valid, 0.5, entropy=entropy, score="entropy")
    assert got.keep.tolist() == [[True, True, False, False]]
    assert got.threshold == 3.0 and got.kept_mean_score == 3.5 and got.dropped_mean_score == 1.5


def test_random_keeps_exactly_the_count_reproducibly_and_only_valid_tokens():
    losses = torch.randn(4, 50)
    valid = torch.rand(4, 50) < 0.8
    a = select_tokens("random", losses, valid, 0.3, generator=torch.Generator().manual_seed(5))
    b = select_tokens("random", losses, valid, 0.3, generator=torch.Generator().manual_seed(5))
    c = select_tokens("random", losses, valid, 0.3, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.keep, b.keep) and not torch.equal(a.keep, c.keep)
    assert int(a.keep.sum()) == kept_count(int(valid.sum()), 0.3)
    assert not torch.any(a.keep & ~valid)


def test_none_keeps_every_valid_token():
    valid = torch.tensor([[True, False, True]])
    assert torch.equal(select_tokens("none", torch.zeros(1, 3), valid, 0.5).keep, valid)


def test_global_scope_uses_the_gathered_scores():
    local = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    others = torch.tensor([10.0, 11.0, 12.0, 13.0])
    got = threshold_keep(local, valid, 0.5, gather=lambda x: torch.cat([x, others]))
    assert not got.keep.any() and got.threshold == 10.0


def test_schedule_warmup_then_ramp():
    schedule = KeepRatioSchedule(end_ratio=0.4, start_ratio=1.0, warmup_steps=10, ramp_steps=6)
    assert [schedule(s) for s in (0, 9)] == [1.0, 1.0]
    assert schedule(10) == 1.0 and math.isclose(schedule(13), 0.7) and schedule(16) == 0.4 and schedule(99) == 0.4


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"method": "best"}, "method='best'"),
        ({"method": "topk", "keep_ratio": 0.0}, "keep_ratio=0.0"),
        ({"method": "topk", "keep_ratio": 1.5}, "keep_ratio=1.5"),
        ({"method": "eslm", "keep_ratio": 0.5, "score": "margin"}, "score='margin'"),
        ({"method": "rho1", "keep_ratio": 0.5}, "reference_losses"),
    ],
)
def test_bad_rule_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        select_tokens(losses=torch.zeros(1, 4), valid=torch.ones(1, 4, dtype=torch.bool), **{"keep_ratio": 0.5, **kwargs})
