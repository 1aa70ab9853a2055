"""The KV pool on 2 MiB pages (`native.zeros`, csrc/kv_write.cc): zeros, K and V apart, what a
donated step writes kept in place, and the memory really backed by huge pages where Linux offers
them; and the weights moved onto them after they are placed (`weights/pages.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import native
from jaxllm.runner import kv_cache as pages
from jaxllm.weights.pages import HUGE_PAGE, huge_page_ranges, on_huge_pages

from tests.helpers import ROOT
from tests.helpers.cpu_host import assert_mostly_huge, huge_bytes_in, huge_pages_obtainable, thp_mode

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native kernel: {native.unavailable_reason()}")


def test_pool_is_zeros_and_takes_writes_in_place():
    # Two layers of (k, v) [kv_heads 2, pages 96, page 64, row 64] bf16: 1.5 MiB each, as the runner makes them.
    make = pages.kv_cache_maker(
        [96, 96], 2, 64, 64, "bfloat16", 1, jax.sharding.SingleDeviceSharding(jax.devices()[0]), zeros=native.zeros
    )
    cache = make()
    arrays = jax.tree_util.tree_leaves(cache)
    assert len({x.unsafe_buffer_pointer() for x in arrays}) == 4  # never one buffer for K and V
    assert all(x.shape == (2, 96, 64, 64) and x.dtype == jnp.uint16 and not np.asarray(x).any() for x in arrays)
    k = arrays[0]
    start = k.unsafe_buffer_pointer()
    k = jax.jit(lambda k: k.at[1, 5].set(7), donate_argnums=0)(k)
    assert k.unsafe_buffer_pointer() == start
    want = np.zeros((2, 96, 64, 64), np.uint16)
    want[1, 5] = 7
    np.testing.assert_array_equal(np.asarray(k), want)


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() in (None, "never"), reason="transparent huge pages unavailable"
)


@needs_thp
def test_a_large_pool_lies_on_huge_pages():
    if not huge_pages_obtainable():
        pytest.skip("this machine gives no 2 MiB page to an advised mapping now")
    assert_mostly_huge(jax.jit(lambda: native.zeros((8, 1 << 20), jnp.float32))())  # 32 MiB


# Run in a child whose malloc never maps (glibc's MALLOC_MMAP_MAX_=0, one arena, no trimming): the
# pool then reuses heap memory that an earlier buffer touched on 4 KiB pages, as happens in a long
# process whose heap has a large free hole.
REUSED_HEAP = """
import sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from jaxllm.kernels import native
from tests.helpers.cpu_host import assert_mostly_huge
zeros = jax.jit(lambda: native.zeros((8, 1 << 20), jnp.float32)).lower().compile()   # madvises nothing yet
ones = jax.jit(lambda s: jnp.full((9, 1 << 20), s, jnp.float32))(1.0)
ones.block_until_ready()
was = ones.unsafe_buffer_pointer()
ones.delete()
x = zeros()
if x.unsafe_buffer_pointer() != was:
    sys.exit(3)
assert_mostly_huge(x)
"""


@needs_thp
def test_a_pool_on_reused_heap_memory_lies_on_huge_pages():
    if not huge_pages_obtainable():
        pytest.skip("this machine gives no 2 MiB page to an advised mapping now")
    env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_ARENA_MAX="1", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    child = subprocess.run(
        [sys.executable, "-c", REUSED_HEAP.format(root=ROOT)], env=env, capture_output=True, text=True, timeout=300
    )
    if child.returncode == 3:
        pytest.skip("this malloc did not hand the freed buffer back")
    assert child.returncode == 0, child.stderr[-2000:]


def test_huge_page_ranges_are_whole_pages_over_the_buffers():
    big = jax.jit(lambda: jnp.ones((3 << 20,), jnp.float32))()  # 12 MiB: at least five whole pages
    small = jnp.ones((1024,), jnp.float32)
    ranges = huge_page_ranges({"a": big, "b": small, "tied": big})  # (the shared array once)
    start, end = big.unsafe_buffer_pointer(), big.unsafe_buffer_pointer() + big.nbytes
    inner = (-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE)
    assert all(lo % HUGE_PAGE == 0 and n % HUGE_PAGE == 0 and n > 0 for lo, n in ranges)
    assert sorted(ranges) == ranges and all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    assert sum(lo <= inner[0] and inner[1] <= lo + n for lo, n in ranges) == 1
    buffers = [(x.unsafe_buffer_pointer(), x.unsafe_buffer_pointer() + x.nbytes) for x in (big, small)]
    for lo, n in ranges:  # every page reaches into a buffer, and lies within the buffers' span
        assert min(a for a, _ in buffers) <= lo and lo + n <= max(b for _, b in buffers)
        for page in range(lo, lo + n, HUGE_PAGE):
            assert any(a < page + HUGE_PAGE and page < b for a, b in buffers)


def needs_collapse():
    """Skip unless Linux moves pages already written onto huge ones (MADV_COLLAPSE, Linux 6.1)."""
    if not huge_pages_obtainable():
        pytest.skip("this machine gives no 2 MiB page to an advised mapping now")
    if tuple(int(p) for p in os.uname().release.split(".")[:2]) < (6, 1):
        pytest.skip("no MADV_COLLAPSE before Linux 6.1")


def wait_moved() -> None:
    for thread in threading.enumerate():
        if thread.name == "jaxllm-huge-pages":
            thread.join()


@needs_thp
def test_an_array_moves_onto_huge_pages_unchanged():
    needs_collapse()
    x = jax.jit(lambda: jnp.arange(8 << 20, dtype=jnp.float32) * 0.5)()  # 32 MiB, on XLA's own pages
    start, want = x.unsafe_buffer_pointer(), np.array(x)
    if huge_bytes_in(start, start + x.nbytes):
        pytest.skip("the buffer already lies on huge pages (THP always)")
    assert on_huge_pages(x, wait=True) is not None
    ((lo, n),) = huge_page_ranges(x)
    assert huge_bytes_in(start, start + x.nbytes) >= n // 2  # (a page may stay small where memory is short)
    np.testing.assert_array_equal(np.asarray(x), want)


@needs_thp
def test_the_engine_moves_its_weights_onto_huge_pages(tiny_model_dir):
    from jaxllm import LLM

    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    needs_collapse()
    llm = LLM(tiny_model_dir, **TINY_ENGINE_ARGS)
    wait_moved()
    runner = llm.engine.runner
    table = max(jax.tree_util.tree_leaves((runner.params, runner.small_params)), key=lambda x: x.nbytes)
    ((lo, n),) = huge_page_ranges(table)  # the 49,152-row embedding table: 12 MiB
    start = table.unsafe_buffer_pointer()
    assert huge_bytes_in(start, start + table.nbytes) >= n // 2
