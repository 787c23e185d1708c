"""Host-offloaded and paged 8-bit optimizer states: the copy schedule, exactness, resumes.

On CPU the offload runs its whole schedule with :class:`SyncCopies` (synchronous copies that log
every operation); paging is driven through a bitsandbytes paged optimizer whose buffers are marked
paged the way ``bitsandbytes.functional.get_paged`` marks them. The real CUDA paths are tested
where CUDA exists.
"""

import io

import bitsandbytes as bnb
import lightning
import pytest
import torch

from lightning_efficient import EightBitOptimizer
from lightning_efficient.optim.offload import (
    MAX_WRITES_IN_FLIGHT,
    SyncCopies,
    host_offloaded,
    repage_states,
    repaged_on_load,
)
from lightning_efficient.resumable import EpochShuffleSampler, ResumableDataLoader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# two 8-bit states (>= 4096 elements), one 32-bit (small), one more 8-bit: the order matters for prefetching
SHAPES = [(80, 96), (7,), (5000,), (64, 80)]


def _params(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in SHAPES]


def _grads(step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g).to(device) for shape in SHAPES]


def _run(optimizer, params, steps, first=0):
    for step in range(first, first + steps):
        for p, grad in zip(params, _grads(step, params[0].device)):
            p.grad = grad.clone()
        optimizer.step()


def _moved_to_the_device(optimizer):
    """What Lightning's ``load_optimizer_state_dict`` does right after ``load_state_dict``: every state
    tensor moved to the device, as a new ordinary tensor (on CPU a clone stands for the device copy)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.clone()


def _saved(optimizer):
    """The optimizer's state_dict through torch.save and torch.load, as a checkpoint holds it."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


CLASSES = [(bnb.optim.AdamW8bit, {"lr": 1e-2, "weight_decay": 0.1}), (bnb.optim.SGD8bit, {"lr": 1e-2, "momentum": 0.9})]


@pytest.mark.parametrize(("cls", "kwargs"), CLASSES, ids=[c.__name__ for c, _ in CLASSES])
def test_offloaded_states_step_bitwise_like_plain_8bit_and_stay_in_their_host_buffers(cls, kwargs):
    plain_params, params = _params(), _params()
    plain = cls(plain_params, **kwargs)
    offloaded = host_offloaded(cls)(params, **kwargs)
    offloaded._copies = {torch.device("cpu"): SyncCopies()}
    buffers = None
    for step in range(5):
        _run(plain, plain_params, 1, step)
        _run(offloaded, params, 1, step)
        # between steps every per-parameter state is its host buffer: the same tensors every step
        states = {(i, k): v for i, p in enumerate(params) for k, v in offloaded.state[p].items() if torch.is_tensor(v)}
        movable = {key: v for key, v in states.items() if not key[1].startswith("qmap")}
        assert movable and all(v is offloaded._host_states[id(params[i])][k] for (i, k), v in movable.items())
        pointers = {key: v.data_ptr() for key, v in movable.items()}
        assert buffers is None or pointers == buffers
        buffers = pointers
    for p, q in zip(plain_params, params):
        assert torch.equal(p, q)
    assert offloaded.state[params[0]]["state1"].dtype == torch.uint8  # 8-bit states really were offloaded
    for p, q in zip(plain_params, params):
        for key, value in plain.state[p].items():
            assert torch.equal(value, offloaded.state[q][key]) if torch.is_tensor(value) else value == offloaded.state[q][key]


class _LoggedUpdates(host_offloaded(bnb.optim.AdamW8bit)):
    """Adds each update to the copies' log, to check the order of copies, waits and updates."""

    def update_step(self, group, p, gindex, pindex):
        self._copies_for(p.device).log.append(("update", pindex, 0))
        super().update_step(group, p, gindex, pindex)


