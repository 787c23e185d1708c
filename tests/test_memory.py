import json
import math
import os
import platform
import subprocess
import sys

import bitsandbytes as bnb
import pytest
import torch

from lightning_efficient import memory
from lightning_efficient.memory import (
    PeakMemory,
    SavedTensorCounter,
    current_rss_bytes,
    distinct_storage_bytes,
    optimizer_state_bytes,
    peak_rss_bytes,
    release_free_memory,
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


def test_a_meter_reads_the_peak_since_its_own_reset_though_another_reset_the_process_peak_in_between():
    # freed heap earlier tests left is handed back before the starts are read (a reset would hand it back after)
    release_free_memory()
    outer = PeakMemory(torch.device("cpu"), start_rss_bytes=current_rss_bytes())
    outer.reset(release=False)
    held = torch.ones(64 * 2**20 // 4)  # 64 MiB touched, then freed (a fresh mapping: handed back at once)
    del held
    inner = PeakMemory(torch.device("cpu"), start_rss_bytes=current_rss_bytes())
    inner.reset(release=False)  # resets the process's one peak (VmHWM) to what is held now
    assert peak_rss_bytes() < outer.start_rss_bytes + 48 * 2**20  # the process's peak no longer shows the 64 MiB
    assert outer.read() >= 60 * 2**20  # the outer meter still does
    assert inner.read() < 48 * 2**20
    outer.reset()  # its own reset starts its window afresh
    assert outer.read() < 48 * 2**20



def test_work_outside_training_is_left_out_of_the_meters_the_saved_tensor_counts_and_the_step_clocks_open_around_it():
    release_free_memory()
    outer = PeakMemory(torch.device("cpu"), start_rss_bytes=current_rss_bytes())
    outer.reset(release=False)
    reset_inside = PeakMemory(torch.device("cpu"), start_rss_bytes=current_rss_bytes())
    reset_inside.reset(release=False)
    spike = torch.ones(64 * 2**20 // 4)  # 64 MiB touched and freed before: in both windows' peaks so far
    del spike
    kept = torch.ones(32 * 2**20 // 4)  # 32 MiB the windows hold on
    weight = torch.ones(256, 256, requires_grad=True)
    seconds = memory.seconds_outside_training()
    with SavedTensorCounter() as counted:
        (weight * 2).sum().backward()  # saves nothing of its own (a scalar factor)
        (weight * weight).sum().backward()  # saves the weight twice: one storage
        before = counted.bytes
        with memory.outside_training(torch.device("cpu")):
            held = torch.ones(96 * 2**20 // 4)  # 96 MiB touched inside, then freed
            (weight.exp() * weight).sum().backward()  # saved inside: not counted by the counter open around
            del held
            inside = PeakMemory(torch.device("cpu"), start_rss_bytes=current_rss_bytes())
            inside.reset(release=False)  # a meter opened inside reads from its own reset
            reset_inside.reset(release=False)  # so does one open before and reset inside: the spike is not its
            late = torch.ones(16 * 2**20 // 4)  # 16 MiB after those resets: in their windows
            del late
    assert counted.bytes == before == 256 * 256 * 4
    assert 60 * 2**20 <= outer.read() < 90 * 2**20  # the spike before, not the 96 MiB inside
    assert 14 * 2**20 <= inside.read() < 40 * 2**20
    assert 40 * 2**20 <= reset_inside.read() < 60 * 2**20  # the 32 MiB held and the 16 after its reset, not the spike
    assert memory.seconds_outside_training() > seconds
    del kept


_MKL_BUFFERS = """
import ctypes, json, torch
from lightning_efficient.memory import release_free_memory

def anon():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

trim = ctypes.CDLL("libc.so.6").malloc_trim
trim(0)
start = anon()
for n, k, m in [(2048, 128, 4096), (128, 344, 128), (2048, 4096, 128), (512, 512, 512)]:
    x, w = torch.randn(n, k, requires_grad=True), torch.randn(k, m, requires_grad=True)
    (x @ w).sum().backward()
    del x, w
trim(0)
trimmed = anon()
release_free_memory()
print(json.dumps({"start": start, "trimmed": trimmed, "released": anon()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not torch.backends.mkl.is_available(),
                    reason="MKL's cached buffers and RssAnon: a Linux build of torch on MKL")
def test_freed_memory_handed_back_includes_the_buffers_mkl_caches_for_the_shapes_it_multiplied():
    # a fresh process: what MKL holds in this one depends on the tests run before
    env = {name: value for name, value in os.environ.items() if name != "MKL_DISABLE_FAST_MM"}  # MKL's caching on
    out = subprocess.run([sys.executable, "-c", _MKL_BUFFERS], capture_output=True, text=True, timeout=120, check=True, env=env)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    # the matrix products leave MKL's buffers resident, which the heap's trim does not hand back ...
    assert figures["trimmed"] - figures["start"] > 3 * 2**20, figures
    # ... and release_free_memory does
    assert figures["released"] - figures["start"] < 1 * 2**20, figures


@pytest.mark.parametrize("missing", ["mkl", "library"])
def test_freed_memory_is_handed_back_without_mkl_as_before(monkeypatch, missing):
    # torch without MKL, or no library that exports its call (CDLL raising as it does on Windows for None)
    real = memory.ctypes.CDLL

    def no_library(name, *args, **kwargs):
        if name == "libc.so.6":  # the heap's trim, as before
            return real(name, *args, **kwargs)
        raise TypeError("argument of type 'NoneType' is not iterable")

    if missing == "mkl":
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    else:
        monkeypatch.setattr(memory.ctypes, "CDLL", no_library)
    memory._mkl_free_buffers.cache_clear()
    try:
        assert memory._mkl_free_buffers() is None
        memory.release_free_memory()  # nothing raised
    finally:
        memory._mkl_free_buffers.cache_clear()


@pytest.mark.parametrize(("environment", "set_after_start", "resident"), [
    ({}, False, True),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, False, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, False, False),
    ({}, True, True),  # set in os.environ after the start: glibc read its environment then, and keeps freed heap
])
def test_freed_heap_stays_resident_under_glibcs_default_allocator_read_from_the_environment_the_process_started_with(
        environment, set_after_start, resident):
    code = ("import os\n"
            + ("os.environ['MALLOC_MMAP_THRESHOLD_'] = '131072'\n" if set_after_start else "")
            + "from lightning_efficient.memory import freed_heap_stays_resident\nprint(freed_heap_stays_resident())")
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, **environment}, capture_output=True, text=True, timeout=120,
                          check=True)
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert done.stdout.strip() == str(resident and glibc)
