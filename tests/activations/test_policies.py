import gc
import os
import stat

import pytest
import torch
from lightning.pytorch.demos import Transformer

from lightning_efficient import DemoGPT
from lightning_efficient._torch import storage_key
from lightning_efficient.activations import DiskOffload, HostOffload, find_blocks, unwrap_block, wrap_block
from tests.conftest import tiny_gpt_kwargs

POLICIES = ["keep", "checkpoint", "selective", "offload", "disk"]


def _demo():
    return DemoGPT(**{**tiny_gpt_kwargs(), "dropout": 0.1, "n_layers": 3}).double().train()


def _demo_loss(model):
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 512, (2, 32), generator=g), "labels": torch.randint(0, 512, (2, 32), generator=g)}
    return model.token_losses(batch)["loss"]


def _transformer():
    return Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.1).double().train()


def _transformer_loss(model):
    g = torch.Generator().manual_seed(0)
    inputs, target = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    return torch.nn.functional.nll_loss(model(inputs, target), target.view(-1))


def _grads(model, loss_fn, seed=123):
    torch.manual_seed(seed)
    model.zero_grad()
    loss_fn(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _exclude(model):
    keys = {storage_key(p) for p in model.parameters()}
    return lambda t: storage_key(t) in keys


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("make", "loss_fn"), [(_demo, _demo_loss), (_transformer, _transformer_loss)], ids=["demo", "lightning_transformer"])
def test_every_policy_gives_the_gradients_of_keep_in_float64_with_dropout(policy, make, loss_fn, tmp_path):
    torch.manual_seed(0)
    model = make()
    reference = _grads(model, loss_fn)
    keys = list(model.state_dict())
    blocks = find_blocks(model)
    disk = DiskOffload(str(tmp_path), min_bytes=0, exclude=_exclude(model))
    host = HostOffload(min_bytes=0, exclude=_exclude(model))
    for index, (_, block) in enumerate(blocks):
        hooks = {"disk": lambda i=index: disk.hooks(i), "offload": lambda i=index: host.hooks(i)}.get(policy)
        wrap_block(block, policy, hooks=hooks)
    got = _grads(model, loss_fn)
    assert list(model.state_dict()) == keys
    for name, grad in reference.items():
        assert (got[name] - grad).abs().max() <= 1e-12, name
    if policy == "disk":
        assert disk.bytes_written > 0
    for _, block in blocks:
        unwrap_block(block)
        assert "forward" not in vars(block)
    disk.close()


def test_disk_files_are_removed_after_backward_and_the_directory_is_private(tmp_path):
    model = _demo()
    disk = DiskOffload(str(tmp_path), min_bytes=0, exclude=_exclude(model))
    for index, (_, block) in enumerate(find_blocks(model)):
        wrap_block(block, "disk", hooks=lambda i=index: disk.hooks(i))
    assert stat.S_IMODE(os.stat(disk.root).st_mode) == 0o700
    loss = _demo_loss(model)
    disk.flush()
    assert len(disk.files()) > 0
    loss.backward()
    del loss
    gc.collect()
    assert disk.files() == []
    disk.close()
    assert not disk.root.exists()


def test_disk_files_are_removed_after_an_exception_in_backward(tmp_path):
    model = _demo()
    disk = DiskOffload(str(tmp_path), min_bytes=0, exclude=_exclude(model))
    for index, (_, block) in enumerate(find_blocks(model)):
        wrap_block(block, "disk", hooks=lambda i=index: disk.hooks(i))

    def fail(grad):
        raise RuntimeError("boom in backward")

    def step():
        loss = _demo_loss(model)
        hidden = model.blocks[1].attn.qkv.weight
        hidden.register_hook(fail)
        loss.backward()

    with pytest.raises(RuntimeError, match="boom in backward"):
        step()
    assert len(disk.files()) > 0  # the traceback still holds the graph ...
    disk.clear()  # ... so the callback's on_exception clears the directory
    assert disk.files() == []
    disk.close()


def test_a_full_disk_names_the_path_and_the_bytes(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from lightning_efficient.activations import DiskFullError

    model = _demo()
    disk = DiskOffload(str(tmp_path), min_bytes=0, exclude=_exclude(model))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100, 90, 10))
    wrap_block(model.blocks[0], "disk", hooks=lambda: disk.hooks(0))
    with pytest.raises(DiskFullError, match=rf"needs [0-9,]+ more bytes at {disk.root} but the disk has 10 free"):
        _demo_loss(model)
    disk.close()


