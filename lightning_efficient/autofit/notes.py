"""What AutoFit says beside its plan: the notes a plan carries on how it was made and what it cannot see,
and the budget a fit that measured above its own should be given."""

from __future__ import annotations

import math

from lightning.pytorch import LightningModule

from lightning_efficient.autofit.model import FitPlan
from lightning_efficient.memory import freed_heap_stays_resident


def _allocator_notes(pl_module: LightningModule) -> list[str]:
    """The plan's note on this process's allocator: on CPU where freed heap stays in the RSS (none otherwise)."""
    return [FREED_HEAP_RESIDENT] if pl_module.device.type == "cpu" and freed_heap_stays_resident() else []


#: what the advice to fit again with a wider margin leads to (a new user took it for a promise that a plan would fit)
_WIDER_MARGIN = (" (as wide as this miss: a new fit chooses its micro-batch and optimizer states again too), which plans for "
                 "peaks that much above the predictions, or, where no plan fits then, refuses the budget before the first "
                 "step, naming the least that would do")


#: the plan's note on CPU where glibc's allocator keeps freed heap in the RSS (a new user's trial: measured peaks 14-80%
#: above the predictions, above tight budgets in about half the fits; within 13% with the threshold set)
FREED_HEAP_RESIDENT = ("on CPU, memory is the process's RSS, in which glibc's allocator keeps the heap it freed: fits can read "
                       "well above these predictions (new users' models: 14-80%); MALLOC_MMAP_THRESHOLD_=131072 in the "
                       "environment the process starts with makes the RSS count what is held (fits then run 1.2-2x slower)")


#: the plan's note when the blocks were not profiled before the first step
NOT_PROFILED = "blocks not profiled: the fastest plan fits with every block kept"


def budget_advice(plan: FitPlan, measured: list[dict[str, float]], advised: float) -> str | None:
    """The larger budget for each rank measured over its budget whose plan was predicted above the budget less the
    margin (the leanest, taken after an unfreeze): no margin mends that miss. Each budget holds the rank's measured peak
    within it less the wider of the plan's margin and ``advised`` (a larger budget lets the search take a larger plan,
    which may miss alike). None where no rank is so."""
    above = [(rank, m["peak_bytes"]) for rank, (m, r, b) in enumerate(zip(measured, plan.ranks, plan.budgets))
             if m["peak_bytes"] > b and r.peak_bytes > b * (1 - plan.margin)]
    if not above:
        return None
    wider = max(plan.margin, advised)
    budgets = " and ".join(f"{'the' if len(plan.ranks) == 1 else f'rank {rank} a'} budget of at least "
                           f"{math.ceil(peak / (1 - wider) / 2**20):,} MiB" for rank, peak in above)
    return (f"give {budgets}" + (f" and AutoFit(margin={wider:.2f})" if wider > plan.margin else "")
            + f" ({'its plan was' if len(above) == 1 else 'their plans were'} predicted above the budget less the margin, "
            "which no margin mends)")