def test_each_update_waits_for_its_own_copy_only_and_the_host_waits_once_per_step():
    params = _params()
    optimizer = _LoggedUpdates(params, lr=1e-2)
    optimizer._copies = {torch.device("cpu"): (copies := SyncCopies())}
    _run(optimizer, params, 1)  # states are made on the device at the first step, then written back
    assert [op for op, *_ in copies.log].count("to_device") == 0
    copies.log.clear()
    _run(optimizer, params, 1)
    log = copies.log
    ops = [op for op, *_ in log]
    assert ops.count("finish") == 1 and ops[-1] == "finish"  # one wait for the whole step, at its end
    updates = [i for i, (op, *_) in enumerate(log) if op == "update"]
    fetches = [i for i, (op, *_) in enumerate(log) if op == "to_device"]
    uses = [i for i, (op, *_) in enumerate(log) if op == "use"]
    writes = [i for i, (op, *_) in enumerate(log) if op == "to_host"]
    assert len(updates) == len(fetches) == len(uses) == len(writes) == len(SHAPES)
    for n, update in enumerate(updates):
        # the update waits for the event of its own parameter's copy in, issued for it
        assert log[uses[n]][1] == log[fetches[n]][1] and uses[n] < update
        # the copy back is issued after the update; the next parameter's copy in was started earlier
        assert writes[n] > update
        if n + 1 < len(updates):
            assert fetches[n + 1] < update
    # the host waits for the oldest copy back only when more than MAX_WRITES_IN_FLIGHT are in flight
    waited = [event for op, event, _ in log if op == "wait_host"]
    written = [event for op, event, _ in log if op == "to_host"]
    assert waited == written[: len(written) - MAX_WRITES_IN_FLIGHT]
    for position, event in enumerate(waited):
        index = next(i for i, (op, e, _) in enumerate(log) if op == "wait_host" and e == event)
        assert sum(1 for op, *_ in log[:index] if op == "to_host") == position + MAX_WRITES_IN_FLIGHT + 1


def test_each_device_gets_its_own_copies():
    # one CudaCopies (streams of one device) for every parameter would order copies and updates of a
    # parameter on another device on the wrong device's streams
    optimizer = host_offloaded(bnb.optim.AdamW8bit)(_params(), lr=1e-2)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert optimizer._copies_for(cpu) is optimizer._copies_for(cpu)
    assert optimizer._copies_for(meta) is not optimizer._copies_for(cpu)
    assert set(optimizer._copies) == {cpu, meta}


@pytest.mark.parametrize("first", ["offloaded", "plain"])
def test_an_offloaded_resume_equals_the_uninterrupted_run(first):
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    whole = _params()
    uninterrupted = host_offloaded(bnb.optim.AdamW8bit)(whole, **kwargs)
    _run(uninterrupted, whole, 6)

    params = _params()
    before = (host_offloaded(bnb.optim.AdamW8bit) if first == "offloaded" else bnb.optim.AdamW8bit)(params, **kwargs)
    _run(before, params, 3)
    checkpoint = _saved(before)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = host_offloaded(bnb.optim.AdamW8bit)(resumed_params, **kwargs)
    resumed._copies = {torch.device("cpu"): SyncCopies()}
    resumed.load_state_dict(checkpoint)
    # the loaded states are in their host buffers at once (not left where loading put them)
    assert _in_host_buffers(resumed, resumed_params)
    # Lightning then moves them to the device: the first step puts them back before any update, so
    # every parameter's state is fetched from its host buffer
    _moved_to_the_device(resumed)
    assert not _in_host_buffers(resumed, resumed_params)
    _run(resumed, resumed_params, 1, first=3)
    assert [op for op, *_ in resumed._copies[torch.device("cpu")].log].count("to_device") == len(SHAPES)
    assert _in_host_buffers(resumed, resumed_params)
    _run(resumed, resumed_params, 2, first=4)
    for p, q in zip(whole, resumed_params):
        assert torch.equal(p, q)


def _in_host_buffers(optimizer, params):
    return all(value is optimizer._host_states[id(p)][key] for p in params
               for key, value in optimizer.state[p].items() if torch.is_tensor(value) and not key.startswith("qmap"))