class _DeviceStoragesSeen(DiskOffload):
    """Disk offload that keeps a weak reference to every storage it takes (through a stand-in device: CPU tensors
    copied to "host" by ``_SyncStreams``, as CUDA tensors are to pinned memory) and the pending bytes at each write
    queued."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.storages: list = []
        self.pending_seen: list[int] = []
        self.largest = 0

    def _pack(self, block_index, tensor):
        packed = super()._pack(block_index, tensor)
        if packed is not tensor:
            from torch.multiprocessing.reductions import StorageWeakRef

            self.storages.append(StorageWeakRef(tensor.untyped_storage()))
            self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return packed

    def _submit_write(self, file):
        future = super()._submit_write(file)
        self.pending_seen.append(self._pending)
        return future


def _disk_offloaded(model, disk):
    for index, (_, block) in enumerate(find_blocks(model)):
        wrap_block(block, "disk", hooks=lambda i=index: disk.hooks(i))


def test_disk_offload_lets_each_device_storage_go_once_copied_out_and_writes_only_what_backward_still_needs(tmp_path):
    """A device storage is copied to host memory and no longer held by the disk store, however far behind the
    writer is (on an H200 the writer's backlog held every step's saved tensors on the device: 24 GiB peak against
    7 GiB kept); a file whose block's backward ran before its turn is not written at all."""
    from lightning_efficient.activations.offload import _SyncStreams

    torch.manual_seed(0)
    model = _demo()
    reference = _grads(model, _demo_loss)
    disk = _DeviceStoragesSeen(str(tmp_path), min_bytes=0, exclude=_exclude(model), _streams=_SyncStreams("cpu", pending=True))
    _disk_offloaded(model, disk)
    import threading

    gate = threading.Event()
    disk._writer.submit(gate.wait)  # the writer is busy: nothing is written yet
    try:
        torch.manual_seed(123)
        model.zero_grad()
        loss = _demo_loss(model)
        gc.collect()
        assert disk.storages and all(ref.expired() for ref in disk.storages)  # only the host copies are held
        assert disk.bytes_written == 0 and disk._pending > 0
        loss.backward()
        del loss
        gc.collect()
    finally:
        gate.set()  # the writer thread ends with the test, whatever it asserted
    disk.flush()
    assert disk.bytes_written == 0 and disk.files() == [] and disk._pending == 0  # backward needed none of them
    for name, param in model.named_parameters():
        assert (param.grad - reference[name]).abs().max() <= 1e-12, name
    disk.close()


@pytest.mark.parametrize("stand_in_device", [False, True], ids=["cpu", "stand_in_device"])
def test_disk_offload_keeps_at_most_max_pending_bytes_waiting_for_the_writer(tmp_path, stand_in_device):
    from lightning_efficient.activations.offload import _StorageFile, _SyncStreams

    torch.manual_seed(0)
    model = _demo()
    reference = _grads(model, _demo_loss)
    limit = 100_000  # a few of the tiny demo's saved storages (the largest is 64 KiB)
    streams = {"_streams": _SyncStreams("cpu", pending=True)} if stand_in_device else {}
    disk = _DeviceStoragesSeen(str(tmp_path), min_bytes=0, exclude=_exclude(model), max_pending_bytes=limit, **streams)
    _disk_offloaded(model, disk)
    write = _StorageFile.write

    def slow_write(self, store):  # a disk slower than the forward
        import time

        time.sleep(0.002)
        write(self, store)

    _StorageFile.write = slow_write
    try:
        got = _grads(model, _demo_loss)
    finally:
        _StorageFile.write = write
    assert len(disk.pending_seen) > 5
    assert max(disk.pending_seen) <= max(limit, disk.largest), (max(disk.pending_seen), disk.largest)
    for name, grad in reference.items():
        assert (got[name] - grad).abs().max() <= 1e-12, name
    disk.close()


def test_views_of_one_storage_read_back_from_host_memory_share_one_copy_which_is_then_not_written(tmp_path):
    """A storage read back from host memory before its write (a block whose backward came first) is copied to the
    device once for all its views; the writer then skips it rather than write what backward already has."""
    import threading

    from lightning_efficient.activations.offload import _SyncStreams

    disk = DiskOffload(str(tmp_path), min_bytes=0, _streams=_SyncStreams("cpu", pending=True))
    gate = threading.Event()
    disk._writer.submit(gate.wait)
    try:
        x = torch.randn(4, 6)
        whole, view = disk._pack(0, x), disk._pack(0, x[1:])
        first = disk._unpack(0, whole)
    finally:
        gate.set()
    disk.flush()
    second = disk._unpack(0, view)
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert torch.equal(first, x) and torch.equal(second, x[1:])
    assert disk.bytes_written == 0 and disk.files() == []
    disk.close()


