"""The built-in demo: a small GPT trained on the Python standard library's sources."""

from lightning_efficient.demo.data import CorpusDataModule
from lightning_efficient.demo.model import DemoGPT

__all__ = ["CorpusDataModule", "DemoGPT"]
