"""8-bit optimizer states for sharded (DTensor) parameters: FSDP2 through Lightning's ``ModelParallelStrategy``.

bitsandbytes has no sharding rules for its update operators, so a bitsandbytes optimizer cannot
step a DTensor. Here it steps each rank's *local shard*: the twin's states are made from the local
tensor (``p.to_local()``) and its update runs on the local parameter and the local gradient, in
place in the storage FSDP2 gathers from. A rank therefore holds about 2.05 bytes of state per local
parameter (two uint8 codes and one float32 ``absmax`` per block of 256 for each moment).

Blockwise quantization is per local shard: a block never crosses a shard boundary, so the 8-bit
numbers depend on the sharding (one-device 8-bit quantizes blocks of the whole tensor; the two
agree wherever the shard boundaries fall on multiples of 256 elements). The update a rank makes is
exactly what bitsandbytes makes when it is run on that local tensor and gradient alone.
Whether a parameter gets 8-bit states is decided by its *global* size (``min_8bit_size``), so all
ranks agree whatever the local sizes.

Saved layout (what ``state_dict`` returns, so that ``torch.distributed.checkpoint`` saves, gathers
and loads it): ``state1``/``state2`` become DTensors placed exactly like their parameter (local
shapes, global shape of the parameter); ``absmax1``/``absmax2`` (one float per local block, a count
that depends on the local shard) become a DTensor of ``slots x max_blocks`` floats, one slot per
shard, padded with zeros, sharded on dim 0 over every mesh dimension the parameter is sharded over;
``qmap1``/``qmap2`` are the same on every rank and stay plain tensors. Such a state loads back
exactly on the same device mesh; on another mesh the blocks would not line up, and
:class:`~lightning_efficient.EightBitOptimizer` refuses the checkpoint before the first step.

The 32-bit <-> 8-bit conversion of a checkpoint works per local shard as well
(:func:`convert_sharded_state`): a torch Adam moment is quantized shard by shard, as sharded
bitsandbytes would hold it; an 8-bit state is dequantized shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache
from math import prod
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_efficient.optim.state import (
    _BNB_WRAPPED_KEY,
    BLOCKSIZE,
    BNB_BLOCKWISE,
    TORCH_32BIT,
    dequantize_adam_state,
    param_state_layout,
    quantize_adam_state,
    unwrapped,
)

__all__ = [
    "checkpoint_layouts",
    "convert_sharded_state",
    "has_sharded_params",
    "install_layout_hooks",
    "load_sharded",
    "local_state",
    "max_local_blocks",
    "quantized_state_names",
    "save_sharded",
    "saved_state",
    "shard_mesh",
    "sharded_class",
]

_PARAM_LIKE = ("state1", "state2", "exp_avg", "exp_avg_sq", "momentum_buffer")
_ABSMAX = ("absmax1", "absmax2")


def has_sharded_params(optimizer: torch.optim.Optimizer) -> bool:
    """True when any parameter of ``optimizer`` is a DTensor (FSDP2, tensor parallelism)."""
    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


def shard_mesh(params: Sequence[Tensor]) -> list[int] | None:
    """The device-mesh shape the sharded ``params`` live on (None when none is a DTensor)."""
    for p in params:
        if isinstance(p, DTensor):
            return list(p.device_mesh.shape)
    return None


def _blocks(numel: int) -> int:
    return -(-numel // BLOCKSIZE)


def max_local_blocks(param: DTensor) -> int:
    """The most quantization blocks any rank's shard of ``param`` has (the first chunk is the largest).

    Computed from the global shape and placements alone, so every rank agrees without communication.
    """
    shape = list(param.shape)
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            dim = placement.dim
            shape[dim] = -(-shape[dim] // param.device_mesh.size(mesh_dim))
    return _blocks(prod(shape))


def _absmax_placements(param: DTensor) -> list:
    return [Shard(0) if placement.is_shard() else Replicate() for placement in param.placements]


def _slots(param: DTensor) -> int:
    return prod(param.device_mesh.size(i) for i, placement in enumerate(param.placements) if placement.is_shard())


def _param_like(local: Tensor, param: DTensor) -> DTensor:
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def saved_state(state: dict, param: DTensor) -> dict:
    """One parameter's state (plain local tensors, flat keys) in the saved layout (DTensors); see the module doc."""
    out = dict(state)
    for key in _PARAM_LIKE:
        value = out.get(key)
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            out[key] = _param_like(value, param)
    width = max_local_blocks(param)
    for key in _ABSMAX:
        value = out.get(key)
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            padded = torch.zeros(width, dtype=value.dtype, device=value.device)
            padded[: value.numel()] = value
            out[key] = DTensor.from_local(
                padded, param.device_mesh, _absmax_placements(param), run_check=False, shape=(_slots(param) * width,), stride=(1,)
            )
    return out


