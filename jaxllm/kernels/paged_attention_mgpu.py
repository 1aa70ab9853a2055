"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper warpgroup MMA, TMA page copies).

The same contract as `paged_attention.ragged_paged_attention` (the Triton kernel) and the
`jnp` oracle `reference.ragged_paged_attention_reference`: one call serves a whole ragged
batch of decodes and prefill chunks over the paged KV cache.

Why a second GPU kernel: Pallas' Triton backend is deprecated from jax 0.11; Mosaic GPU is
JAX's own GPU kernel language from then on. The Triton kernel stays for what this one does
not cover (see `unsupported`): float32, int8 and fp8 caches (a quantized row of head_dim + 4 bytes
is not 16-byte aligned, which TMA needs), pre-Hopper GPUs.

Work partition (as the Triton kernel's): the query heads sharing a KV head (`group`, padded to
a power of two) are folded into the rows of one 64-row tile (one warpgroup's MMA height), so
each K/V page is read once per KV head (GQA). A tile holds `64 // group` consecutive tokens of
one sequence. Before the kernel, `jnp` ops number the tiles (`tile_seq`, `tile_q_start`) and
gather q into `[num_kv_heads, num_tiles, 64, head_dim]`; after it, the tokens' rows are
gathered back from the per-tile output, so the kernel never stores a partial tile. The grid is
(num_kv_heads, num_tiles). Each program copies its q tile and its sequence's page-table row
(in copies of at most 256 entries, TMA's limit along a dimension) into shared memory (so a
page id is a shared-memory read), then walks the sequence's key blocks (`block_kv` keys =
whole pages, one TMA copy per page) through a ring of `stages` shared-memory slots: block
i+stages is copied while block i is multiplied. Scores and P @ V are warpgroup MMAs (bf16 in,
f32 accumulate); the online softmax runs in f32 registers. Sliding windows start at the first block the
window sees; no split over a long context yet (few long decodes use few SMs).

Checked without a GPU (tests/kernels/test_paged_attention_mgpu.py): numerics in Mosaic GPU's interpret
mode (`interpret=True`), which simulates shared memory, TMA copies and barriers on the CPU;
there the MMAs are `lax.dot_general` on the same shared-memory tiles (the interpreter has no
transposed MMA operand) and the register-layout hints are dropped. Lowering for `cuda` on
CPU runs Mosaic GPU's layout inference, which rejects kernels that could never compile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxllm.kernels.paged_attention import check_shapes, query_tiles

NEG_INF = -1e30
BLOCK_Q = 64  # query rows per program: one warpgroup's MMA height
SWIZZLE = 128  # bytes: shared-memory swizzle of every MMA operand
TABLE_CHUNK = 256  # page-table entries per TMA copy (a copy moves at most 256 along a dimension)


def unsupported(q_shape, cache_dtype, page_size: int) -> str | None:
    """Why this kernel cannot serve a call (None if it can): the caller then uses Triton."""
    _, num_q_heads, head_dim = q_shape
    cache_dtype = jnp.dtype(cache_dtype)
    if cache_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)):
        return f"{cache_dtype} cache (the Mosaic GPU kernel reads bfloat16 pages)"
    if head_dim % 64 or head_dim > 256:
        return f"head_dim {head_dim} (needs a multiple of 64, at most 256)"
    if page_size % 8 or (64 % page_size and page_size % 64):
        return f"page_size {page_size} (needs 8, 16, 32, 64 or a multiple of 64)"
    return None