def test_a_writer_failure_other_than_a_full_disk_is_raised_on_the_training_thread(tmp_path):
    from lightning_efficient.activations.offload import _SyncStreams

    class _CudaErrorAtTheCopy(_SyncStreams):
        def wait_on_host(self, event):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    model = _demo()
    disk = DiskOffload(str(tmp_path), min_bytes=0, exclude=_exclude(model), _streams=_CudaErrorAtTheCopy("cpu"))
    _disk_offloaded(model, disk)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _demo_loss(model).backward()
        disk.check(wait=True)
    assert disk._pending == 0
    disk.close()


def test_disk_offload_refuses_a_max_pending_bytes_under_one(tmp_path):
    with pytest.raises(ValueError, match="max_pending_bytes"):
        DiskOffload(str(tmp_path), max_pending_bytes=0)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy='swap'"):
        wrap_block(torch.nn.Linear(2, 2), "swap")


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=100, use_cache=False)
    return transformers.LlamaForCausalLM(config).double().train()


def _llama_loss(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_layers_called_with_keywords_checkpoint_to_the_gradients_of_keep(reentrant):
    torch.manual_seed(0)
    model = _llama()
    reference = _grads(model, _llama_loss)
    for _, block in find_blocks(model):
        wrap_block(block, "checkpoint", reentrant=reentrant)
    got = _grads(model, _llama_loss)
    for name, grad in reference.items():
        assert (got[name] - grad).abs().max() <= 1e-12, name


class _KeywordBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, *, scale, pair):
        return torch.tanh(self.lin(x) * scale + pair[0]) * pair[1]


@pytest.mark.parametrize("reentrant", [False, True])
def test_tensors_passed_by_keyword_and_nested_get_their_gradients_under_checkpoint(reentrant):
    torch.manual_seed(0)
    block = _KeywordBlock().double()
    inputs = [torch.randn(3, 8, dtype=torch.float64, requires_grad=True) for _ in range(4)]

    def grads():
        for t in [*inputs, *block.parameters()]:
            t.grad = None
        x, scale, a, b = inputs
        block(x, scale=scale, pair=(a, b)).pow(2).sum().backward()
        return [t.grad.clone() for t in [*inputs, *block.parameters()]]

    reference = grads()
    wrap_block(block, "checkpoint", reentrant=reentrant)
    got = grads()
    for want, have in zip(reference, got):
        assert (have - want).abs().max() <= 1e-12


class _SavesOneTensorManyTimes(torch.nn.Module):
    """``h`` is saved by sin and cos, and two views of it (a chunk, a transposed chunk) by two more ops."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x):
        h = self.lin(x)
        a, b = h.chunk(2, dim=-1)
        return torch.sin(h) + torch.cos(h) + torch.cat([torch.sin(a), torch.cos(b.t()).t()], dim=-1)


def test_disk_writes_a_storage_saved_several_times_once_and_restores_its_views(tmp_path):
    from lightning_efficient.memory import SavedTensorCounter

    torch.manual_seed(0)
    block = _SavesOneTensorManyTimes().double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)

    def grads():
        for t in [x, *block.parameters()]:
            t.grad = None
        block(x).pow(2).sum().backward()
        return [t.grad.clone() for t in [x, *block.parameters()]]

    reference = grads()
    with SavedTensorCounter(exclude=list(block.parameters())) as counter:
        block(x)
    assert counter.bytes == 5 * 8 * 8 + 5 * 16 * 8  # x and h, each once
    disk = DiskOffload(str(tmp_path), min_bytes=0, exclude=_exclude(block))
    wrap_block(block, "disk", hooks=lambda: disk.hooks(0))
    out = block(x)
    disk.flush()
    assert len(disk.files()) == 2 and disk.bytes_written == counter.bytes
    del out
    got = grads()
    for want, have in zip(reference, got):
        assert (have - want).abs().max() <= 1e-12
    disk.close()


class _NormBlock(torch.nn.Module):
    """A residual block with BatchNorm over its features (its running statistics change in training)."""

    def __init__(self, width: int = 8, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width, momentum=momentum)

    def forward(self, x):
        return x + torch.relu(self.norm(self.linear(x)))


@pytest.mark.parametrize("momentum", [0.1, None])  # None: a cumulative average over num_batches_tracked
@pytest.mark.parametrize(("policy", "reentrant"), [("checkpoint", False), ("checkpoint", True), ("selective", False)])
def test_recomputing_a_block_updates_its_running_statistics_once_as_keep_does(policy, reentrant, momentum):
    # torch's checkpoint runs the block's forward again in backward, in training mode: a BatchNorm would update its
    # running statistics twice and count the batch twice
    torch.manual_seed(0)
    reference = torch.nn.Sequential(_NormBlock(momentum=momentum), _NormBlock(momentum=momentum)).double().train()
    wrapped = torch.nn.Sequential(_NormBlock(momentum=momentum), _NormBlock(momentum=momentum)).double().train()
    wrapped.load_state_dict(reference.state_dict())
    for block in wrapped:
        wrap_block(block, policy, reentrant=reentrant)
    for step in range(3):
        x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step), requires_grad=True)
        for model in (reference, wrapped):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        for (name, expected), got in zip(reference.state_dict().items(), wrapped.state_dict().values()):
            assert torch.equal(got, expected), (step, name)
        for (name, p), q in zip(reference.named_parameters(), wrapped.parameters()):
            assert (p.grad - q.grad).abs().max() <= 1e-12, (step, name)


def _gradients(tensors, loss):
    """The gradients ``loss()`` gives ``tensors`` (cleared first), cloned."""
    tensors = list(tensors)
    for t in tensors:
        t.grad = None
    loss().backward()
    return [t.grad.clone() for t in tensors]


class _DictOutputBlock(torch.nn.Module):
    """Returns its output inside a dict, with a non-tensor beside it (as a Hugging Face ``ModelOutput`` may)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return {"hidden": (torch.tanh(self.lin(x)), None), "layer": 3}


