import math

import bitsandbytes as bnb
import torch

from lightning_efficient.memory import (
    SavedTensorCounter,
    distinct_storage_bytes,
    optimizer_state_bytes,
    peak_rss_bytes,
    reset_peak_rss,
)


def _step(optimizer, params):
    sum(p.sum() for p in params).backward()
    optimizer.step()


def test_torch_adamw_state_is_eight_bytes_per_parameter_plus_step_counters():
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(17))]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    _step(optimizer, params)
    numel = sum(p.numel() for p in params)
    step_counters = 4 * len(params)  # one float32 scalar "step" per parameter
    assert optimizer_state_bytes(optimizer) == 8 * numel + step_counters


def test_bitsandbytes_adamw8bit_state_matches_a_hand_count():
    big = torch.nn.Parameter(torch.randn(100, 100))
    small = torch.nn.Parameter(torch.randn(10))
    optimizer = bnb.optim.AdamW8bit([big, small], lr=1e-3)
    _step(optimizer, [big, small])
    blocks = math.ceil(big.numel() / 256)
    hand = 2 * big.numel()  # state1, state2: uint8
    hand += 2 * 4 * blocks  # absmax1, absmax2: float32 per block of 256
    hand += 2 * 256 * 4  # the two quantization maps, shared by every parameter
    hand += 2 * 4 * small.numel()  # a tensor under 4096 elements keeps 32-bit states
    assert optimizer_state_bytes(optimizer) == hand


def test_saved_bytes_of_a_hand_built_graph():
    weight = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 8)
    with SavedTensorCounter(exclude=[weight]) as counter:
        hidden = x @ weight  # saves x (and weight, a parameter: not counted)
        activated = hidden.sin()  # saves hidden
        squared = activated * activated  # saves activated (once: same storage twice)
        loss = squared.sum()
    expected = x.numel() * 4 + hidden.numel() * 4 + activated.numel() * 4
    assert counter.bytes == expected
    loss.backward()
    assert weight.grad.shape == weight.shape


def test_views_of_one_storage_count_once():
    base = torch.zeros(10, 10)
    assert distinct_storage_bytes([base, base[:5], base.t()]) == 400


def test_peak_rss_reset_and_read():
    assert peak_rss_bytes() > 0
    assert reset_peak_rss() is True
    assert peak_rss_bytes() > 0
