"""DeviceClock: intervals between marks on the device's timeline."""

import time

import pytest
import torch

from lightning_efficient._torch import DeviceClock


def test_cpu_interval_covers_the_work_between_marks():
    clock = DeviceClock("cpu")
    start = clock.mark()
    time.sleep(0.02)
    end = clock.mark()
    assert 0.02 <= clock.seconds(start, end) < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_interval_is_device_time_not_launch_time():
    clock = DeviceClock("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    start = clock.mark()
    for _ in range(20):
        x = x @ x.t() / 4096
    end = clock.mark()
    assert clock.seconds(start, end) > 0
