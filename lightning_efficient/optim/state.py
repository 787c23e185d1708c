"""Optimizer-state conversion between torch's 32-bit Adam layout and bitsandbytes' 8-bit layout.

torch ``Adam``/``AdamW`` keep ``{"step": tensor, "exp_avg", "exp_avg_sq"}`` per parameter.
bitsandbytes keeps ``{"step": int, "state1", "state2"}``: float32 for tensors under its
``min_8bit_size`` (or overridden to 32 bits), else uint8 codes with a quantization map
(``qmap1`` signed dynamic, ``qmap2`` unsigned dynamic) and one float32 ``absmax`` per block of 256.
Quantizing uses bitsandbytes' own blockwise routine and maps, so a converted state is what
bitsandbytes would hold for those moments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import copy

import torch
from torch import Tensor

from lightning_efficient.optim._bnb import bitsandbytes

TORCH_32BIT = "torch-32bit"
BNB_BLOCKWISE = "bitsandbytes-blockwise-256"
BLOCKSIZE = 256

_MAPS: dict[bool, Tensor] = {}


def _qmap(signed: bool, device: torch.device) -> Tensor:
    if signed not in _MAPS:
        _MAPS[signed] = bitsandbytes().functional.create_dynamic_map(signed=signed)
    return _MAPS[signed].to(device)


_BNB_WRAPPED_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes' state_dict nests its states here


def unwrapped(state: dict) -> dict:
    """One parameter's saved state with bitsandbytes' nested quantization state flattened."""
    if _BNB_WRAPPED_KEY not in state:
        return state
    flat = {k: v for k, v in state.items() if k != _BNB_WRAPPED_KEY}
    flat.update(state[_BNB_WRAPPED_KEY])
    return flat


def param_state_layout(state: dict) -> str | None:
    """``TORCH_32BIT``, ``BNB_BLOCKWISE`` or None (no state yet) for one parameter's state."""
    state = unwrapped(state)
    if "exp_avg" in state or "momentum_buffer" in state:
        return TORCH_32BIT
    if "state1" in state:
        return BNB_BLOCKWISE
    return None


def quantize_adam_state(state: dict, eight_bit: bool) -> dict:
    """torch Adam state -> bitsandbytes state (8-bit codes when ``eight_bit``, else float32)."""
    exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
    out: dict = {"step": int(state["step"])}
    if not eight_bit:
        out["state1"], out["state2"] = exp_avg.clone(), exp_avg_sq.clone()
        return out
    for index, (moment, signed) in enumerate(((exp_avg, True), (exp_avg_sq, False)), start=1):
        qmap = _qmap(signed, moment.device)
        codes, quant_state = bitsandbytes().functional.quantize_blockwise(moment.contiguous(), code=qmap, blocksize=BLOCKSIZE)
        out[f"state{index}"], out[f"qmap{index}"], out[f"absmax{index}"] = codes, qmap, quant_state.absmax
    return out


def dequantize_adam_state(state: dict, dtype: torch.dtype = torch.float32) -> dict:
    """bitsandbytes Adam state -> torch Adam state (``step`` as a float32 tensor, moments in ``dtype``)."""
    moments = []
    for index in (1, 2):
        values = state[f"state{index}"]
        if values.dtype == torch.uint8:
            values = bitsandbytes().functional.dequantize_blockwise(
                values, absmax=state[f"absmax{index}"], code=state[f"qmap{index}"], blocksize=BLOCKSIZE
            )
        moments.append(values.to(dtype))
    return {"step": torch.tensor(float(state["step"])), "exp_avg": moments[0], "exp_avg_sq": moments[1]}


def convert_optimizer_state(
    state_dict: dict, params: Sequence[Tensor], to: str, use_8bit: Callable[[Tensor], bool] = lambda p: True
) -> tuple[dict, int]:
    """Convert an Adam/AdamW optimizer ``state_dict`` to layout ``to`` (``TORCH_32BIT`` or ``BNB_BLOCKWISE``).

    Args:
        state_dict: the saved optimizer state (``{"state": {index: ...}, "param_groups": [...]}``).
        params: the parameters of the optimizer that will load it, in its flat param-group order.
        to: the target layout.
        use_8bit: which parameters bitsandbytes holds in 8 bits (the others in float32).

    Returns:
        The converted copy and how many parameter states were converted.

    Raises:
        ValueError: for a state that is not Adam's (momentum, RMSprop, Adagrad and Lion states are
            not converted between layouts).
    """
    converted = copy(state_dict)
    converted["state"] = dict(state_dict["state"])
    count = 0
    for index, state in state_dict["state"].items():
        state = unwrapped(state)
        layout = param_state_layout(state)
        if layout is None or layout == to:
            continue
        if "exp_avg" not in state and "state2" not in state:
            raise ValueError(
                f"parameter {index}'s optimizer state has keys {sorted(state)}: only Adam/AdamW states convert "
                "between 32-bit and 8-bit"
            )
        param = params[index]
        if to == BNB_BLOCKWISE:
            converted["state"][index] = quantize_adam_state(
                {k: v.to(param.device) if isinstance(v, Tensor) else v for k, v in state.items()}, use_8bit(param)
            )
        else:
            converted["state"][index] = dequantize_adam_state(state, param.dtype)
        count += 1
    return converted, count
