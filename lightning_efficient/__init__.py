"""lightning_efficient: train language models with Lightning in less memory and less time."""

from lightning_efficient.demo import CorpusDataModule, DemoGPT
from lightning_efficient.report import MemoryReport
from lightning_efficient.tokens import TokenLosses

__version__ = "0.1.0"

__all__ = ["CorpusDataModule", "DemoGPT", "MemoryReport", "TokenLosses", "__version__"]