def _kernel(
    tile_seq_ref,
    tile_q_start_ref,
    cu_q_lens_ref,
    kv_lens_ref,
    page_tables_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    table_smem,
    q_bar,
    table_bar,
    k_bar,
    v_bar,
    *,
    group: int,
    pages_per_block: int,
    stages: int,
    sm_scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    interpret: bool,
):
    """One (KV head, query tile) program. Refs without _smem/_bar are in global memory:
    q_ref / o_ref [num_kv_heads, num_tiles, BLOCK_Q, head_dim], k_ref / v_ref the page pools."""
    h, b = lax.axis_index("kv_head"), lax.axis_index("tile")
    block_kv = pages_per_block * k_ref.shape[2]
    seq = tile_seq_ref[b]

    @pl.when(seq >= 0)
    def _():
        _start_q_and_page_table_copies(q_ref, page_tables_ref, q_smem, table_smem, q_bar, table_bar, h, b, seq)
        base, lo, hi = _key_block_range(
            cu_q_lens_ref, kv_lens_ref, tile_q_start_ref, seq, b, group, block_kv, sliding_window
        )
        fetch = functools.partial(
            _fetch_key_block, h, pages_per_block, table_smem, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar
        )
        plgpu.barrier_wait(table_bar.at[0])
        _fill_ring(fetch, lo, hi, stages)

        def body(i, carry):
            slot = lax.rem(i - lo, jnp.int32(stages))
            plgpu.barrier_wait(k_bar.at[slot])
            s = _mma(q_smem, k_smem.at[slot], True, interpret) * sm_scale
            s, mask = _mask_scores(s, i, base, group, sliding_window, logits_soft_cap, interpret)
            carry = _online_softmax_update(carry, s, mask, p_smem, v_smem.at[slot], v_bar.at[slot], interpret)

            @pl.when(i + stages < hi)  # the slot's MMAs are done: refill it
            def _():
                fetch(i + stages, slot)

            return carry

        init = _softmax_init(q_smem.shape[1], interpret)
        plgpu.barrier_wait(q_bar.at[0])
        _, l, acc = lax.fori_loop(lo, hi, body, init)
        _store_output(acc, l, q_smem, o_ref.at[h, b])


def _mma(a_ref, b_ref, transpose_b: bool, interpret: bool):
    """a @ b (or a @ b.T) of two shared-memory tiles, bf16 in, f32 out."""
    if interpret:
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        return lax.dot_general(a_ref[...], b_ref[...], dims, preferred_element_type=jnp.float32)
    n = b_ref.shape[0] if transpose_b else b_ref.shape[1]

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)) if transpose_b else b_ref)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((a_ref.shape[0], n), jnp.float32))


def _layout(x, to, interpret: bool):  # register layout hints; the interpreter has no layouts
    return x if interpret else plgpu.layout_cast(x, to)


def _iota(dim: int, block_kv: int, interpret: bool):
    """Row (dim 0) or key (dim 1) indices of a [BLOCK_Q, block_kv] score tile, in the MMA's layout."""
    shape = (BLOCK_Q, block_kv)
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _start_q_and_page_table_copies(q_ref, page_tables_ref, q_smem, table_smem, q_bar, table_bar, h, b, seq):
    """Start copying the q tile and the sequence's page-table row into shared memory (the
    barriers q_bar, table_bar say when they have arrived)."""
    plgpu.copy_gmem_to_smem(q_ref.at[h, b], q_smem, q_bar.at[0])
    width = min(table_smem.shape[0], TABLE_CHUNK)
    for c in range(table_smem.shape[0] // width):  # the row in copies of <= TABLE_CHUNK entries
        cols = pl.ds(c * width, width)
        plgpu.copy_gmem_to_smem(page_tables_ref.at[seq, cols], table_smem.at[cols], table_bar.at[0])


def _key_block_range(cu_q_lens_ref, kv_lens_ref, tile_q_start_ref, seq, b, group, block_kv, sliding_window):
    """(base, lo, hi): the cache position of the tile's first token, and the key blocks [lo, hi)
    it sees, from the first its sliding window reaches to the last its last token reaches."""
    q_start = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - q_start
    kv_len = kv_lens_ref[seq]
    first_tok = tile_q_start_ref[b]
    # Row r is token first_tok + r // group at cache position base + r // group.
    base = kv_len - q_len + first_tok
    last_pos = base + jnp.minimum(BLOCK_Q // group, q_len - first_tok) - 1
    hi = lax.div(last_pos + block_kv, jnp.int32(block_kv))
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = lax.div(jnp.maximum(base - sliding_window + 1, 0), jnp.int32(block_kv))
    return base, lo, hi


def _fetch_key_block(h, pages_per_block, table_smem, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, i, slot):
    """Key block i -> ring slot `slot`: one TMA copy per page, for K and for V."""
    page_size = k_ref.shape[2]
    for j in range(pages_per_block):
        page = table_smem[i * pages_per_block + j]
        rows = pl.ds(j * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, rows], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, rows], v_bar.at[slot])


def _fill_ring(fetch, lo, hi, stages: int):
    """Start copying the first `stages` key blocks (those below hi) into the ring's slots."""
    for s in range(stages):

        @pl.when(lo + s < hi)
        def _():
            fetch(lo + s, s)