@pytest.mark.parametrize("policy", ["checkpoint", "selective"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_block_returning_its_tensors_in_a_dict_gets_the_gradients_of_keep(policy, reentrant):
    # a new user's trial: reentrant checkpointing returned the dict untracked, and the block's parameters got no gradient
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_DictOutputBlock() for _ in range(2)]).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)

    def loss():
        h = x
        for block in blocks:
            out = block(h)
            assert out["layer"] == 3 and out["hidden"][1] is None
            h = h + out["hidden"][0]
        return h.pow(2).sum()

    reference = _gradients([x, *blocks.parameters()], loss)
    for block in blocks:
        wrap_block(block, policy, reentrant=reentrant)
    for want, have in zip(reference, _gradients([x, *blocks.parameters()], loss)):
        assert (have - want).abs().max() <= 1e-12


def test_reentrant_checkpoint_of_a_block_whose_inputs_require_no_grad_is_refused_not_left_without_gradients():
    # a new user's trial: below a frozen embedding torch's reentrant checkpoint gave the block's weights no gradient
    block = torch.nn.Linear(8, 8)
    wrap_block(block, "checkpoint", reentrant=True)
    with pytest.raises(ValueError, match=r"reentrant=True: the inputs of the checkpointed Linear require no grad"):
        block(torch.randn(2, 8))
    block.requires_grad_(False)  # a frozen block: nothing to lose
    assert block(torch.randn(2, 8)).shape == (2, 8)


class _NoTensorOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append(self.lin(x))  # a side effect: nothing the checkpoint can track
        return None


def test_reentrant_checkpoint_of_a_block_returning_no_tensor_is_refused_not_left_without_gradients():
    block = _NoTensorOutput()
    wrap_block(block, "checkpoint", reentrant=True)
    with pytest.raises(ValueError, match=r"reentrant=True: the checkpointed _NoTensorOutput returns no tensor"):
        block(torch.randn(2, 8, requires_grad=True))


class _TwiceAndInteger(torch.nn.Module):
    """Returns one tensor twice, an integer tensor and its input passed through."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, {"again": h, "count": torch.tensor(3), "input": x}


def test_reentrant_outputs_repeated_integer_or_passed_through_get_the_gradients_of_keep():
    torch.manual_seed(0)
    block = _TwiceAndInteger().double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)

    def loss():
        h, extra = block(x)
        assert int(extra["count"]) == 3
        return h.pow(2).sum() + extra["again"].sum() + extra["input"].sum()

    reference = _gradients([x, *block.parameters()], loss)
    wrap_block(block, "checkpoint", reentrant=True)
    for want, have in zip(reference, _gradients([x, *block.parameters()], loss)):
        assert (have - want).abs().max() <= 1e-12
