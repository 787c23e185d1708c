"""The auto plan's profiler times device work on the device's timeline (DeviceClock), never by a
host timer around unsynchronised launches, and its times are still measured on CPU."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import lightning_efficient.activations.profile as profile
from lightning_efficient._torch import DeviceClock

SLEEP_S = 0.05


@torch.library.custom_op("lightning_efficient_tests::slow_copy", mutates_args=())
def slow_copy(x: torch.Tensor) -> torch.Tensor:
    """An op that takes at least SLEEP_S (a stand-in for a slow elementwise kernel)."""
    time.sleep(SLEEP_S)
    return x.clone()


@slow_copy.register_fake
def _(x):
    return torch.empty_like(x)


class SlowBlock(nn.Module):
    """A linear layer (an op ``selective`` saves) plus a slow op it recomputes; optionally a host
    sleep in forward (no op at all: only the block's time sees it)."""

    def __init__(self, host_sleep: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.host_sleep = host_sleep

    def forward(self, x):
        if self.host_sleep:
            time.sleep(SLEEP_S)
        return self.linear(x) + slow_copy(x.detach())


def _profile(blocks, device="cpu", policies=("keep", "checkpoint", "selective")):
    model = nn.Sequential(*blocks).to(device)
    x = torch.randn(4, 16, device=device)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def run_step():
        model(x).sum().backward()

    def run_forward():
        model(x)

    return profile.profile_blocks(
        run_step, run_forward, [(str(i), b) for i, b in enumerate(blocks)],
        lambda t: t.untyped_storage().data_ptr() in parameters, torch.device(device),
        min_offload_bytes=0, policies=policies,
    )


def test_block_and_op_times_are_measured_on_cpu():
    profiles = _profile([SlowBlock(host_sleep=True), SlowBlock(host_sleep=False)])
    sleeping, plain = profiles
    # checkpoint recomputes the whole forward: the host sleep and the slow op, each >= SLEEP_S
    assert sleeping.cost_s["checkpoint"] >= 2 * SLEEP_S
    assert SLEEP_S <= plain.cost_s["checkpoint"] < sleeping.cost_s["checkpoint"]
    # selective recomputes what it does not save: the slow op's share of the block's time, timed op by op
    assert plain.cost_s["selective"] >= 0.9 * SLEEP_S
    assert plain.cost_s["selective"] <= plain.cost_s["checkpoint"]


class CountingClock(DeviceClock):
    marks = 0
    reads = 0

    def mark(self):
        type(self).marks += 1
        return super().mark()

    def seconds(self, start, end):
        type(self).reads += 1
        return super().seconds(start, end)


def test_every_time_is_read_from_device_clock_marks_without_synchronising(monkeypatch):
    synchronised = []
    monkeypatch.setattr(profile, "DeviceClock", CountingClock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synchronised.append(a))
    import lightning_efficient._torch as shared

    monkeypatch.setattr(shared, "synchronize", lambda *a, **k: synchronised.append(a))
    monkeypatch.setattr(profile, "synchronize", lambda *a, **k: synchronised.append(a), raising=False)
    CountingClock.marks = CountingClock.reads = 0
    blocks = [SlowBlock(host_sleep=False), SlowBlock(host_sleep=False)]
    _profile(blocks)
    # one interval per block in the step, one per op in the timed forward (a linear, an add, the slow op, ...)
    assert CountingClock.reads >= len(blocks) * (1 + 3)
    assert CountingClock.marks == 2 * CountingClock.reads
    assert synchronised == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_times_are_execution_times():
    class Spin(nn.Module):
        """A block of a chain of small kernels (on the device's timeline, measured by events)."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, x):
            for _ in range(20):
                x = torch.tanh(self.linear(x))
            return x

    torch.cuda.synchronize()
    profiles = _profile([Spin()], device="cuda", policies=("keep", "checkpoint", "selective", "offload"))
    assert profiles[0].cost_s["checkpoint"] > 0
    assert profiles[0].cost_s["offload"] > 0  # moved bytes over the bandwidth timed with events
    assert 0 < profiles[0].cost_s["selective"] <= profiles[0].cost_s["checkpoint"]


def test_autocast_weight_copies_count_as_staying_on_the_device_for_disk():
    """Disk offload leaves autocast's bf16 weight copies in place, so the profile must count them as held."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    x = torch.randn(8, 64, requires_grad=True)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def run_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()

    def run_forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)

    (block,) = profile.profile_blocks(
        run_step, run_forward, [("0", model[0])], lambda t: t.untyped_storage().data_ptr() in parameters,
        torch.device("cpu"), min_offload_bytes=0, policies=("keep", "disk"),
    )
    weight_copy = 64 * 64 * 2  # the bf16 cast of the weight, saved by the matmul
    assert block.held_bytes["disk"] == weight_copy
    assert block.held_bytes["keep"] == weight_copy + 8 * 64 * 2  # plus the bf16 copy of the input


_DISK_BANDWIDTH = """
import json, os, sys
from lightning_efficient.activations.profile import disk_bandwidth
from lightning_efficient.memory import current_rss_bytes, peak_rss_bytes, release_free_memory, reset_peak_rss

release_free_memory()
start = current_rss_bytes()
reset_peak_rss()
write, read = disk_bandwidth(sys.argv[1], nbytes=32 * 2**20)
print(json.dumps({"write": write, "read": read, "peak_above_start": peak_rss_bytes() - start, "left": os.listdir(sys.argv[1])}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reset (/proc/self/clear_refs) is Linux's")
def test_the_disk_bandwidth_measurement_holds_a_few_mib_not_the_bytes_it_moves(tmp_path):
    # a re-plan during training measures it too, and on CPU what it holds counts as training memory
    out = subprocess.run([sys.executable, "-c", _DISK_BANDWIDTH, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["write"] > 0 and figures["read"] > 0
    assert figures["peak_above_start"] < 8 * 2**20, figures  # 32 MiB moved
    assert figures["left"] == []  # its scratch files are gone


def test_a_block_called_twice_a_step_holds_and_costs_what_both_calls_do():
    # a new user's trial: weights shared by calling one block twice; checkpoint's and selective's bytes and times were
    # the last call's alone (keep's were both), so an auto plan could exceed its budget
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    x = torch.randn(4, 16)
    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def profiled(calls):
        def run_step():
            h = x.requires_grad_(False)
            for _ in range(calls):
                h = block(h)
            h.sum().backward()

        def run_forward():
            h = x
            for _ in range(calls):
                h = block(h)

        (found,) = profile.profile_blocks(run_step, run_forward, [("0", block)], lambda t: t.untyped_storage().data_ptr() in parameters,
                                          torch.device("cpu"), min_offload_bytes=0, policies=("keep", "checkpoint", "selective"))
        return found

    once, twice = profiled(1), profiled(2)
    for policy in ("keep", "checkpoint", "selective"):
        assert twice.held_bytes[policy] == 2 * once.held_bytes[policy], policy


def test_an_input_two_calls_of_a_block_share_is_held_once():
    # R-Drop-style: the same input twice through one block; checkpointing holds it once
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    x = torch.randn(4, 16)
    parameters = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def run_step():
        (block(x) + block(x)).sum().backward()

    def run_forward():
        block(x)

    (found,) = profile.profile_blocks(run_step, run_forward, [("0", block)], lambda t: t.untyped_storage().data_ptr() in parameters,
                                      torch.device("cpu"), min_offload_bytes=0, policies=("keep", "checkpoint"))
    assert found.held_bytes["checkpoint"] == x.untyped_storage().nbytes()
