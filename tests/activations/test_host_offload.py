"""HostOffload's logic on CPU through its synchronous stream stand-in, and its CUDA path where CUDA exists.

On CPU, ``_SyncStreams("cpu", pending=True)`` plays the side streams: a CPU tensor's "host copy" is a
second CPU tensor, and a copy's event stays unfinished until the compute side waits for it, as a
side stream's copy would while the host runs ahead. Copies and bytes each way are counted.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_efficient import DemoGPT
from lightning_efficient._torch import storage_key
from lightning_efficient.activations import DiskOffload, HostOffload, find_blocks, unwrap_block, wrap_block
from lightning_efficient.activations.offload import _SyncStreams
from tests.conftest import tiny_gpt_kwargs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _exclude(model: nn.Module):
    keys = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    return lambda t: storage_key(t) in keys


def _stack(n_blocks: int = 4, width: int = 16) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.Tanh())
        for _ in range(n_blocks)
    ).double()


def _forward(blocks: nn.ModuleList, host: HostOffload | None, x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
    for index, block in enumerate(blocks):
        with host.hooks(index) if host is not None else contextlib.nullcontext():
            x = block(x)
        if keep is not None:
            keep.append(x)
    return x


def _input(width: int = 16) -> torch.Tensor:
    return torch.randn(8, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _grads(blocks: nn.ModuleList, host: HostOffload | None) -> list[torch.Tensor]:
    blocks.zero_grad()
    _forward(blocks, host, _input()).pow(2).sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


def _host(model: nn.Module, max_in_flight: int = 4, pending: bool = True, min_bytes: int = 0) -> HostOffload:
    return HostOffload(min_bytes, exclude=_exclude(model), max_in_flight=max_in_flight,
                       _streams=_SyncStreams("cpu", pending=pending))


@pytest.mark.parametrize("max_in_flight", [1, 3])
def test_the_device_storages_held_for_copies_in_flight_are_bounded_and_drained(max_in_flight):
    blocks = _stack()
    host = _host(blocks, max_in_flight=max_in_flight)
    streams = host._streams
    out = _forward(blocks, host, _input())
    # every block saves 4 storages (its input is the previous block's saved output: 3 new ones after the first)
    assert streams.copies_to_host == 4 + 3 * 3
    assert host.held_on_device == max_in_flight  # not every storage whose copy the host never saw finish
    # each storage let go first had the compute side wait for its copy out
    assert streams.waits == streams.copies_to_host - max_in_flight
    out.pow(2).sum().backward()
    assert host.held_on_device == 0 and host._stash == []
    assert streams.copies_to_device + host.reused == streams.copies_to_host


class _Branching(nn.Module):
    """A block that also saves tensors for a branch the loss never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.branch = self.unused(x).sin()  # its saved input is never asked for in backward
        return self.used(x).tanh()


def test_stashed_storages_backward_never_asks_for_are_released_below_their_block_and_at_the_end():
    blocks = nn.ModuleList(_Branching() for _ in range(2)).double()
    host = _host(blocks, max_in_flight=100)
    x = _input().requires_grad_()
    stashed_blocks: list[list[int]] = []
    # x's gradient is ready after block 0's backward: block 1's leftover must be gone by then
    x.register_hook(lambda grad: stashed_blocks.append(sorted({s.block for s in host._stashed()})))
    _forward(blocks, host, x).sum().backward()
    assert stashed_blocks == [[0]]
    assert host.held_on_device == 0  # block 0's leftover too, at the end of backward
    assert all(block.branch.grad_fn is not None for block in blocks)  # though still referenced


def test_a_storage_still_in_the_stash_is_reused_in_backward_not_copied_back():
    blocks = _stack()
    host = _host(blocks, max_in_flight=3)
    streams = host._streams
    _forward(blocks, host, _input()).pow(2).sum().backward()
    assert host.reused == 3  # the last three storages saved are the first backward needs
    assert streams.copies_to_device == streams.copies_to_host - 3
    assert streams.bytes_to_device < streams.bytes_to_host


