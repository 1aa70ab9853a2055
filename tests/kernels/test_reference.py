"""The jnp paged attention (oracle and CPU row path) and the KV write, against dense attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import kernels
from jaxllm.kernels.kv_write import storage_dtype, to_storage


def random_paged_batch(
    rng,
    *,
    q_lens,
    ctx_lens,
    num_kv_heads=3,
    group=3,
    head_dim=16,
    page_size=4,
    pad_tokens=3,
    pad_seqs=2,
    dtype=jnp.float32,
):
    """Dense per-sequence K/V scattered into shuffled pages, plus the ragged metadata."""
    S = len(q_lens)
    pages_per_seq = max(-(-c // page_size) for c in ctx_lens) + 1
    num_pages = S * pages_per_seq + 3
    perm = rng.permutation(num_pages)
    page_tables = np.zeros((S + pad_seqs, pages_per_seq), np.int32)
    k_pages = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32) * 9  # junk
    v_pages = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32) * 9
    dense_k, dense_v = [], []
    for s, c in enumerate(ctx_lens):
        page_tables[s] = perm[s * pages_per_seq : (s + 1) * pages_per_seq]
        k = rng.standard_normal((num_kv_heads, c, head_dim)).astype(np.float32)
        v = rng.standard_normal((num_kv_heads, c, head_dim)).astype(np.float32)
        if dtype == jnp.bfloat16:
            k = np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32))
            v = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
        for pos in range(c):
            page, off = page_tables[s, pos // page_size], pos % page_size
            k_pages[:, page, off], v_pages[:, page, off] = k[:, pos], v[:, pos]
        dense_k.append(k)
        dense_v.append(v)
    T = sum(q_lens) + pad_tokens
    q = rng.standard_normal((T, num_kv_heads * group, head_dim)).astype(np.float32)
    q[sum(q_lens) :] = 1e4  # poisoned padding rows
    cu = np.zeros(S + pad_seqs + 1, np.int32)
    cu[1 : S + 1] = np.cumsum(q_lens)
    cu[S + 1 :] = cu[S]
    kv_lens = np.zeros(S + pad_seqs, np.int32)
    kv_lens[:S] = ctx_lens
    store = storage_dtype(dtype)
    return dict(
        q=q,
        k_pages=np.asarray(to_storage(jnp.asarray(k_pages), store)),
        v_pages=np.asarray(to_storage(jnp.asarray(v_pages), store)),
        kv_lens=kv_lens,
        page_tables=page_tables,
        cu_q_lens=cu,
        num_seqs=np.int32(S),
        dense_k=dense_k,
        dense_v=dense_v,
        q_lens=list(q_lens),
        group=group,
    )


def dense_attention(b):
    """Plain causal attention per sequence, numpy float64."""
    out = np.zeros_like(b["q"], dtype=np.float64)
    group = b["group"]
    t = 0
    for s, q_len in enumerate(b["q_lens"]):
        k, v = b["dense_k"][s].astype(np.float64), b["dense_v"][s].astype(np.float64)
        ctx = k.shape[1]
        for i in range(q_len):
            pos = ctx - q_len + i
            for h in range(b["q"].shape[1]):
                kh = h // group
                scores = k[kh, : pos + 1] @ b["q"][t + i, h] / np.sqrt(k.shape[-1])
                p = np.exp(scores - scores.max())
                out[t + i, h] = (p / p.sum()) @ v[kh, : pos + 1]
        t += q_len
    return out


CASES = [
    # (q_lens, ctx_lens): decodes, prefill chunks on top of cached context, a full prompt
    ([1, 1, 1], [1, 9, 17]),
    ([5, 1, 12, 1], [5, 7, 20, 3]),
    ([3, 8], [11, 8]),
]


@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
def test_reference_matches_dense(q_lens, ctx_lens):
    b = random_paged_batch(np.random.default_rng(0), q_lens=q_lens, ctx_lens=ctx_lens)
    out = kernels.ragged_paged_attention_reference(
        b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_tables"], b["cu_q_lens"], b["num_seqs"]
    )
    np.testing.assert_allclose(np.asarray(out), dense_attention(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2), (jnp.int8, 2e-5)])
@pytest.mark.parametrize("q_lens,ctx_lens", CASES)
@pytest.mark.parametrize("row_tokens,rows_per_part", [(1, None), (4, None), (1, 2), (4, 3)])
def test_rows_path_matches_reference(q_lens, ctx_lens, dtype, atol, row_tokens, rows_per_part):
    b = random_paged_batch(np.random.default_rng(1), q_lens=q_lens, ctx_lens=ctx_lens, dtype=dtype)
    ref = kernels.ragged_paged_attention_reference(
        b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_tables"], b["cu_q_lens"], b["num_seqs"]
    )
    T = b["q"].shape[0]
    S = len(q_lens)
    idx, bt, kv, ql = kernels.ragged_to_rows(
        q_lens,
        ctx_lens,
        b["page_tables"][:S],
        num_tokens=T,
        num_rows=sum(-(-n // row_tokens) for n in q_lens) + 2,
        row_tokens=row_tokens,
    )
    q_pad = np.concatenate([b["q"], np.zeros_like(b["q"][:1])])
    rows = kernels.paged_attention_rows(
        jnp.asarray(q_pad[idx]), b["k_pages"], b["v_pages"], bt, kv, ql, chunk_pages=2, rows_per_part=rows_per_part
    )
    out = np.zeros_like(q_pad)
    out[idx.reshape(-1)] = np.asarray(rows).reshape(-1, *b["q"].shape[1:])
    np.testing.assert_allclose(out[:T], np.asarray(ref), atol=atol, rtol=atol)
    assert np.all(np.asarray(rows)[ql == 0] == 0)  # padding rows come out as zeros


def test_write_kv_in_place_and_padding_dropped():
    k_pages = jnp.zeros((2, 4, 4, 8), jnp.uint16)
    v_pages = jnp.zeros((2, 4, 4, 8), jnp.uint16)
    rng = np.random.default_rng(2)
    k_new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    v_new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([5, 14, -1], np.int32)  # page 1 offset 1, page 3 offset 2, padding
    write = jax.jit(kernels.write_kv, donate_argnums=(0, 1))
    k2, v2 = write(k_pages, v_pages, k_new, v_new, slots)
    k2 = np.asarray(kernels.logical_pages(k2).astype(jnp.float32))
    expect = np.asarray(jnp.asarray(k_new, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(k2[:, 1, 1], expect[0])
    np.testing.assert_array_equal(k2[:, 3, 2], expect[1])
    assert np.count_nonzero(k2) == np.count_nonzero(expect[:2])  # the padded token wrote nowhere
