import pytest
import torch
import torch.nn.functional as F

from lightning_efficient.tokens.linear_ce import linear_cross_entropy

TOL64 = 1e-10


def _inputs(n=53, d=12, v=97, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, reduction):
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)


def _grads(out, inputs, grad_out=None):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], grad_out)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 53, 1000, None])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_full_logits_cross_entropy_in_float64(reduction, chunk_size, bias):
    hidden, weight, b, labels = _inputs(bias=bias)
    ours = linear_cross_entropy(hidden, weight, labels, b, chunk_size=chunk_size, reduction=reduction)
    ref = _reference(hidden, weight, b, labels, reduction)
    assert (ours - ref).abs().max() <= TOL64
    upstream = torch.randn_like(ref) if reduction == "none" else None
    for got, want in zip(_grads(ours, (hidden, weight, b), upstream), _grads(ref, (hidden, weight, b), upstream)):
        assert (got - want).abs().max() <= TOL64


@pytest.mark.parametrize("chunk_size", [5, 16, 100])
def test_backward_restricted_to_kept_tokens_equals_the_masked_mean(chunk_size):
    hidden, weight, b, labels = _inputs(n=60)
    keep = torch.rand(60, generator=torch.Generator().manual_seed(1)) < 0.4
    keep &= labels != -100
    losses = linear_cross_entropy(hidden, weight, labels, b, chunk_size=chunk_size)
    ours = (losses * keep).sum() / keep.sum()
    ref_losses = _reference(hidden, weight, b, labels, "none")
    ref = (ref_losses * keep).sum() / keep.sum()
    got = _grads(ours, (hidden, weight, b))
    want = _grads(ref, (hidden, weight, b))
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= TOL64
    assert torch.all(got[0][~keep] == 0)  # dropped tokens: no head backward at all


def test_per_token_shape_entropy_and_ignored_positions():
    hidden, weight, b, labels = _inputs(n=24)
    losses, entropy = linear_cross_entropy(
        hidden.view(4, 6, -1), weight, labels.view(4, 6), b, chunk_size=5, return_entropy=True
    )
    assert losses.shape == (4, 6) and entropy.shape == (4, 6)
    logits = hidden @ weight.t() + b
    ref_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).view(4, 6)
    valid = labels.view(4, 6) != -100
    assert (entropy[valid] - ref_entropy[valid]).abs().max() <= TOL64
    assert torch.all(entropy[~valid] == 0) and torch.all(losses[~valid] == 0)
    assert not entropy.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    hidden, weight, b, labels = _inputs(n=64, d=32, v=300, dtype=torch.float32, seed=3)
    h, w, bb = (t.detach().to(dtype).requires_grad_() for t in (hidden, weight, b))
    ours = linear_cross_entropy(h, w, labels, bb, chunk_size=10)
    assert ours.dtype == torch.float32
    ref = _reference(h.double(), w.double(), bb.double(), labels, "none")
    tol = {torch.float32: 1e-5, torch.bfloat16: 0.05}[dtype]
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)
    ours.sum().backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    ref_grads = _grads(ref.sum(), (h, w, bb))
    torch.testing.assert_close(w.grad.double(), ref_grads[1].double(), atol=tol * 4, rtol=tol * 4)


def test_bad_arguments_are_refused():
    hidden, weight, _b, labels = _inputs()
    with pytest.raises(ValueError, match="reduction='avg'"):
        linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="chunk_size=0"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="labels has"):
        linear_cross_entropy(hidden, weight, labels[:-1])
