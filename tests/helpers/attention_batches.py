"""Paged attention kernels' inputs and their check against the jnp oracle: a ragged batch over
shuffled, poisoned pages (`make_batch`), the `MIXED` one, `assert_matches_reference`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.kv_write import to_storage
from jaxllm.kernels.reference import ragged_paged_attention_reference


POISON = 1e4  # in cache slots nobody may read: would dominate any softmax it leaked into


def make_batch(
    seed,
    q_lens,
    kv_lens,
    *,
    num_q_heads=9,
    num_kv_heads=3,
    head_dim=64,
    page_size=16,
    pages_per_seq=4,
    pad_tokens=3,
    pad_seqs=1,
    cache_dtype="float32",
):
    """A ragged batch over shuffled pages; padding rows of q hold NaN and huge values."""
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    num_seqs_max = num_seqs + pad_seqs
    num_tokens = sum(q_lens) + pad_tokens
    pages_used = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_used) + 3  # a few pages nobody owns
    perm = rng.permutation(num_pages)
    page_tables = np.zeros((num_seqs_max, pages_per_seq), np.int32)
    spare = perm[sum(pages_used) :]
    k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    k[:, spare] = POISON
    v[:, spare] = POISON
    start = 0
    for s, (n_pages, kv_len) in enumerate(zip(pages_used, kv_lens)):
        assert n_pages <= pages_per_seq
        own = perm[start : start + n_pages]
        start += n_pages
        page_tables[s, :n_pages] = own
        page_tables[s, n_pages:] = rng.choice(spare, pages_per_seq - n_pages)
        tail = kv_len - (n_pages - 1) * page_size  # stale slots after the last token
        k[:, own[-1], tail:] = POISON
        v[:, own[-1], tail:] = POISON
    page_tables[num_seqs:] = rng.choice(spare, (pad_seqs, pages_per_seq))
    cu_q_lens = np.full(num_seqs_max + 1, sum(q_lens), np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens_arr = np.zeros(num_seqs_max, np.int32)
    kv_lens_arr[:num_seqs] = kv_lens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    q[sum(q_lens) :: 2] = np.nan
    q[sum(q_lens) + 1 :: 2] = 1e30
    if cache_dtype == "float32":
        k_pages, v_pages = jnp.asarray(k), jnp.asarray(v)
        q = jnp.asarray(q)
    elif cache_dtype in ("int8", "fp8"):  # int8 / fp8 rows (codes and a scale); q stays f32
        store = jnp.int8 if cache_dtype == "int8" else jnp.uint8
        k_pages, v_pages = to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store)
        q = jnp.asarray(q)
    else:
        store = jnp.uint16 if cache_dtype == "uint16" else jnp.bfloat16
        k_pages, v_pages = to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store)
        q = jnp.asarray(q, jnp.bfloat16)
    return (
        q,
        k_pages,
        v_pages,
        jnp.asarray(kv_lens_arr),
        jnp.asarray(page_tables),
        jnp.asarray(cu_q_lens),
        jnp.int32(num_seqs),
    )


def assert_matches_reference(out, args, tol, **kwargs):
    """`out` of a kernel called on `args` against the oracle: shape, dtype, finite, zero
    padding rows, max abs error < tol. Returns the error."""
    ref = ragged_paged_attention_reference(*args, **kwargs)
    q, num_real = args[0], int(args[5][args[6]])
    assert out.shape == q.shape and out.dtype == q.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    assert (out[num_real:] == 0).all(), "padding rows must be zero"
    err = np.abs(out - ref).max()
    assert err < tol, f"max abs error {err} >= {tol}"
    return err


# Mixed: decodes, a prefill chunk continuing a cached prefix, a whole first prefill, a chunk
# spanning several query blocks that ends mid-block, a length-1 sequence.
MIXED = dict(q_lens=[1, 7, 1, 19, 1, 6], kv_lens=[1, 40, 33, 19, 64, 50])
