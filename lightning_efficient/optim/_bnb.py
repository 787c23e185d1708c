"""bitsandbytes, imported on first use and without its note about optional CPU kernels.

``import lightning_efficient`` does not import bitsandbytes (it takes a while and prints a note):
the optimizer code calls :func:`bitsandbytes` where an 8-bit optimizer or state is first needed.
"""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType

# bitsandbytes (>= 0.49 on a CPU with AVX512-BF16) logs this warning from its CPU backend when the
# optional ``kernels`` package is missing; nothing we use needs those kernels (they serve 4-bit matmuls)
_KERNELS_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNELS_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropKernelsCommunityNote(logging.Filter):
    """Drops exactly bitsandbytes' note about the missing ``kernels`` package; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_KERNELS_MESSAGE)


@cache
def bitsandbytes() -> ModuleType:
    """The ``bitsandbytes`` module, imported on the first call with its kernels-community note dropped."""
    logger = logging.getLogger(_KERNELS_LOGGER)
    note_filter = _DropKernelsCommunityNote()
    logger.addFilter(note_filter)
    try:
        import bitsandbytes
        import bitsandbytes.functional
        import bitsandbytes.optim
    finally:
        logger.removeFilter(note_filter)
    return bitsandbytes