def local_state(state: dict, param: DTensor) -> dict:
    """One parameter's saved state (DTensors, flat keys) as the plain local tensors a rank steps with.

    Raises:
        ValueError: when the saved shards do not match this rank's shard (another device mesh).
    """
    out = dict(state)
    local_shape = param.to_local().shape
    for key in _PARAM_LIKE:
        value = out.get(key)
        if isinstance(value, DTensor):
            value = value.to_local()
            if value.shape != local_shape:
                raise ValueError(f"a saved {key} shard has shape {tuple(value.shape)}, this rank's parameter shard {tuple(local_shape)}")
            out[key] = value
    for key in _ABSMAX:
        value = out.get(key)
        if isinstance(value, DTensor):
            value = value.to_local()
            if value.numel() != max_local_blocks(param):
                raise ValueError(
                    f"a saved {key} shard has {value.numel()} blocks, this device mesh {list(param.device_mesh.shape)} "
                    f"gives {max_local_blocks(param)}: 8-bit states load back only on the device mesh that saved them"
                )
            out[key] = value[: _blocks(param.to_local().numel())].clone()
    return out


def _rewrapped(flat: dict) -> dict:
    inner = {k: v for k, v in flat.items() if k in _BNB_INNER_KEYS}
    outer = {k: v for k, v in flat.items() if k not in _BNB_INNER_KEYS}
    if inner:
        outer[_BNB_WRAPPED_KEY] = inner
    return outer