def test_a_saved_tensor_still_alive_on_the_device_is_reused_not_copied_back():
    blocks = _stack()
    host = _host(blocks, max_in_flight=1)
    streams = host._streams
    outputs: list[torch.Tensor] = []  # each block's output stays referenced outside the hooks
    _forward(blocks, host, _input(), keep=outputs).pow(2).sum().backward()
    # per block the tanh output (saved by tanh and by the next block's first linear) is still alive:
    # 4 storages of 13 are reused (one of them from the stash), 9 come back from the host
    assert streams.copies_to_host == 13
    assert host.reused == 4
    assert streams.copies_to_device == 9


def test_gradients_are_those_of_keep_with_every_stash_bound_and_event_timing():
    blocks = _stack()
    reference = _grads(blocks, None)
    for max_in_flight in (1, 2, 100):
        for pending in (True, False):
            got = _grads(blocks, _host(blocks, max_in_flight=max_in_flight, pending=pending))
            for expected, actual in zip(reference, got):
                assert torch.equal(expected, actual), (max_in_flight, pending)


def test_a_retained_graph_comes_back_from_the_host_in_a_second_backward():
    blocks = _stack()
    reference = _grads(blocks, None)
    host = _host(blocks, max_in_flight=2)
    blocks.zero_grad()
    loss = _forward(blocks, host, _input()).pow(2).sum()
    loss.backward(retain_graph=True)
    first = host._streams.copies_to_device
    loss.backward()
    assert host.held_on_device == 0
    assert host._streams.copies_to_device == first + host._streams.copies_to_host  # every storage, from the host
    for expected, param in zip(reference, blocks.parameters()):
        assert torch.equal(2 * expected, param.grad)


def test_a_lower_block_whose_storages_all_died_does_not_break_the_next_backward():
    # a first forward offloads blocks 0 and 1 and its graph is dropped without backward (an
    # exception, a skipped step): block 0 keeps an entry whose storages are all dead; a second
    # forward offloads block 1 only, and entering block 1 in backward looks for the next block below
    blocks = _stack(n_blocks=2)
    reference = _grads(blocks, None)
    host = _host(blocks, max_in_flight=1)
    dropped = _forward(blocks, host, _input())
    del dropped
    assert host._by_block[0] and all(ref() is None for ref in host._by_block[0])  # an entry, all dead
    blocks.zero_grad()
    x = blocks[0](_input())  # block 0 without hooks this time
    with host.hooks(1):
        x = blocks[1](x)
    x.pow(2).sum().backward()  # raised "dictionary changed size during iteration" before
    for expected, param in zip(reference, blocks.parameters()):
        assert torch.equal(expected, param.grad)
    assert 0 not in host._by_block and host.held_on_device == 0


def _transformer():
    return Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.1).double().train()


def _transformer_loss(model):
    g = torch.Generator().manual_seed(0)
    inputs, target = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    return torch.nn.functional.nll_loss(model(inputs, target), target.view(-1))


def _demo():
    return DemoGPT(**{**tiny_gpt_kwargs(), "dropout": 0.1, "n_layers": 3}).double().train()


def _demo_loss(model):
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 512, (2, 32), generator=g), "labels": torch.randint(0, 512, (2, 32), generator=g)}
    return model.token_losses(batch)["loss"]


def _model_grads(model, loss_fn):
    torch.manual_seed(123)  # the same dropout masks
    model.zero_grad()
    loss_fn(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("make", "loss_fn"), [(_transformer, _transformer_loss), (_demo, _demo_loss)],
                         ids=["lightning_transformer", "demo_gpt"])
def test_transformer_gradients_with_host_offload_equal_keep_in_float64(make, loss_fn):
    torch.manual_seed(0)
    model = make()
    reference = _model_grads(model, loss_fn)
    host = _host(model, max_in_flight=2)
    blocks = find_blocks(model)
    for index, (_, block) in enumerate(blocks):
        wrap_block(block, "offload", hooks=lambda i=index: host.hooks(i))
    got = _model_grads(model, loss_fn)
    for _, block in blocks:
        unwrap_block(block)
    assert host._streams.copies_to_host > 0 and host._streams.copies_to_device > 0
    for name, grad in reference.items():
        assert (got[name] - grad).abs().max() <= 1e-12, name


