"""Ragged paged attention in `jnp` over rows: the CPU path where the C++ kernels are not built
(the `cpu` attention backend, jaxllm/attention/rows.py).

The runner regroups the ragged batch on the host into *rows* of at most `row_tokens` query
tokens of one sequence (`ragged_to_rows`), decodes in a group of one-token rows and prefill
chunks in a group of `row_tokens`-token rows; each group walks its sequences' pages in chunks
with an online softmax (`m`, `l`: the running max and sum), so the work follows the longest
context in the batch, not `max_model_len`. bf16 caches are stored as uint16 bit patterns (see
kv_write.py); the dots take bf16 operands with float32 accumulation. int8 caches are
dequantized a chunk at a time. The contract and the oracle: kernels/reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.kv_write import logical_pages
from jaxllm.kernels.reference import NEG_INF, mask_scores


def paged_attention_rows(
    q_rows,
    k_pages,
    v_pages,
    page_tables,
    kv_lens,
    q_lens,
    *,
    sm_scale=None,
    sliding_window=None,
    logits_soft_cap=None,
    chunk_pages=4,
    rows_per_part=None,
):
    """Attention for rows of at most `row_tokens` query tokens of one sequence each.

    q_rows:       [R, row_tokens, num_q_heads, head_dim] f32
    page_tables: [R, pages_per_seq] int32
    kv_lens:      [R] int32  cache length of the row's sequence up to its last query token
    q_lens:       [R] int32  real query tokens in the row (0 for a padding row)
    Returns [R, row_tokens, num_q_heads, head_dim] f32; padding rows and tokens are zeros.
    Pages are walked in chunks of `chunk_pages` up to the longest `kv_lens` in the batch.

    With `rows_per_part`, the rows are processed in consecutive parts of that many rows, each
    walking pages only up to its own longest row: callers sort rows by `kv_lens` (longest
    first) so short rows stop early. On a decode batch of 128 rows with contexts spread over
    32..384 this was 3.6x faster (24 -> 6.7 ms per layer, parts of 16 rows).
    """
    if rows_per_part and q_rows.shape[0] > rows_per_part:
        args = (q_rows, k_pages, v_pages, page_tables, kv_lens, q_lens)
        options = dict(
            sm_scale=sm_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, chunk_pages=chunk_pages
        )
        return _in_parts(args, rows_per_part, **options)
    q_rows, k_pages, v_pages, page_tables, kv_lens, q_lens = map(
        jnp.asarray, (q_rows, k_pages, v_pages, page_tables, kv_lens, q_lens)
    )
    num_rows, row_tokens, num_q_heads, head_dim = q_rows.shape
    num_kv_heads = k_pages.shape[0]
    group = num_q_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    chunk_pages = min(chunk_pages, page_tables.shape[1])
    page_tables, num_chunks_max = _pad_to_whole_chunks(page_tables, chunk_pages)
    dot_dtype = jnp.bfloat16 if k_pages.dtype in (jnp.uint16, jnp.bfloat16) else jnp.float32

    q, q_pos = _query_matrices(q_rows, kv_lens, q_lens, num_kv_heads, sm_scale, dot_dtype)
    l, acc = _walk_pages(
        q, q_pos, k_pages, v_pages, page_tables, kv_lens, chunk_pages, num_chunks_max, sliding_window, logits_soft_cap
    )
    o = acc / jnp.maximum(l, 1e-30)[..., None]
    o = o.reshape(num_kv_heads, num_rows, group, row_tokens, head_dim).transpose(1, 3, 0, 2, 4)
    return o.reshape(num_rows, row_tokens, num_q_heads, head_dim)


def _in_parts(args, rows_per_part, **options):
    """`paged_attention_rows` over consecutive parts of `rows_per_part` rows, concatenated; `args`
    are its positional arguments (the K/V pools are shared, every other one is split by row)."""
    q_rows, k_pages, v_pages, page_tables, kv_lens, q_lens = args
    return jnp.concatenate(
        [
            paged_attention_rows(
                q_rows[i : i + rows_per_part],
                k_pages,
                v_pages,
                page_tables[i : i + rows_per_part],
                kv_lens[i : i + rows_per_part],
                q_lens[i : i + rows_per_part],
                **options,
            )
            for i in range(0, q_rows.shape[0], rows_per_part)
        ]
    )


def _pad_to_whole_chunks(page_tables, chunk_pages: int):
    """Pad the page table so every chunk is a full slice; the extra entries are masked.
    Returns the padded table and its number of chunks."""
    pages_per_seq = page_tables.shape[1]
    num_chunks_max = -(-pages_per_seq // chunk_pages)
    pad = num_chunks_max * chunk_pages - pages_per_seq
    return jnp.pad(page_tables, ((0, 0), (0, pad))), num_chunks_max


def _query_matrices(q_rows, kv_lens, q_lens, num_kv_heads: int, sm_scale, dot_dtype):
    """The scaled queries as [kv_heads, R, group * row_tokens, head_dim] in `dot_dtype`, and the
    cache position of each of their rows [R, group * row_tokens] (-1 for a padding token)."""
    num_rows, row_tokens, num_q_heads, head_dim = q_rows.shape
    group = num_q_heads // num_kv_heads
    # [kv_heads, R, group * row_tokens, head_dim]: query heads of one KV head and a row's tokens
    # form one matrix, so each (kv head, row) is a single small GEMM against the K chunk.
    q = q_rows.reshape(num_rows, row_tokens, num_kv_heads, group, head_dim)
    q = (q * sm_scale).transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, num_rows, group * row_tokens, head_dim)
    q = q.astype(dot_dtype)
    tok = jnp.arange(row_tokens, dtype=jnp.int32)
    q_pos = kv_lens[:, None] - q_lens[:, None] + tok[None, :]  # [R, row_tokens]
    q_valid = tok[None, :] < q_lens[:, None]
    q_pos = jnp.where(q_valid, q_pos, -1)  # masks all keys
    q_pos = jnp.broadcast_to(q_pos[:, None, :], (num_rows, group, row_tokens)).reshape(num_rows, -1)
    return q, q_pos


def _walk_pages(
    q, q_pos, k_pages, v_pages, page_tables, kv_lens, chunk_pages, num_chunks_max, sliding_window, logits_soft_cap
):
    """The online softmax of `q` over the rows' pages, a chunk of `chunk_pages` pages per step up
    to the longest `kv_lens`: the running sum `l` and the unnormalized output `acc`."""
    num_kv_heads, num_rows, rows_q, head_dim = q.shape
    page_size, row = k_pages.shape[2:]
    chunk = chunk_pages * page_size

    def body(i, carry):
        pages = jax.lax.dynamic_slice_in_dim(page_tables, i * chunk_pages, chunk_pages, axis=1)
        # Gather whole pages as flat [page_size * row] slabs, without bounds handling
        # (page tables only hold valid ids): 3x faster than indexing the 4-D pool on XLA:CPU.
        chunk_rows = (num_kv_heads, num_rows, chunk, row)
        k = logical_pages(k_slabs.at[:, pages].get(mode="promise_in_bounds").reshape(chunk_rows))
        v = logical_pages(v_slabs.at[:, pages].get(mode="promise_in_bounds").reshape(chunk_rows))
        s = jnp.einsum("krqd,krcd->krqc", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
        k_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        s, mask = mask_scores(s, q_pos[None, :, :, None], k_pos[None, None, None, :], sliding_window, logits_soft_cap)
        return _online_softmax_update(carry, s, mask, v, q.dtype)

    k_slabs = k_pages.reshape(num_kv_heads, -1, page_size * row)
    v_slabs = v_pages.reshape(num_kv_heads, -1, page_size * row)
    init = (
        jnp.full((num_kv_heads, num_rows, rows_q), NEG_INF, jnp.float32),
        jnp.zeros((num_kv_heads, num_rows, rows_q), jnp.float32),
        jnp.zeros((num_kv_heads, num_rows, rows_q, head_dim), jnp.float32),
    )
    num_chunks = (jnp.max(kv_lens) + chunk - 1) // chunk
    _, l, acc = jax.lax.fori_loop(0, jnp.minimum(num_chunks, num_chunks_max), body, init)
    return l, acc


def _online_softmax_update(carry, s, mask, v, dot_dtype):
    """One chunk's step of the online softmax: the running max `m`, sum `l` and output `acc`
    after the masked scores `s` of the chunk's keys and their values `v`."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None]) * mask
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(-1)
    pv = jnp.einsum("krqc,krcd->krqd", p.astype(dot_dtype), v.astype(dot_dtype), preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[..., None] + pv


def ragged_to_rows(q_lens, kv_lens, page_tables, *, num_tokens, num_rows, row_tokens):
    """Host side: regroup ragged sequences into rows of at most `row_tokens` query tokens.

    q_lens, kv_lens: [S] ints of real sequences (in the order their tokens sit in q);
    page_tables: [S, pages_per_seq]. Returns numpy arrays for `paged_attention_rows`:
    `token_idx [num_rows, row_tokens]` (index into q; `num_tokens` marks padding),
    `page_tables [num_rows, pages_per_seq]`, `kv_lens [num_rows]`, `q_lens [num_rows]`.
    Raises ValueError when the rows do not fit in `num_rows`.
    """
    q_lens = np.asarray(q_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    n_rows = -(-q_lens // row_tokens)
    total = int(n_rows.sum())
    if total > num_rows:
        raise ValueError(f"{total} attention rows needed, only {num_rows} available")
    seq = np.repeat(np.arange(len(q_lens)), n_rows)
    first_row = np.cumsum(n_rows) - n_rows
    part = np.arange(total) - first_row[seq]  # which row of its sequence
    starts = np.cumsum(q_lens) - q_lens
    row_q_start = part * row_tokens
    row_q_len = np.minimum(q_lens[seq] - row_q_start, row_tokens)
    token_idx = np.full((num_rows, row_tokens), num_tokens, np.int32)
    cols = np.arange(row_tokens)
    real = cols[None, :] < row_q_len[:, None]
    token_idx[:total] = np.where(real, starts[seq][:, None] + row_q_start[:, None] + cols[None, :], num_tokens)
    out_bt = np.zeros((num_rows, page_tables.shape[1]), np.int32)
    out_bt[:total] = page_tables[seq]
    out_kv = np.zeros(num_rows, np.int32)
    # A row ends at its last token, so its cache length stops there (causality within the chunk
    # is then the same mask as for the whole sequence).
    out_kv[:total] = kv_lens[seq] - q_lens[seq] + row_q_start + row_q_len
    out_q = np.zeros(num_rows, np.int32)
    out_q[:total] = row_q_len
    # Longest rows first, so parts of consecutive rows end their page walk early.
    order = np.argsort(-out_kv, kind="stable")
    return token_idx[order], out_bt[order], out_kv[order], out_q[order]