_BNB_INNER_KEYS = {"qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "state1", "state2", "gnorm_vec", "absmax1", "absmax2", "unorm_vec"}


def convert_sharded_state(state: dict, param: Tensor, to: str | None, eight_bit: bool) -> dict:
    """One parameter's state (flat keys, local tensors) converted to layout ``to`` on the local shard.

    Args:
        state: the state with local (plain) tensors.
        param: its parameter (a DTensor: conversion is per local shard).
        to: ``TORCH_32BIT``, ``BNB_BLOCKWISE`` or None (keep the layout).
        eight_bit: for ``BNB_BLOCKWISE``, quantize to 8 bits (else float32 states).

    Raises:
        ValueError: for a state that is not Adam's (only Adam/AdamW states convert).
    """
    layout = param_state_layout(state)
    if to is None or layout is None or layout == to:
        return state
    if "exp_avg" not in state and "state2" not in state:
        raise ValueError(f"optimizer state with keys {sorted(state)}: only Adam/AdamW states convert between 32-bit and 8-bit")
    local = param.to_local() if isinstance(param, DTensor) else param
    if to == BNB_BLOCKWISE:
        return quantize_adam_state({k: v.to(local.device) if isinstance(v, Tensor) else v for k, v in state.items()}, eight_bit)
    return dequantize_adam_state(state, local.dtype)


def _map_states(
    state_dict: dict, params: Sequence[Tensor], fn: Callable[[dict, Tensor, int], dict]
) -> dict:
    # keys are parameter indices (``Optimizer.state_dict``) or names (``torch.distributed.checkpoint``
    # hands ``load_state_dict`` FQN keys): either way the param groups list them in the parameters' order
    keys = [key for group in state_dict.get("param_groups", []) for key in group["params"]]
    param_of = dict(zip(keys, params))
    out = dict(state_dict)
    out["state"] = {}
    for index, state in state_dict["state"].items():
        param = param_of.get(index)
        if not isinstance(param, DTensor) or not isinstance(state, dict):
            out["state"][index] = state
            continue
        # bitsandbytes' keys nested as its own state_dict nests them, whichever layout they came from
        out["state"][index] = _rewrapped(fn(unwrapped(state), param, index))
    return out


def save_sharded(
    state_dict: dict, params: Sequence[Tensor], to: str | None, use_8bit: Callable[[Tensor], bool],
    group_keys: Sequence[set[str]] | None = None,
) -> dict:
    """An optimizer ``state_dict`` (local tensors) in the saved layout, converted to layout ``to`` first.

    ``group_keys``: the param-group keys a checkpoint being loaded holds (a template asks for no
    other: a 32-bit AdamW's groups have no ``alpha``, an 8-bit twin's no ``amsgrad``).
    """

    def one(state: dict, param: Tensor, index: int) -> dict:
        local = local_state(state, param)  # a torch optimizer's own states are DTensors already
        return saved_state(convert_sharded_state(local, param, to, use_8bit(param)), param)

    out = _map_states(state_dict, params, one)
    if group_keys is not None:
        out["param_groups"] = [{k: v for k, v in group.items() if k == "params" or k in keys}
                               for group, keys in zip(out["param_groups"], group_keys)]
    return out


def load_sharded(state_dict: dict, optimizer: torch.optim.Optimizer, to: str, use_8bit: Callable[[Tensor], bool]) -> dict:
    """A saved optimizer ``state_dict`` (DTensors, either layout) as local tensors in layout ``to``.

    Param-group keys the saved groups lack (a checkpoint of the other layout) keep ``optimizer``'s values.
    torch's own optimizers keep DTensor states: for ``to=TORCH_32BIT`` the moments are DTensors again.
    """

    def one(state: dict, param: Tensor, index: int) -> dict:
        try:
            local = local_state(state, param)
        except ValueError as error:
            raise ValueError(f"optimizer state of parameter {index}: {error}") from None
        converted = convert_sharded_state(local, param, to, use_8bit(param))
        return saved_state(converted, param) if to == TORCH_32BIT else converted

    out = _map_states(state_dict, _flat(optimizer), one)
    out["param_groups"] = [{**{k: v for k, v in current.items() if k != "params"}, **saved}
                           for current, saved in zip(optimizer.param_groups, state_dict["param_groups"])]
    return out


def _flat(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class _LocalShardMixin:
    """Mixed into a bitsandbytes optimizer class: steps the local shard of each DTensor parameter.

    ``saved_layout`` is the layout ``state_dict`` returns (its own, or the other one while a
    checkpoint in that layout is being loaded: ``torch.distributed.checkpoint`` loads into the
    template ``state_dict`` gives); ``load_state_dict`` takes either layout and converts.
    """

    saved_layout: str = BNB_BLOCKWISE
    saved_group_keys: list[set[str]] | None = None

    def _eight_bit(self, param: Tensor) -> bool:
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p is param:
                    config = self.get_config(gindex, pindex, group)
                    return config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
        return False

    @torch.no_grad()
    def init_state(self, group, p, gindex, pindex):
        """bitsandbytes' states for the local shard; 8-bit or not by the parameter's global size."""
        if not isinstance(p, DTensor):
            return super().init_state(group, p, gindex, pindex)
        local = p.to_local()
        config = self.get_config(gindex, pindex, group)
        minimum = self.args.min_8bit_size
        if p.numel() >= config["min_8bit_size"]:
            self.args.min_8bit_size = 0  # a small (or empty) shard of a large parameter is 8-bit on every rank
        try:
            super().init_state(group, local, gindex, pindex)
        finally:
            self.args.min_8bit_size = minimum
        self.state[p] = self.state.pop(local)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        """bitsandbytes' update of the local shard with the local gradient, in place."""
        if not isinstance(p, DTensor):
            return super().update_step(group, p, gindex, pindex)
        grad = p.grad
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != tuple(p.placements):
                grad = grad.redistribute(p.device_mesh, p.placements)
            grad = grad.to_local()
        local = p.to_local()
        if local.numel() == 0:  # an empty shard: nothing to update, the step count still advances
            self.state[p]["step"] += 1
            return None
        work = local if local.is_contiguous() else local.contiguous()
        self.state[work] = self.state.pop(p)
        work.grad = grad
        try:
            super().update_step(group, work, gindex, pindex)
        finally:
            self.state[p] = self.state.pop(work)
            work.grad = None
        if work is not local:
            local.copy_(work)
        return None

    def state_dict(self):
        """bitsandbytes' state dict with sharded states as DTensors (the saved layout of the module doc)."""
        saved = super().state_dict()
        to = None if self.saved_layout == BNB_BLOCKWISE else self.saved_layout
        return save_sharded(saved, _flat(self), to, self._eight_bit, self.saved_group_keys)

    def load_state_dict(self, state_dict, move_to_device=True):
        """Load a saved state in either layout (8-bit states or torch Adam moments, as DTensors)."""
        local = load_sharded(state_dict, self, BNB_BLOCKWISE, self._eight_bit)
        super().load_state_dict(local, move_to_device=move_to_device)
        self.saved_layout, self.saved_group_keys = BNB_BLOCKWISE, None


@cache
def sharded_class(cls: type) -> type:
    """A subclass of the bitsandbytes optimizer ``cls`` that steps the local shards of DTensor parameters."""
    return type(f"LocalShard{cls.__name__}", (_LocalShardMixin, cls), {})


def install_layout_hooks(
    optimizer: torch.optim.Optimizer, use_8bit: Callable[[Tensor], bool]
) -> Callable[[str, list[set[str]] | None], None]:
    """Let a torch (32-bit) ``optimizer`` over DTensor parameters save and load bitsandbytes' sharded layout.

    For ``EightBitOptimizer(bits=32)``: while a checkpoint of 8-bit states is loaded, the optimizer's
    ``state_dict`` (the template ``torch.distributed.checkpoint`` loads into) is in the 8-bit layout
    (``use_8bit`` says which parameters were 8-bit); ``load_state_dict`` dequantizes each local shard.

    Returns:
        ``expect(layout, group_keys)``: set the layout (and the checkpoint's param-group keys) the next
        ``state_dict`` is given in.
    """
    mode: dict[str, Any] = {"layout": TORCH_32BIT, "group_keys": None}

    def post_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        if mode["layout"] == TORCH_32BIT:
            return state_dict
        return save_sharded(state_dict, _flat(opt), mode["layout"], use_8bit, mode["group_keys"])

    def pre_load(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        mode.update(layout=TORCH_32BIT, group_keys=None)
        layouts = {param_state_layout(s) for s in state_dict["state"].values() if isinstance(s, dict)}
        if BNB_BLOCKWISE not in layouts:
            return state_dict
        return load_sharded(state_dict, opt, TORCH_32BIT, use_8bit)

    optimizer.register_state_dict_post_hook(post_state_dict)
    optimizer.register_load_state_dict_pre_hook(pre_load)

    def expect(layout: str, group_keys: list[set[str]] | None = None) -> None:
        mode.update(layout=layout, group_keys=group_keys)

    return expect


def _optimizer_keys(path: Any) -> Iterator[tuple[int, str]]:
    """``(optimizer index, the rest of the key)`` for every optimizer key of a distributed-checkpoint directory's
    metadata (``optimizer_<index>.<rest>``)."""
    from torch.distributed.checkpoint import FileSystemReader

    for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata:
        head, _, rest = key.partition(".")
        if head.startswith("optimizer_"):
            yield int(head[len("optimizer_"):]), rest


def quantized_state_names(path: Any) -> dict[int, tuple[set[str], set[str]]]:
    """Per optimizer index of a distributed-checkpoint directory: the names of the parameters it holds states for,
    and of those whose states are 8-bit (bitsandbytes' blockwise ``absmax1`` beside them). Read from its metadata
    alone; empty for a file (its states are keyed by index, not by name)."""
    from pathlib import Path

    if not Path(path).is_dir():
        return {}
    found: dict[int, tuple[set[str], set[str]]] = {}
    for index, rest in _optimizer_keys(path):
        if not rest.startswith("state."):
            continue
        name, _, leaf = rest[len("state."):].rpartition(".")
        name = name.removesuffix(f".{_BNB_WRAPPED_KEY}")
        stated, quantized = found.setdefault(index, (set(), set()))
        stated.add(name)
        if leaf == "absmax1":
            quantized.add(name)
    return found


def checkpoint_layouts(path: Any, weights_only: bool | None = False) -> tuple[list[set[str]], list[list[set[str]]], dict | None]:
    """What a Lightning checkpoint (a file or a distributed-checkpoint directory) holds, per optimizer
    index: its optimizer-state layouts and its param groups' keys; and the checkpoint's callback states.

    Reads only metadata for a directory; a file is memory-mapped. ``weights_only`` is passed to ``torch.load``
    (None: torch's default, as Lightning does).
    """
    from pathlib import Path

    path = Path(path)
    layouts: dict[int, set[str]] = {}
    group_keys: dict[int, dict[int, set[str]]] = {}
    if path.is_dir():
        for index, rest in _optimizer_keys(path):
            if rest.startswith("param_groups."):
                _, group, name = rest.split(".", 2)
                group_keys.setdefault(index, {}).setdefault(int(group), set()).add(name)
                continue
            if not rest.startswith("state."):
                continue
            leaf = rest.rsplit(".", 1)[-1]
            if leaf in ("exp_avg", "momentum_buffer"):
                layouts.setdefault(index, set()).add(TORCH_32BIT)
            elif leaf == "state1":
                layouts.setdefault(index, set()).add(BNB_BLOCKWISE)
        meta_path = path / "meta.pt"
        meta = torch.load(meta_path, map_location="cpu", weights_only=weights_only) if meta_path.is_file() else {}
    else:
        meta = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        for index, optimizer_state in enumerate(meta.get("optimizer_states", [])):
            layouts[index] = {param_state_layout(s) for s in optimizer_state.get("state", {}).values()} - {None}
            group_keys[index] = {g: set(group) - {"params"} for g, group in enumerate(optimizer_state.get("param_groups", []))}
    count = max([*layouts, *group_keys], default=-1) + 1
    groups = [[group_keys.get(i, {}).get(g, set()) for g in range(len(group_keys.get(i, {})))] for i in range(count)]
    return [layouts.get(i, set()) for i in range(count)], groups, meta.get("callbacks")