def test_settling_puts_states_moved_to_the_device_back_in_their_host_buffers():
    params = _params()
    optimizer = host_offloaded(bnb.optim.AdamW8bit)(params, lr=1e-2)
    _run(optimizer, params, 2)
    values = {(id(p), k): v.clone() for p in params for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
    _moved_to_the_device(optimizer)
    optimizer.settle_loaded_states()  # what EightBitOptimizer calls at train start
    assert _in_host_buffers(optimizer, params)
    assert all(torch.equal(optimizer.state[p][k], values[(id(p), k)]) for p in params for k in optimizer._host_states[id(p)])


class _FakePagedAdamW8bit(bnb.optim.PagedAdamW8bit):
    """bitsandbytes' paged AdamW whose large buffers are host tensors marked paged, as ``get_paged``
    marks its managed-memory tensors (CUDA's managed memory does not exist on CPU)."""

    def get_state_buffer(self, p, dtype=torch.float32):
        if p.numel() < 4096:
            return torch.zeros_like(p, dtype=dtype, device=p.device)
        buffer = torch.zeros(p.shape, dtype=dtype)
        buffer.is_paged = True
        self.page_mng.paged_tensors.append(buffer)  # as bitsandbytes registers a paged buffer
        return buffer

    def prefetch_state(self, p):
        pass  # cudaMemPrefetchAsync has nothing to do on CPU


@pytest.fixture
def page_manager():
    """bitsandbytes' process-wide page manager, left as the test found it."""
    manager = bnb.functional.GlobalPageManager.get_instance()
    before = list(manager.paged_tensors)
    yield manager
    manager.paged_tensors[:] = before


def _paged_states(optimizer):
    """Which states are paged buffers (held by the page manager: a loaded tensor keeps a stale ``is_paged``)."""
    registered = {id(t) for t in optimizer.page_mng.paged_tensors}
    return {(i, key): id(optimizer.state[p][key]) in registered
            for i, p in enumerate(optimizer.param_groups[0]["params"]) for key in ("state1", "state2")}


def test_states_loaded_into_a_paged_optimizer_are_paged_again_with_their_values(page_manager):
    params = _params()
    before = _FakePagedAdamW8bit(params, lr=1e-2)
    _run(before, params, 3)
    paged = _paged_states(before)
    assert any(paged.values()) and not all(paged.values())  # the small parameter's states are not paged
    checkpoint = _saved(before)

    plain_load = _FakePagedAdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    plain_load.load_state_dict(checkpoint)
    assert not any(_paged_states(plain_load).values())  # bitsandbytes' own load leaves nothing paged

    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = repaged_on_load(_FakePagedAdamW8bit)(resumed_params, lr=1e-2)
    resumed.load_state_dict(checkpoint)
    resumed.settle_loaded_states()  # EightBitOptimizer calls it at train start
    assert _paged_states(resumed) == paged
    for p, q in zip(params, resumed_params):
        for key in ("state1", "state2", "absmax1", "absmax2"):
            if key in before.state[p]:
                assert torch.equal(before.state[p][key], resumed.state[q][key])
    _run(before, params, 1, first=3)
    _run(resumed, resumed_params, 1, first=3)
    # without the settle: loaded, then moved to the device by Lightning, paged again by the next step
    again = repaged_on_load(_FakePagedAdamW8bit)(resumed_params, lr=1e-2)
    again.load_state_dict(_saved(resumed))
    _moved_to_the_device(again)
    assert not any(_paged_states(again).values())
    _run(before, params, 1, first=4)
    _run(again, resumed_params, 1, first=4)
    assert _paged_states(again) == paged
    assert repage_states(again) == 0  # nothing left to page
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)


def test_repaging_leaves_an_optimizer_that_is_not_paged_alone():
    params = _params()
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-2)
    _run(optimizer, params, 1)
    states = {id(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)}
    assert repage_states(optimizer) == 0
    assert states == {id(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)}


# -- CUDA ---------------------------------------------------------------------------------------


class _Wide(lightning.LightningModule):
    """Two linear layers of 512 x 512 (262,144 elements each: bitsandbytes pages them) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
        self.head = torch.nn.Linear(512, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 512, generator=g)
        data = torch.utils.data.TensorDataset(x, x[:, :1] * 2)
        return ResumableDataLoader(data, batch_size=8, sampler=EpochShuffleSampler(len(data), seed=1))


def _fit_wide(steps, callback, accelerator="cuda", save_in=None, ckpt_path=None):
    """A fit of ``_Wide``; ``save_in``: a checkpoint after step 3, taken while training (``step=3.ckpt``). One saved
    once ``fit`` has returned is no resume point: the loop's data fetcher has already drawn the next batch then (on
    the H200 the resumed parameters differed, plain AdamW's too)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = _Wide()
    saver = [ModelCheckpoint(dirpath=save_in, filename="{step}", every_n_train_steps=3, save_top_k=-1)] if save_in else []
    trainer = lightning.Trainer(
        accelerator=accelerator, devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(saver), callbacks=[callback, *saver],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("setting", [{}, {"offload": "cpu"}], ids=["8bit", "offload"])
def test_a_checkpoint_taken_mid_training_resumes_exactly_on_cpu(setting, tmp_path):
    model, _ = _fit_wide(6, EightBitOptimizer(**setting), "cpu", save_in=tmp_path)
    resumed, _ = _fit_wide(6, EightBitOptimizer(**setting), "cpu", ckpt_path=tmp_path / "step=3.ckpt")
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@needs_cuda
@pytest.mark.parametrize("setting", [{"offload": "cpu"}, {"paged": True}], ids=["offload", "paged"])
def test_cuda_offloaded_or_paged_states_train_bitwise_like_plain_8bit_and_resume_exactly(setting, tmp_path):
    plain, _ = _fit_wide(6, EightBitOptimizer())
    model, trainer = _fit_wide(6, EightBitOptimizer(**setting), save_in=tmp_path)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)
    optimizer = trainer.optimizers[0]
    big = optimizer.state[model.body[0].weight]
    if "offload" in setting:
        assert big["state1"].device.type == "cpu" and big["state1"].is_pinned()
    else:
        assert getattr(big["state1"], "is_paged", False)
    resumed, trainer = _fit_wide(6, EightBitOptimizer(**setting), ckpt_path=tmp_path / "step=3.ckpt")
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    big = trainer.optimizers[0].state[resumed.body[0].weight]
    if "offload" in setting:
        assert big["state1"].device.type == "cpu" and big["state1"].is_pinned()
    else:
        assert getattr(big["state1"], "is_paged", False) and getattr(big["state2"], "is_paged", False)


