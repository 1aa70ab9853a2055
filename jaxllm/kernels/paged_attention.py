"""Ragged paged attention as a Pallas GPU kernel (Triton backend).

One call serves a whole ragged batch: decodes (one query token) and prefill chunks (many)
of many sequences, each attending causally to its own paged KV cache.

    q:            [T, num_q_heads, head_dim]     (rows past cu_q_lens[num_seqs] are padding)
    k_pages:      [num_kv_heads, num_pages, page_size, head_dim]   (same for v_pages)
                  float32, bfloat16, or bfloat16 stored as uint16 bit patterns; or int8 rows
                  [..., head_dim + 4], codes then the f32 scale's bytes, or the same rows of
                  fp8 (E4M3) codes stored as uint8 bit patterns (kv_write.py)
    kv_lens:      [S] int32   tokens in each sequence's cache, this step's included
    page_tables: [S, pages_per_seq] int32
    cu_q_lens:    [S + 1] int32   sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1] of q
    num_seqs:     int32 scalar, sequences past it are padding
    returns       [T, num_q_heads, head_dim] in q.dtype, padding rows zero

The semantics are exactly those of `reference.ragged_paged_attention_reference`.

Backend: Triton (`compiler_params=pltriton.CompilerParams(...)`), not Mosaic GPU, the
default on cuda in jax 0.10.2. The kernel's core is a gather of KV pages through the block
table (`k_pages_ref[page_ids]`), row-masked stores for ragged query tiles, and a
data-dependent page loop; Triton expresses all three directly as pointer arithmetic on
global memory, which is how jax's own `pallas.ops.gpu.paged_attention` is written. Mosaic GPU
asks for explicit shared-memory/TMA pipelines with tiles in multiples of 128 elements, a
much larger kernel for small, scattered pages. Triton is deprecated from jax 0.11; port to
Mosaic GPU when the engine moves past 0.10.

Work partition. The query heads that share a KV head (`group` of them, padded to a power of
two) are folded into the rows of one tile, so K/V are read once per KV head and never
repeated (GQA). q is laid out as [num_kv_heads, tokens * group, head_dim]; a *query tile*
is `tile_q = tile_rows // group` consecutive tokens of one sequence, i.e. `tile_rows` rows.
Before the kernel, a few `jnp` ops (on device, no host sync) number the query tiles of all
sequences: `tile_seq[b]` (-1 for unused grid slots) and `tile_q_start[b]` (first token of
tile b within its sequence). The grid is (num_kv_heads, max_num_tiles) with the static
bound max_num_tiles = (T + min(S, T) * (tile_q - 1)) // tile_q. Each program loads its
q tile, walks the sequence's pages `tile_keys` keys at a time with an online softmax in
float32 (running max, running sum), from the first page its sliding window can see to the
last page its last query token can see, and stores only its sequence's rows. A long
context is not split across programs (no split-K), so a batch of few long decodes uses few
programs. head_dim and page_size must be powers of two (Triton tile shapes); the page pool
is never padded or copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels.kv_write import INT8_SCALE_BYTES, fp8_bits_to_f32, logical_pages, quantized_rows

NEG_INF = -1e30


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def dot_precision():
    """The precision of the Triton kernels' dots, taken from JAX's config as `jnp.dot` takes it:
    float32 operands multiply as TF32 on GPUs by default (Pallas' DEFAULT), as IEEE float32 under
    `jax.default_matmul_precision("highest")` (or "float32"). bf16 operands are unaffected."""
    wanted = str(jax.config.jax_default_matmul_precision or "").lower()
    return lax.Precision.HIGHEST if wanted in ("highest", "float32") else None


def _load_rows(pages_ref, page_ids, head_dim: int):
    """Pages `page_ids` of a KV head as [pages, page_size, head_dim] in their logical dtype; int8
    and fp8 rows dequantized, each scale assembled from its 4 bytes (Triton has no narrowing
    bitcast), fp8 codes decoded with integer ops (`fp8_bits_to_f32`)."""
    if not quantized_rows(pages_ref.dtype):
        return logical_pages(pages_ref[page_ids])
    bits = None
    for j in range(INT8_SCALE_BYTES):
        byte = pages_ref[page_ids, :, head_dim + j].astype(jnp.int32) & 0xFF
        bits = byte if bits is None else bits | (byte << (8 * j))
    scale = lax.bitcast_convert_type(bits, jnp.float32)
    codes = pages_ref[page_ids, :, pl.ds(0, head_dim)]
    codes = fp8_bits_to_f32(codes) if pages_ref.dtype == jnp.uint8 else codes.astype(jnp.float32)
    return codes * scale[..., None]


def _ragged_paged_attention_kernel(
    # inputs
    tile_seq_ref,  # [num_tiles] int32, -1 for an unused grid slot
    tile_q_start_ref,  # [num_tiles] int32, first token of the tile within its sequence
    cu_q_lens_ref,  # [S + 1] int32
    kv_lens_ref,  # [S] int32
    page_tables_ref,  # [S, pages_per_seq_padded] int32
    q_ref,  # [(T + tile_q) * group, head_dim] of this KV head
    k_pages_ref,  # [num_pages, page_size, head_dim] of this KV head
    v_pages_ref,  # [num_pages, page_size, head_dim] of this KV head
    # outputs
    o_ref,  # [(T + tile_q) * group, head_dim] of this KV head
    *,
    group: int,
    tile_rows: int,
    pages_per_tile: int,
    sm_scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    precision,
):
    b = pl.program_id(1)
    seq = tile_seq_ref[b]

    @pl.when(seq >= 0)
    def _():
        head_dim = q_ref.shape[1]
        tile_keys = pages_per_tile * k_pages_ref.shape[1]
        q_start = cu_q_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - q_start
        kv_len = kv_lens_ref[seq]
        first_tok = tile_q_start_ref[b]
        ctx_before = kv_len - q_len  # cache positions before this step's tokens
        rows, row_valid, q_pos, q = _load_query_tile(q_ref, q_start, q_len, first_tok, ctx_before, group, tile_rows)
        lo, hi = _key_tile_range(q_len, first_tok, ctx_before, tile_rows // group, tile_keys, sliding_window)

        def body(i, carry):
            page_ids = page_tables_ref[seq, pl.ds(i * pages_per_tile, pages_per_tile)]
            k = _load_rows(k_pages_ref, page_ids, head_dim).reshape(tile_keys, head_dim)
            v = _load_rows(v_pages_ref, page_ids, head_dim).reshape(tile_keys, head_dim)
            s, mask, k_pos = _masked_scores(q, k, i, q_pos, sm_scale, sliding_window, logits_soft_cap, precision)
            return _online_softmax_update(carry, s, mask, v, k_pos, kv_len, precision)

        init = (
            jnp.full((tile_rows,), NEG_INF, jnp.float32),
            jnp.zeros((tile_rows,), jnp.float32),
            jnp.zeros((tile_rows, head_dim), jnp.float32),
        )
        _, l, acc = lax.fori_loop(lo, hi, body, init)
        o = acc / jnp.maximum(l, 1e-30)[:, None]
        # Rows past the sequence belong to the next sequence's tiles (or to padding).
        pltriton.store(o_ref.at[rows, :], o.astype(o_ref.dtype), mask=row_valid[:, None])


def _load_query_tile(q_ref, q_start, q_len, first_tok, ctx_before, group: int, tile_rows: int):
    """The program's `tile_rows` rows of q (row r: token first_tok + r // group of the sequence
    starting at row q_start * group): (their row slice, which rows are real tokens, each row's
    cache position (-1 for padding, which masks every key), the q tile with padding rows zeroed)."""
    tok = first_tok + lax.div(lax.broadcasted_iota(jnp.int32, (tile_rows,), 0), group)
    row_valid = tok < q_len
    q_pos = jnp.where(row_valid, ctx_before + tok, -1)  # -1 masks every key
    rows = pl.ds((q_start + first_tok) * group, tile_rows)
    q = q_ref[rows, :]
    q = jnp.where(row_valid[:, None], q, jnp.zeros_like(q))  # padding may hold NaN
    return rows, row_valid, q_pos, q


def _key_tile_range(q_len, first_tok, ctx_before, tile_q: int, tile_keys: int, sliding_window: int | None):
    """[lo, hi): the key tiles the query tile sees, from the first its sliding window reaches to
    the last its last query token reaches."""
    last_pos = ctx_before + jnp.minimum(first_tok + tile_q, q_len) - 1
    hi = lax.div(last_pos + tile_keys, tile_keys)
    lo = 0
    if sliding_window is not None:
        lo = lax.div(jnp.maximum(ctx_before + first_tok - sliding_window + 1, 0), tile_keys)
    return lo, hi


def _masked_scores(q, k, i, q_pos, sm_scale, sliding_window, logits_soft_cap, precision):
    """Scores [tile_rows, tile_keys] f32 of the query tile against key tile `i` (soft-capped, causal
    and sliding-window masked to NEG_INF), the mask, and the keys' cache positions."""
    tile_keys = k.shape[0]
    s = pltriton.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [tile_rows, tile_keys] f32
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    k_pos = i * tile_keys + lax.broadcasted_iota(jnp.int32, (tile_keys,), 0)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return jnp.where(mask, s, NEG_INF), mask, k_pos


