"""linear_cross_entropy under bf16 autocast (the backward recomputes what the forward computed) and
with gradients disabled (no gradient work at all)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_efficient import DemoGPT
from lightning_efficient.tokens.linear_ce import linear_cross_entropy
from lightning_efficient.tokens.output import FusedTokenLoss
from tests.conftest import tiny_gpt_kwargs


def _inputs(n=40, d=16, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.5).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_bf16_autocast_gradient_is_that_of_the_bf16_logits(reduction):
    hidden, weight, bias, labels = _inputs()
    upstream = torch.rand(labels.shape) * (labels != -100) if reduction == "none" else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, labels, bias, chunk_size=8, reduction=reduction)
        # the same computation through plain autograd: bf16 matmul logits, float32 softmax
        logits = (hidden @ weight.t()).float() + bias
        reference = F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(ours, (hidden, weight, bias), upstream)
    want = torch.autograd.grad(reference, (hidden, weight, bias), upstream)
    # d loss / d bias is the sum of every token's gradient over the logits: a softmax minus a
    # one-hot sums to zero over the vocabulary, only if the backward's logits are the forward's
    assert abs(float(got[2].double().sum())) <= 1e-5
    torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=2e-2)  # bf16 matmuls on both sides
    torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=2e-2)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls, self.shapes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.matmul):
            self.matmuls += 1
        if isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_gradient_work_when_gradients_are_disabled(mode, reduction):
    hidden, weight, bias, labels = _inputs()
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    ops = _Ops()
    with context, ops:
        out = linear_cross_entropy(hidden, weight, labels, bias, chunk_size=8, reduction=reduction)
    assert ops.matmuls == 5  # one logits matmul per chunk of 8 of the 40 tokens, nothing else
    assert tuple(weight.shape) not in ops.shapes  # no [vocab, d] gradient buffer
    assert out.grad_fn is None
    with torch.no_grad():
        reference = F.cross_entropy(hidden @ weight.t() + bias, labels, ignore_index=-100, reduction=reduction)
    torch.testing.assert_close(out, reference)


def test_fused_output_in_validation_does_no_gradient_work():
    model = DemoGPT(**tiny_gpt_kwargs(), fused_loss=True)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 512, (2, 32), generator=g), "labels": torch.randint(0, 512, (2, 32), generator=g)}
    ops = _Ops()
    with torch.no_grad():
        hidden = model.hidden_states(batch["input_ids"])
        with ops:
            out = FusedTokenLoss(hidden, model.head.weight, batch["labels"])
    assert tuple(model.head.weight.shape) not in ops.shapes
    assert ops.matmuls == 1  # 64 tokens in one chunk: the logits only
    assert torch.isfinite(out["loss"])
