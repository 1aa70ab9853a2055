"""The machine under the tests: the CPU flags lscpu lists, and transparent huge pages (whether
they are on, whether one is handed out now, whether an array lies on them)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest


def lscpu_flags() -> set[str]:
    if shutil.which("lscpu") is None:
        pytest.skip("no lscpu on this machine")
    for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
        if line.startswith("Flags:"):
            return set(line.partition(":")[2].split())
    pytest.skip("lscpu lists no flags here")


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", open(THP).read()).group(1)
    except (OSError, AttributeError):
        return None


def huge_bytes_in(lo: int, hi: int) -> int:
    """AnonHugePages of this process's mappings that overlap [lo, hi)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def huge_pages_obtainable() -> bool:
    """Whether this machine hands out a 2 MiB page now: an anonymous mapping of our own, advised
    and written. (No: THP off, or memory too fragmented; the tests below then prove nothing.)"""
    import ctypes
    import mmap

    size = 8 << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (a shared one is shmem)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m.write(b"\1" * size)
        start = ctypes.addressof(ctypes.c_char.from_buffer(m))  # (the view is gone by close)
        return huge_bytes_in(start, start + size) > 0
    finally:
        m.close()


def assert_mostly_huge(x):
    start = x.unsafe_buffer_pointer()
    assert not np.asarray(x).any()
    interior = (start + x.nbytes) // (2 << 20) * (2 << 20) - -(-start // (2 << 20)) * (2 << 20)
    assert huge_bytes_in(start, start + x.nbytes) >= interior // 2  # allocation may fall back in places
