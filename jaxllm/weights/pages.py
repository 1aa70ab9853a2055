"""The weights on 2 MiB pages (Linux's transparent huge pages), where the machine allows.

A decode step streams every weight once. On 4 KiB pages that stream crosses a page every 4 KiB,
and in a virtual machine each TLB miss walks two page tables: on the 2-vCPU Xeon kind a 2-thread
read of 1 GiB ran at 26 GB/s on 4 KiB pages and 32 GB/s on 2 MiB ones, and the 1.5B decoded one
stream 1.01-1.08x as fast with its weights moved onto them (benchmarks/results/xeon-amx/RESULTS.md).

XLA allocates the weights' buffers, so they cannot be advised before they are written (as the KV
pool's are: `native.zeros`). Instead `on_huge_pages` advises the whole 2 MiB pages inside the
buffers (`MADV_HUGEPAGE`) and asks Linux to move them there now (`MADV_COLLAPSE`, Linux 6.1 on),
on a thread of its own: the copy costs about 2 s a GB of system time there, which start-up does
not wait for. Only whole 2 MiB pages move: those inside each span of buffers lying side by side
(`MERGE_GAP`). Best effort: nothing on other systems, or where THP is off.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <linux/mman.h>
# Buffers this close count as one span: XLA's buffers for the weights mostly lie side by side, so
# the pages across them move too, the 1.5B's QKV and output matrices (under 4 MiB) among them.
MERGE_GAP = 64 << 10


def huge_page_ranges(tree) -> list[tuple[int, int]]:
    """(address, bytes) of the whole 2 MiB pages inside the CPU buffers of `tree`'s arrays, buffers
    at most MERGE_GAP apart taken as one span (the pages across a gap are theirs but for its at most
    64 KiB of whatever lies between, whose contents advice never changes)."""
    spans = set()
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            if shard.device.platform == "cpu":
                start = shard.data.unsafe_buffer_pointer()
                spans.add((start, start + shard.data.nbytes))  # (a set: trees may share arrays)
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    ranges = []
    for start, end in merged:
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            ranges.append((lo, hi - lo))
    return ranges


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def _collapse(madvise, ranges: list[tuple[int, int]]) -> None:
    start = time.perf_counter()
    moved = sum(n for at, n in ranges if madvise(at, n, MADV_COLLAPSE) == 0)
    logger.debug(
        "%d of %d MiB of weights moved onto 2 MiB pages in %.1f s",
        moved >> 20,
        sum(n for _, n in ranges) >> 20,
        time.perf_counter() - start,
    )


def on_huge_pages(tree, *, collapse: bool = True, wait: bool = False) -> threading.Thread | None:
    """Advise the whole 2 MiB pages over the CPU buffers of `tree`'s arrays (`huge_page_ranges`)
    as huge pages and, with `collapse`, move them there on a thread of its own (returned; joined
    first with `wait`).
    Only the addresses go to the thread: a buffer freed meanwhile is skipped or, reused, kept
    as it is (advice never changes memory's contents). None where there is nothing to do."""
    if not sys.platform.startswith("linux"):
        return None
    ranges = huge_page_ranges(tree)
    if not ranges:
        return None
    try:
        madvise = _madvise()
    except (OSError, AttributeError):
        return None
    # (Refused everywhere where THP is off: nothing to move then.)
    ranges = [(start, n) for start, n in ranges if madvise(start, n, MADV_HUGEPAGE) == 0]
    if not collapse or not ranges:
        return None
    thread = threading.Thread(target=_collapse, args=(madvise, ranges), name="jaxllm-huge-pages", daemon=True)
    thread.start()
    if wait:
        thread.join()
    return thread


__all__ = ["HUGE_PAGE", "huge_page_ranges", "on_huge_pages"]