def test_a_storage_saved_twice_or_through_views_travels_once_and_comes_back_with_its_strides():
    weight = torch.randn(12, 12, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 12, dtype=torch.float64)
    host = HostOffload(0, max_in_flight=1, _streams=_SyncStreams("cpu", pending=True))
    with host.hooks(0):
        base = x @ weight  # [6, 12]: q and k are views of it at offsets 0 and 6, transposed
        q, k = base[:, :6], base[:, 6:]
        twice = q.t() * q.t()  # saves the same non-contiguous view twice
        scores = torch.mm(q.t(), k)  # saves a transposed view and an offset view
        pushed = (x @ weight).exp()  # a later storage pushes base's out of the stash (max_in_flight=1)
    streams = host._streams
    assert streams.copies_to_host == 3  # x (saved by the matmul), base once, pushed's exp
    assert streams.bytes_to_host == x.nbytes + base.untyped_storage().nbytes() + pushed.nbytes
    saved = {
        "twice.self": (twice.grad_fn._saved_self, q.t()),
        "twice.other": (twice.grad_fn._saved_other, q.t()),
        "scores.self": (scores.grad_fn._saved_self, q.t()),
        "scores.mat2": (scores.grad_fn._saved_mat2, k),
    }
    # base's storage came back once, for all four views (x, still alive, was not copied back)
    assert streams.copies_to_device == 1
    storages = set()
    for name, (restored, original) in saved.items():
        assert restored.shape == original.shape and restored.stride() == original.stride(), name
        assert restored.storage_offset() == original.storage_offset(), name
        assert torch.equal(restored, original), name
        storages.add(restored.untyped_storage().data_ptr())
    assert len(storages) == 1 and base.untyped_storage().data_ptr() not in storages  # one copy back, from the host
    (twice.sum() + scores.sum() + pushed.sum()).backward()
    reference = weight.detach().clone().requires_grad_()
    ref_base = x @ reference
    ref_q, ref_k = ref_base[:, :6], ref_base[:, 6:]
    ((ref_q.t() * ref_q.t()).sum() + torch.mm(ref_q.t(), ref_k).sum() + (x @ reference).exp().sum()).backward()
    assert torch.equal(weight.grad, reference.grad)


def test_tensors_under_min_bytes_stay():
    blocks = _stack(n_blocks=2)
    x = _input()
    small = 8 * 16 * 8  # the block inputs and outputs; the hidden activations are twice as large
    host = _host(blocks, min_bytes=small + 1)
    _forward(blocks, host, x).sum().backward()
    assert host._streams.copies_to_host == 2 * 2  # per block: the hidden linear's output and the GELU's
    assert host._streams.bytes_to_host == 4 * 2 * small


