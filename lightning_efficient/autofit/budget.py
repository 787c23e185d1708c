"""AutoFit's memory budget: bytes or a size string per device, a list per rank, or ``"auto"``."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_efficient._validation import SettingRefused
from lightning_efficient.activations.planner import parse_budget

AUTO_RESERVE = 0.05
"""Under ``budget="auto"``, the fraction of the device's memory left to everything outside the fit."""


NOT_A_FRACTION = " (not a fraction: AutoFit's budget is memory)"

LEAST_BYTES = 2**16
"""The least budget taken (64 KiB): less holds no model's training step, and is a unit left out (``300`` for 300 MB)."""


def _float_hint(budget: float) -> str:
    """What to write instead of the float ``budget``: a fraction is no budget here; a whole number is bytes as an int;
    another float is a number missing its unit (``1.5`` for 1.5 GiB)."""
    if not (math.isfinite(budget) and budget > 0):  # (no unit makes a budget of it)
        return ""
    if budget <= 1:
        return NOT_A_FRACTION
    if budget.is_integer() and budget >= LEAST_BYTES:
        return f" (write {int(budget)} for {int(budget):,} bytes, or a size string with its unit)"
    return f" (a size string with its unit, e.g. '{budget:g}GiB' or '{budget:g}MB')"


def _number(text: str) -> float | None:
    """``text`` read as a number, or None where it is none."""
    try:
        return float(text)
    except ValueError:
        return None


def validate_budget(budget: Any) -> None:
    """Raise a ValueError naming ``budget`` unless it is bytes, a size string, ``"auto"`` or a list of those (``"auto"`` in a
    list: that rank's device, as ``["auto", "8GiB"]`` leaves one rank all it has and holds another to 8 GiB)."""
    message = "bytes (an int > 0), a size string like '6GiB', 'auto', or a list of those (one per rank)"
    if isinstance(budget, (list, tuple)):
        if not budget or any(isinstance(b, (list, tuple)) for b in budget):
            raise ValueError(f"budget={budget!r} is not allowed: expected {message}")
        for item in budget:
            validate_budget(item)
        return
    if budget == "auto":
        return
    if isinstance(budget, (float, bool)) or not isinstance(budget, (int, str)):
        # (a float is taken, to be refused here in one line, not by a config parser's type check: ActivationMemory's
        # budget may be a fraction, and a user writes 0.5 here too)
        hint = _float_hint(budget) if isinstance(budget, float) else ""
        raise ValueError(f"budget={budget!r} is not allowed: expected {message}{hint}")
    try:
        nbytes = parse_budget(budget)
    except ValueError:
        number = _number(budget) if isinstance(budget, str) else None  # a number without its unit ("1.5", as YAML gives it)
        hint = "" if number is None else _float_hint(number)
        raise ValueError(f"budget={budget!r} is not allowed: expected {message}{hint}") from None
    if nbytes < 1:  # a fraction ("0.5"): of no baseline here
        raise ValueError(f"budget={budget!r} is not allowed: expected {message}{NOT_A_FRACTION}")
    if nbytes < LEAST_BYTES:  # (a new user's budget=300, measured in full and then refused as "budget 0.0 MiB")
        unitless = isinstance(budget, int) or budget.strip().isdigit()
        raise ValueError(f"budget={budget!r} is not allowed: it is {nbytes:,} bytes, and a budget under 64 KiB holds no "
                         "model's training step" + (f"; give the unit, e.g. '{str(budget).strip()}MB'" if unitless else ""))


def auto_budget(device: torch.device, local_ranks: int = 1) -> int:
    """``"auto"``: on CUDA the device's total memory less :data:`AUTO_RESERVE`; on CPU the memory the
    system has available now (``MemAvailable``) shared by the ``local_ranks`` on this host, less the same reserve."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(total * (1.0 - AUTO_RESERVE))
    available = 0
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not available:
        raise ValueError("budget='auto' needs the available memory, which this system does not report: give bytes or a size string")
    return int(available / max(local_ranks, 1) * (1.0 - AUTO_RESERVE))


def check_budget_ranks(budget: Any, world: int) -> None:
    """Raise :class:`~lightning_efficient._validation.SettingRefused` (a ValueError; the command line says it in one line)
    where ``budget`` is a list whose length is not the number of ranks, ``world``."""
    if isinstance(budget, (list, tuple)) and len(budget) != world:
        raise SettingRefused(f"AutoFit: budget={list(budget)!r} has {len(budget)} entries, but this fit runs {world} "
                         f"rank{'s' if world != 1 else ''}: give one budget per rank, or one budget for every rank")


def rank_budget(budget: Any, rank: int, world: int, device: torch.device, local_ranks: int = 1) -> int:
    """This rank's budget in bytes.

    Raises:
        ValueError: for a list whose length is not the number of ranks.
    """
    check_budget_ranks(budget, world)
    if isinstance(budget, (list, tuple)):
        budget = budget[rank]
    if budget == "auto":
        return auto_budget(device, local_ranks)
    return parse_budget(budget)