def _mask_scores(s, i, base, group, sliding_window, logits_soft_cap, interpret):
    """Key block i's scores [BLOCK_Q, block_kv], soft-capped, masked (causal, sliding window) to
    NEG_INF, and the mask."""
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    # key k is visible to row r iff k <= base + r // group, i.e. (k - base) * group <= r
    # (rows past the sequence's tokens compute garbage that nobody gathers)
    block_kv = s.shape[1]
    r, k = _iota(0, block_kv, interpret), _iota(1, block_kv, interpret) + i * block_kv
    mask = (k - base) * group <= r
    if sliding_window is not None:  # k > base + r // group - window
        mask &= (k - base + sliding_window) * group > r
    return jnp.where(mask, s, NEG_INF), mask


def _online_softmax_update(carry, s, mask, p_smem, v_tile, v_arrived, interpret):
    """One key block's step of the online softmax: the running max `m`, sum `l` and output `acc`
    after the masked scores `s`; P goes through shared memory into the P @ V MMA, which waits
    for the block's V (`v_arrived`) first."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    # Keys past kv_len (a last page's stale slots) get weight exactly 0; unlike the Triton
    # kernel their V rows are not zeroed, so they must be finite (0 * NaN in the MMA):
    # the pool starts zeroed and only ever holds written keys/values.
    p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(axis=1)
    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(v_arrived)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + _mma(p_smem, v_tile, False, interpret)
    return m_new, l, acc


def _softmax_init(head_dim: int, interpret: bool):
    """The online softmax's (m, l, acc) before the first key block, in the MMA's register layout."""
    rows = plgpu.Layout.WGMMA.reduce(1)
    return (
        _layout(jnp.full((BLOCK_Q,), NEG_INF, jnp.float32), rows, interpret),
        _layout(jnp.full((BLOCK_Q,), 0.0, jnp.float32), rows, interpret),
        _layout(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret),
    )


def _store_output(acc, l, q_smem, o_tile):
    """Normalize the output, stage it in q's shared memory (q is no longer needed) and copy it
    to `o_tile` in global memory, waiting for the copy."""
    acc = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
    q_smem[...] = acc.astype(q_smem.dtype)  # q is no longer needed: stage the output
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_tile)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "logits_soft_cap", "interpret", "block_kv", "stages")
)
def ragged_paged_attention_mgpu(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    sliding_window=None,
    logits_soft_cap=None,
    interpret=False,
    block_kv=64,
    stages=3,
):
    """Ragged paged attention (shapes: `paged_attention.py`). Static knobs: `block_kv` keys per
    pipeline step (whole pages, a multiple of 64), `stages` shared-memory slots in the ring."""
    check_shapes(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens)
    _check_mgpu_shapes(q.shape, k_pages, block_kv, stages)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    tile_q = BLOCK_Q // group_pad
    pages_per_block = block_kv // page_size
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if k_pages.dtype == jnp.uint16:  # bf16 bit patterns (kv_write.storage_dtype)
        k_pages = lax.bitcast_convert_type(k_pages, jnp.bfloat16)
        v_pages = lax.bitcast_convert_type(v_pages, jnp.bfloat16)
    dtype = k_pages.dtype
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_seq, tile_q_start, tiles_start = query_tiles(cu_q_lens, num_seqs, num_tokens, tile_q)
    qg = _gather_query_tiles(q, dtype, cu_q_lens, tile_seq, tile_q_start, num_kv_heads, group_pad)
    page_tables, table_copies = _padded_page_tables(page_tables, pages_per_block)
    kernel = functools.partial(
        _kernel,
        group=group_pad,
        pages_per_block=pages_per_block,
        stages=stages,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        interpret=bool(interpret),
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(qg.shape, dtype),
        grid=(num_kv_heads, tile_seq.shape[0]),
        grid_names=("kv_head", "tile"),
        scratch_types=_scratch_types(
            dtype, head_dim, block_kv, stages, pages_per_block, page_tables.shape[1], table_copies
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params() if interpret else None,
    )(tile_seq, tile_q_start, cu_q_lens, kv_lens.astype(jnp.int32), page_tables, qg, k_pages, v_pages)
    return _gather_output_tokens(out, q, cu_q_lens, num_seqs, tiles_start, group_pad)


def _check_mgpu_shapes(q_shape, k_pages, block_kv: int, stages: int) -> None:
    """What this kernel needs beyond `check_shapes` (see `unsupported`): ValueError if not."""
    num_q_heads, page_size = q_shape[1], k_pages.shape[2]
    if (why := unsupported(q_shape, k_pages.dtype, page_size)) is not None:
        raise ValueError(f"the Mosaic GPU kernel does not serve a {why}")
    group = num_q_heads // k_pages.shape[0]
    if pl.next_power_of_2(group) > BLOCK_Q:
        raise ValueError(f"{group} query heads per KV head: at most {BLOCK_Q}")
    if block_kv % 64 or block_kv % page_size or stages < 1:
        raise ValueError(
            f"block_kv {block_kv} must be a multiple of 64 and of page_size {page_size}; stages {stages} >= 1"
        )


def _gather_query_tiles(q, dtype, cu_q_lens, tile_seq, tile_q_start, num_kv_heads: int, group_pad: int):
    """q as `dtype` tiles [num_kv_heads, num_tiles, BLOCK_Q, head_dim], zeros where a row has no
    query (padding heads and tokens, unused tiles)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    # Row r of tile b is query head r % group_pad of the KV head's group, token
    # tile_q_start[b] + r // group_pad of its sequence.
    r = jnp.arange(BLOCK_Q, dtype=jnp.int32)
    seq = jnp.maximum(tile_seq, 0)[:, None]
    tok = tile_q_start[:, None] + r[None] // group_pad
    valid = (tile_seq[:, None] >= 0) & (tok < cu_q_lens[seq + 1] - cu_q_lens[seq]) & (r[None] % group_pad < group)
    token = jnp.where(valid, cu_q_lens[seq] + tok, 0)
    head = jnp.minimum(r % group_pad, group - 1)
    qg = q.astype(dtype).reshape(num_tokens, num_kv_heads, group, head_dim)[token, :, head[None]]
    return jnp.where(valid[..., None, None], qg, jnp.zeros_like(qg)).transpose(2, 0, 1, 3)