def _online_softmax_update(carry, s, mask, v, k_pos, kv_len, precision):
    """One key tile's step of the online softmax: the running max `m`, sum `l` and output `acc`
    after the masked scores `s` and the values `v` of the keys at cache positions `k_pos`."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(axis=-1)
    # Slots past the sequence's end in its last page may hold stale bits (even NaN):
    # p is 0 there, but 0 * NaN is not.
    v = jnp.where((k_pos < kv_len)[:, None], v, jnp.zeros_like(v))
    acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
    return m_new, l, acc


def check_shapes(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens) -> None:
    """The contract's shapes (module docstring), checked for every GPU kernel: ValueError if not."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, row = k_pages.shape
    num_seqs_max = page_tables.shape[0]
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} {v_pages.dtype} must match"
        )
    if row != head_dim + (INT8_SCALE_BYTES if quantized_rows(k_pages.dtype) else 0):
        raise ValueError(f"q head_dim {head_dim} does not match the cache rows ({row}, {k_pages.dtype})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if kv_lens.shape != (num_seqs_max,) or cu_q_lens.shape != (num_seqs_max + 1,):
        raise ValueError(
            f"kv_lens {kv_lens.shape} / cu_q_lens {cu_q_lens.shape} do not match page_tables {page_tables.shape}"
        )


def query_tiles(cu_q_lens, num_seqs, num_tokens: int, tile_q: int):
    """Number the query tiles (`tile_q` consecutive tokens of one sequence) of all sequences:
    (tile_seq [NT] (-1 for an unused slot), tile_q_start [NT] (the tile's first token within its
    sequence), tiles_start [S] (each sequence's first tile)). NT = (T + min(S, T) * (tile_q - 1))
    // tile_q is a static bound on how many there can be. `jnp` on device, no host sync."""
    num_seqs_max = cu_q_lens.shape[0] - 1
    seq_ids = jnp.arange(num_seqs_max, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    tiles_per_seq = (q_lens + tile_q - 1) // tile_q
    tiles_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)
    tiles_start = tiles_end - tiles_per_seq
    num_tiles = (num_tokens + min(num_seqs_max, num_tokens) * (tile_q - 1)) // tile_q
    tile_idx = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.minimum(jnp.searchsorted(tiles_end, tile_idx, side="right"), num_seqs_max - 1)
    tile_seq = tile_seq.astype(jnp.int32)
    tile_q_start = (tile_idx - tiles_start[tile_seq]) * tile_q
    tile_seq = jnp.where(tile_idx < tiles_end[-1], tile_seq, -1)
    return tile_seq, tile_q_start, tiles_start


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "logits_soft_cap",
        "interpret",
        "tile_rows",
        "tile_keys",
        "num_warps",
        "num_stages",
    ),
)
def ragged_paged_attention(
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
    tile_rows=16,
    tile_keys=64,
    num_warps=4,
    num_stages=2,
):
    """Ragged paged attention; see the module docstring for shapes.

    Static tuning knobs: `tile_rows` query rows per program (tokens x padded group),
    `tile_keys` keys per inner step (rounded to whole pages).
    """
    check_shapes(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens)
    _check_triton_shapes(q.shape[2], k_pages, tile_rows, tile_keys)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    group_pad, tile_rows, tile_q, pages_per_tile, tile_keys = _tiles(group, page_size, tile_rows, tile_keys)
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    # Both dot operands in the cache's logical dtype (int8, fp8: dequantized to float32);
    # accumulation is float32 either way.
    compute_dtype = jnp.bfloat16 if k_pages.dtype in (jnp.bfloat16, jnp.uint16) else jnp.float32

    tile_seq, tile_q_start, _ = query_tiles(cu_q_lens, num_seqs, num_tokens, tile_q)
    qg = _query_rows_per_kv_head(q.astype(compute_dtype), num_kv_heads, group_pad, tile_q)
    kernel = functools.partial(
        _ragged_paged_attention_kernel,
        group=group_pad,
        tile_rows=tile_rows,
        pages_per_tile=pages_per_tile,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        precision=dot_precision(),
    )
    metadata = _metadata(tile_seq, tile_q_start, cu_q_lens, kv_lens, page_tables, pages_per_tile)
    out = _pallas_call_per_kv_head_and_tile(
        kernel,
        metadata,
        qg,
        k_pages,
        v_pages,
        num_tiles=tile_seq.shape[0],
        out_dtype=q.dtype,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{tile_rows=}_{tile_keys=}",
    )
    return _output_tokens(out, q.shape, cu_q_lens, num_seqs, group_pad, tile_q)


