"""8-bit optimizer states: bitsandbytes twins, state conversion, host offload, sharded (FSDP2) states, the callback."""

from lightning_efficient.optim.callback import EightBitOptimizer
from lightning_efficient.optim.offload import host_offloaded
from lightning_efficient.optim.schedulers import rebind_schedulers
from lightning_efficient.optim.sharded import sharded_class
from lightning_efficient.optim.state import (
    convert_optimizer_state,
    dequantize_adam_state,
    quantize_adam_state,
)
from lightning_efficient.optim.twins import NoTwinError, build_twin

__all__ = [
    "EightBitOptimizer",
    "NoTwinError",
    "build_twin",
    "convert_optimizer_state",
    "dequantize_adam_state",
    "host_offloaded",
    "quantize_adam_state",
    "rebind_schedulers",
    "sharded_class",
]
