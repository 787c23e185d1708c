"""lightning_efficient: train language models with Lightning in less memory and less time."""

from lightning_efficient.activations import ActivationMemory
from lightning_efficient.autofit import AutoFit, StepTokenMean
from lightning_efficient.balance import HeterogeneousDDPStrategy, HeterogeneousFSDPStrategy
from lightning_efficient.demo import CorpusDataModule, DemoGPT
from lightning_efficient.optim import EightBitOptimizer
from lightning_efficient.report import MemoryReport
from lightning_efficient.tokens import FusedTokenLoss, SelectiveTokenLoss, TokenLosses, linear_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "ActivationMemory",
    "AutoFit",
    "CorpusDataModule",
    "DemoGPT",
    "EightBitOptimizer",
    "FusedTokenLoss",
    "HeterogeneousDDPStrategy",
    "HeterogeneousFSDPStrategy",
    "MemoryReport",
    "SelectiveTokenLoss",
    "StepTokenMean",
    "TokenLosses",
    "__version__",
    "linear_cross_entropy",
]