def _tiles(group: int, page_size: int, tile_rows: int, tile_keys: int):
    """The tiles as the kernel runs them: (the GQA group padded to a power of two, query rows per
    tile, query tokens per tile, pages per key tile, keys per key tile)."""
    group_pad = pl.next_power_of_2(group)
    tile_rows = max(tile_rows, group_pad, 16)  # tl.dot needs M >= 16
    pages_per_tile = max(1, tile_keys // page_size)
    return group_pad, tile_rows, tile_rows // group_pad, pages_per_tile, pages_per_tile * page_size


def _check_triton_shapes(head_dim: int, k_pages, tile_rows: int, tile_keys: int) -> None:
    """What the Triton kernel needs beyond `check_shapes`: power-of-two tiles, a cache dtype it
    reads. ValueError if not."""
    page_size = k_pages.shape[2]
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16 (Triton tiles)")
    if not _is_pow2(page_size):
        raise ValueError(f"page_size {page_size} must be a power of two (Triton tiles)")
    if not _is_pow2(tile_rows) or not _is_pow2(tile_keys):
        raise ValueError(f"tile_rows {tile_rows} and tile_keys {tile_keys} must be powers of two")
    if k_pages.dtype not in (jnp.float32, jnp.bfloat16, jnp.uint16, jnp.int8, jnp.uint8):
        raise ValueError(
            f"cache dtype {k_pages.dtype} must be float32, bfloat16, uint16 "
            "(bfloat16 bit patterns), int8 or uint8 (int8 / fp8 codes and scales)"
        )


def _query_rows_per_kv_head(q, num_kv_heads: int, group_pad: int, tile_q: int):
    """q [T, num_q_heads, head_dim] as [num_kv_heads, (T + tile_q) * group_pad, head_dim]: a tile
    of tile_q tokens is a contiguous run of tile_rows rows; the tile_q extra tokens keep the last
    tile in bounds."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, tile_q), (0, 0), (0, group_pad - group), (0, 0)))
    return qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)


def _metadata(tile_seq, tile_q_start, cu_q_lens, kv_lens, page_tables, pages_per_tile: int):
    """The kernel's int32 metadata, each read whole by every program. Page table rows are padded
    (with page 0) to whole key tiles, so a key tile's page ids are one in-bounds slice; keys on
    the padding pages lie past the sequence's end and are masked."""
    pad_pages = -page_tables.shape[1] % pages_per_tile
    page_tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, pad_pages)))
    return tile_seq, tile_q_start, cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), page_tables