def _padded_page_tables(page_tables, pages_per_block: int):
    """Page table rows padded for their TMA copies into shared memory, and how many copies a row
    takes: whole key blocks, 16-byte multiples, whole TABLE_CHUNKs past one chunk."""
    pages_per_seq = page_tables.shape[1]
    pad_pages = -pages_per_seq % math.lcm(pages_per_block, 4)  # a row's TMA copy: 16-byte multiples
    if pages_per_seq + pad_pages > TABLE_CHUNK:  # copied in whole chunks
        pad_pages += -(pages_per_seq + pad_pages) % TABLE_CHUNK
    table_copies = max(1, (pages_per_seq + pad_pages) // TABLE_CHUNK)
    return jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, pad_pages))), table_copies


def _scratch_types(dtype, head_dim, block_kv, stages, pages_per_block, table_len, table_copies):
    """The kernel's shared memory (q tile, K and V rings, P, the page-table row; MMA operands
    tiled and swizzled) and barriers (q, page table, one per ring slot for K and for V)."""
    tiling = plgpu.TilingTransform((8, SWIZZLE // dtype.itemsize))
    smem = functools.partial(plgpu.SMEM, dtype=dtype, transforms=(tiling, plgpu.SwizzleTransform(SWIZZLE)))
    return [
        smem((BLOCK_Q, head_dim)),
        smem((stages, block_kv, head_dim)),
        smem((stages, block_kv, head_dim)),
        smem((BLOCK_Q, block_kv)),
        plgpu.SMEM((table_len,), jnp.int32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=table_copies, num_barriers=1),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
    ]


def _gather_output_tokens(out, q, cu_q_lens, num_seqs, tiles_start, group_pad: int):
    """The tokens' rows of the kernel's output tiles, back as q: [T, num_q_heads, head_dim] in
    q.dtype, padding tokens zeroed."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_tiles = out.shape[:2]
    num_seqs_max = cu_q_lens.shape[0] - 1
    group, tile_q = num_q_heads // num_kv_heads, BLOCK_Q // group_pad
    # Token t of sequence s is row ((t - cu[s]) % tile_q) * group_pad + g of tile
    # tiles_start[s] + (t - cu[s]) // tile_q.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    t_seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, num_seqs_max - 1)
    local = t - cu_q_lens[t_seq]
    t_tile = jnp.clip(tiles_start[t_seq] + local // tile_q, 0, num_tiles - 1)
    t_row = (local % tile_q)[:, None] * group_pad + jnp.arange(group, dtype=jnp.int32)[None]
    o = out[:, t_tile[:, None], t_row]  # [num_kv_heads, T, group, head_dim]
    o = o.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
    real = t < cu_q_lens[num_seqs]
    return jnp.where(real[:, None, None], o, jnp.zeros_like(o))


def _interpret_params():
    """Mosaic GPU's interpret mode (CPU): simulated shared memory, TMA copies and barriers."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
