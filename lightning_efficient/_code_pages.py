"""The libraries' code pages a piece of work touched, handed back afterwards (Linux).

On CPU a fit's memory is its RSS above the start, and RSS counts the pages of shared-library code
the process has run. Measuring before the first step (AutoFit runs every activation policy and every
optimizer option once) runs code the fit itself may never run again: about 17 MiB of libtorch's code
on the benchmark's demo, which then stays resident and reads as training memory. These pages are
clean copies of files: unmapping them loses nothing (they stay in the page cache, and a page the fit
runs again faults back in from it), so :meth:`CodePages.release_touched` unmaps the ones touched since
:meth:`CodePages.snapshot`.

Only pages of private executable file mappings that hold no anonymous (copied-on-write) page are
unmapped, and only pages that are the file's own (pagemap's file-page bit): their contents are exactly
the file's. Elsewhere than Linux, or where ``/proc/self/pagemap`` cannot
be read, nothing is done.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _code_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of every private executable file mapping with no anonymous page."""
    mappings: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, device, inode, path
                low, high = (int(x, 16) for x in fields[0].split("-"))
                file_backed = len(fields) >= 6 and fields[5].startswith("/")
                current = (low, high) if fields[1] == "r-xp" and file_backed else None
            elif fields[0] == "Anonymous:" and current is not None:
                if int(fields[1]) == 0:
                    mappings.append(current)
                current = None
    return mappings


_PRESENT = -(2**63)  # pagemap's bit 63 (the sign bit of an int64): the page is mapped into this process
_FILE_PAGE = 2**61  # bit 61: a page of the file (or shared); clear for a page copied on write into anonymous memory


def _present(pagemap: int, low: int, high: int) -> torch.Tensor:
    """One bool per page of ``[low, high)``: mapped into this process now, as a page of the file."""
    pages = (high - low) // _PAGE
    raw = os.pread(pagemap, 8 * pages, 8 * (low // _PAGE))
    if len(raw) != 8 * pages:
        raise ValueError(f"short pagemap read: {len(raw)} of {8 * pages} bytes")
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    return ((entries & _PRESENT) != 0) & ((entries & _FILE_PAGE) != 0)


class CodePages:
    """Snapshot the code pages present now; later, unmap the ones touched since (see the module docstring)."""

    def __init__(self) -> None:
        self._before: dict[tuple[int, int], torch.Tensor] | None = None

    def snapshot(self) -> None:
        """Note which code pages are present now (nothing where the system cannot say)."""
        self._before = _read_present()

    def release_touched(self) -> int:
        """Unmap the code pages present now that were not at :meth:`snapshot`; returns their bytes (0 without
        a snapshot, or where the system cannot say). Never raises: handing memory back is not worth a fit."""
        before, self._before = self._before, None
        if before is None:
            return 0
        try:
            return _release(before)
        except Exception:  # noqa: BLE001 - an unexpected /proc format or libc: nothing released
            return 0


def _release(before: dict[tuple[int, int], torch.Tensor]) -> int:
    """Unmap the file pages of the code mappings present now and not in ``before``; their bytes."""
    now = _read_present()
    madvise = _madvise()
    if now is None or madvise is None:
        return 0
    released = 0
    for (low, high), present in now.items():
        earlier = before.get((low, high))
        touched = present if earlier is None else present & ~earlier
        for first, last in _runs(touched):
            if madvise(low + first * _PAGE, (last - first) * _PAGE, mmap.MADV_DONTNEED) == 0:
                released += (last - first) * _PAGE
    return released


def _read_present() -> dict[tuple[int, int], torch.Tensor] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        return {(low, high): _present(pagemap, low, high) for low, high in _code_mappings()}
    except (OSError, ValueError):
        return None
    finally:
        os.close(pagemap)


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(first, end)`` of each run of true values in a 1-D bool tensor."""
    if not bool(mask.any()):
        return []
    padded = torch.cat([torch.zeros(1, dtype=torch.int8), mask.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = torch.nonzero(padded[1:] - padded[:-1]).flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))