def _pallas_call_per_kv_head_and_tile(kernel, metadata, qg, k_pages, v_pages, *, num_tiles, out_dtype, **options):
    """`kernel` over the grid (num_kv_heads, num_tiles), each program given the int32 `metadata`
    arrays whole and its KV head's part of qg, of the page pools and of the output."""

    def whole(x):  # small int32 metadata, read by scalar loads
        return pl.BlockSpec(x.shape, lambda h, b: (0,) * x.ndim)

    def per_kv_head(x):  # [num_kv_heads, ...] -> this program's KV head
        return pl.BlockSpec((None, *x.shape[1:]), lambda h, b: (h,) + (0,) * (x.ndim - 1))

    return pl.pallas_call(
        kernel,
        grid=(qg.shape[0], num_tiles),
        in_specs=[*map(whole, metadata), per_kv_head(qg), per_kv_head(k_pages), per_kv_head(v_pages)],
        out_specs=per_kv_head(qg),
        out_shape=jax.ShapeDtypeStruct(qg.shape, out_dtype),
        **options,
    )(*metadata, qg, k_pages, v_pages)


def _output_tokens(out, q_shape, cu_q_lens, num_seqs, group_pad: int, tile_q: int):
    """The kernel's output [num_kv_heads, (T + tile_q) * group_pad, head_dim] back as
    [T, num_q_heads, head_dim], padding tokens zeroed."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads = out.shape[0]
    out = out.reshape(num_kv_heads, num_tokens + tile_q, group_pad, head_dim)
    out = out[:, :num_tokens, : num_q_heads // num_kv_heads].transpose(1, 0, 2, 3).reshape(q_shape)
    # Rows nobody stored (padding tokens) hold whatever the buffer held.
    valid = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))
