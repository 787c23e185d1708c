"""Activation memory: block discovery, per-block policies, offload to host and disk, the planner."""

from lightning_efficient.activations.callback import ActivationMemory
from lightning_efficient.activations.discovery import find_blocks
from lightning_efficient.activations.offload import DiskFullError, DiskOffload, HostOffload
from lightning_efficient.activations.planner import BlockProfile, Plan, parse_budget, plan_blocks
from lightning_efficient.activations.policies import POLICIES, unwrap_block, wrap_block

__all__ = [
    "POLICIES",
    "ActivationMemory",
    "BlockProfile",
    "DiskFullError",
    "DiskOffload",
    "HostOffload",
    "Plan",
    "find_blocks",
    "parse_budget",
    "plan_blocks",
    "unwrap_block",
    "wrap_block",
]
