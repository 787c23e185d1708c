"""AutoFit: the fastest plan across micro-batch, activation policies and optimizer precision that fits a memory budget."""

from lightning_efficient._validation import SettingRefused
from lightning_efficient.autofit.callback import AutoFit
from lightning_efficient.autofit.model import BudgetTooSmall, FitPlan, OptimizerOption, RankProfile, search
from lightning_efficient.autofit.token_mean import StepTokenMean

__all__ = ["AutoFit", "BudgetTooSmall", "FitPlan", "OptimizerOption", "RankProfile", "SettingRefused", "StepTokenMean", "search"]