def stepped_under_a_side_stream_like_plain_8bit(cls: type) -> tuple[torch.optim.Optimizer, list]:
    """``cls`` (an AdamW8bit subclass) stepped 4 times with a side stream current, its parameters checked equal to
    plain AdamW8bit's stepped on the default stream. bitsandbytes' kernels run on the legacy default stream: the
    step must still be ordered after the gradients written on the side stream and before what follows."""
    plain_params, params = _params(device="cuda"), _params(device="cuda")
    plain, optimizer = bnb.optim.AdamW8bit(plain_params, lr=1e-2), cls(params, lr=1e-2)
    side = torch.cuda.Stream()
    for step in range(4):
        _run(plain, plain_params, 1, step)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _run(optimizer, params, 1, step)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p, q in zip(plain_params, params):
        assert torch.equal(p, q)
    return optimizer, params


@needs_cuda
def test_cuda_offloaded_step_under_a_side_stream_equals_plain_8bit():
    # the copies too must be ordered against the updates (the step runs with the default stream current)
    offloaded, params = stepped_under_a_side_stream_like_plain_8bit(host_offloaded(bnb.optim.AdamW8bit))
    assert offloaded.state[params[0]]["state1"].device.type == "cpu"


class _DeviceStateBytes(lightning.Callback):
    """Optimizer-state bytes on the device (quantization maps aside) after every step and at train end,
    read while training runs: after ``fit`` returns, Lightning's ``Strategy.teardown`` has moved every
    optimizer state to the CPU, and a reading then could not fail."""

    def __init__(self):
        self.after_steps: list[int] = []
        self.at_train_end: int | None = None

    @staticmethod
    def _bytes(trainer) -> int:
        return sum(v.numel() * v.element_size() for o in trainer.optimizers for s in o.state.values()
                   for k, v in s.items() if torch.is_tensor(v) and v.is_cuda and not k.startswith("qmap"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_steps.append(self._bytes(trainer))

    def on_train_end(self, trainer, pl_module):
        self.at_train_end = self._bytes(trainer)


@needs_cuda
def test_cuda_offload_keeps_no_optimizer_state_on_the_device_between_steps():
    from lightning_efficient import MemoryReport

    def fit(setting):
        measured = _DeviceStateBytes()
        report = MemoryReport(every_n_steps=1, log=False, print_table=False)
        trainer = lightning.Trainer(
            accelerator="cuda", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
            callbacks=[EightBitOptimizer(**setting), report, measured],
        )
        trainer.fit(_Wide())
        return measured, report

    plain, _ = fit({})
    assert len(plain.after_steps) == 3 and min(plain.after_steps) > 2 * 512 * 512 * 2  # the measure sees device states
    measured, report = fit({"offload": "cpu"})
    assert measured.after_steps == [0, 0, 0]
    assert measured.at_train_end == 0
    figures = report.report()
    # all but the two quantization maps (float32, 256 codes each), which stay on the device
    assert 0 <= figures["optimizer_state_bytes"] - figures["optimizer_state_host_bytes"] <= 2 * 256 * 4
    assert figures["optimizer_state_host_bytes"] > 2 * 512 * 512 * 2  # the 8-bit moments of both weights
