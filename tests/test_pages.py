"""The KV pool on 2 MiB pages (`pages.advise_huge_pages`): the contents kept, and what a donated
step writes after, the memory really backed by huge pages where the kernel offers them, nothing
done elsewhere."""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner import pages

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


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
                    reason="transparent huge pages unavailable")
def test_a_pool_moves_to_huge_pages_with_its_contents():
    x = jnp.arange(6 << 20, dtype=jnp.float32).reshape(6, 1 << 20)    # 24 MiB
    small = jnp.ones((1024,), jnp.float32)                             # below 4 MiB: left alone
    moved = pages.advise_huge_pages([(x, small)])
    if moved == 0:
        pytest.skip(f"madvise(MADV_COLLAPSE) refused here (kernel {os.uname().release})")
    start = x.unsafe_buffer_pointer()
    assert 20 << 20 <= moved <= x.nbytes
    assert huge_bytes_in(start, start + x.nbytes) >= moved
    np.testing.assert_array_equal(np.asarray(x).ravel(), np.arange(6 << 20, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(small), 1.0)
    # Written in place as the step writes pages (donated), then read back.
    rows = jnp.arange(6)[:, None] * 7.0 + jnp.arange(1 << 20, dtype=jnp.float32)[None, :]
    y = jax.jit(lambda x, r: x.at[:, ::1024].set(r[:, ::1024]), donate_argnums=0)(x, rows)
    assert y.unsafe_buffer_pointer() == start
    want = np.arange(6 << 20, dtype=np.float32).reshape(6, 1 << 20)
    want[:, ::1024] = np.asarray(rows)[:, ::1024]
    np.testing.assert_array_equal(np.asarray(y), want)
    assert huge_bytes_in(start, start + y.nbytes) >= moved


def test_nothing_advised_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert pages.advise_huge_pages([jnp.zeros((2 << 20,), jnp.float32)]) == 0