class _Recording(HostOffload):
    """HostOffload that remembers each saved tensor and whether it was moved."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[torch.Tensor, bool]] = []

    def _pack(self, block_index, tensor):
        packed = super()._pack(block_index, tensor)
        self.seen.append((tensor, packed is not tensor))
        return packed


class _RecordingDisk(DiskOffload):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[torch.Tensor, bool]] = []

    def _pack(self, block_index, tensor):
        packed = super()._pack(block_index, tensor)
        self.seen.append((tensor, packed is not tensor))
        return packed


def _weight_copy(tensor: torch.Tensor, model: nn.Module) -> str | None:
    """The parameter whose low-precision copy (or its transpose) ``tensor`` is, if any."""
    for name, p in model.named_parameters():
        for candidate in (p.detach().to(torch.bfloat16), p.detach().to(torch.bfloat16).t()):
            if tensor.dtype == candidate.dtype and tensor.shape == candidate.shape and torch.equal(tensor.detach(), candidate):
                return name
    return None


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_parameters_and_autocast_weight_copies_are_not_moved_under_bf16_autocast(kind, tmp_path):
    torch.manual_seed(0)
    # widths chosen so that no activation has a weight's shape
    model = nn.ModuleList(nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24)) for _ in range(2))
    exclude = _exclude(model)
    if kind == "host":
        offload = _Recording(0, exclude=exclude, _streams=_SyncStreams("cpu", pending=True))
    else:
        offload = _RecordingDisk(str(tmp_path), min_bytes=0, exclude=exclude)
    x = torch.randn(5, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _forward(model, offload, x)
    out.float().sum().backward()
    params = {storage_key(p) for p in model.parameters()}
    weight_copies = [(t, moved) for t, moved in offload.seen if _weight_copy(t, model) is not None]
    # one saved bf16 copy (transposed) per linear but the first, whose input needs no gradient
    assert len(weight_copies) == 3
    assert not any(moved for _, moved in weight_copies)
    assert not any(moved for t, moved in offload.seen if storage_key(t) in params)
    activations = [(t, moved) for t, moved in offload.seen
                   if storage_key(t) not in params and _weight_copy(t, model) is None]
    assert activations and all(moved for _, moved in activations)
    if kind == "disk":
        offload.close()


def test_the_copy_of_an_input_that_requires_grad_is_moved_and_any_parameters_copy_stays():
    """Only casts of parameters (or of excluded tensors) stay: an input's autocast copy is an
    activation. A parameter ``exclude`` does not name (FSDP2's unsharded one) is recognised too."""
    model = nn.Linear(24, 40)
    host = _Recording(0, exclude=lambda t: False, _streams=_SyncStreams("cpu"))
    x = torch.randn(5, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), host.hooks(0):
        model(x).float().sum().backward()
    assert [moved for t, moved in host.seen if t.shape == (5, 24)] == [True]
    assert [moved for t, moved in host.seen if _weight_copy(t, model) is not None] == [False]


def test_host_offload_arguments_are_validated():
    with pytest.raises(ValueError, match="max_in_flight=0 is not allowed"):
        HostOffload(max_in_flight=0)
    with pytest.raises(ValueError, match="min_bytes=-1 is not allowed"):
        HostOffload(min_bytes=-1)
    with pytest.raises(ValueError, match="use_streams='yes' is not allowed"):
        HostOffload(use_streams="yes")


# -- the real path ---------------------------------------------------------------------------------


def _cuda_stack(n_blocks: int = 8, width: int = 1024) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(n_blocks)
    ).to("cuda", torch.float64)


def _cuda_step(blocks: nn.ModuleList, x: torch.Tensor, host: HostOffload | None) -> tuple[int, list[torch.Tensor]]:
    blocks.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _forward(blocks, host, x).pow(2).mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, [p.grad.clone() for p in blocks.parameters()]


@needs_cuda
@pytest.mark.parametrize("use_streams", [True, False])
def test_on_cuda_the_peak_with_offload_is_at_most_keeps_and_gradients_match(use_streams):
    blocks = _cuda_stack()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.float64)
    _cuda_step(blocks, x, None)  # warm-up: cuBLAS workspace and allocator pools
    keep_peak, keep_grads = _cuda_step(blocks, x, None)
    host = HostOffload(min_bytes=2**20, use_streams=use_streams, exclude=_exclude(blocks))
    _cuda_step(blocks, x, host)
    peak, grads = _cuda_step(blocks, x, host)
    assert host.bytes_offloaded > 0 and host.held_on_device == 0
    assert peak <= keep_peak, (peak, keep_peak)
    for expected, actual in zip(keep_grads, grads):
        assert (expected - actual).abs().max().item() <= 1e-12


@needs_cuda
def test_on_cuda_autocast_weight_copies_stay_and_activations_leave():
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(2)).cuda()
    host = _Recording(0, exclude=_exclude(blocks))
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = _forward(blocks, host, x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    copies = [moved for t, moved in host.seen if _weight_copy(t, blocks) is not None]
    assert len(copies) == 3 and not any(copies)
    assert any(moved for _, moved in host.seen)
