"""The Pallas ragged paged attention kernel against the jnp oracle.

Numerics run the kernel in Pallas interpret mode on CPU (compiled where a GPU is the default
backend); the GPU (Triton) lowering is checked by lowering for `cuda` without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from jaxllm.kernels.paged_attention import ragged_paged_attention

from tests.helpers.attention_batches import MIXED, assert_matches_reference, make_batch
from tests.helpers.cuda_lowering import INTERPRET, arg, gpu_mesh, lower_for_cuda

# Max abs error against the float32 oracle. bf16 rounds q and the softmax weights to bf16
# before the dots (K/V are bf16 in both).
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def check(args, tol, tile_keys=64, **kwargs):
    out = ragged_paged_attention(*args, interpret=INTERPRET, tile_keys=tile_keys, **kwargs)
    return assert_matches_reference(out, args, tol, **kwargs)


@pytest.mark.parametrize("cache_dtype", ["float32", "uint16", "int8", "fp8"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_prefill_and_decode(cache_dtype, seed):
    # int8 / fp8 pages: the oracle dequantizes the same pages, so the math is f32's.
    tol = TOL["bfloat16" if cache_dtype == "uint16" else "float32"]
    check(make_batch(seed, **MIXED, cache_dtype=cache_dtype), tol)


def test_random_ragged_batch():
    rng = np.random.default_rng(7)
    num_seqs = 5
    kv_lens = rng.integers(1, 4 * 16 + 1, num_seqs)
    q_lens = [int(rng.integers(1, n + 1)) if rng.random() < 0.5 else 1 for n in kv_lens]
    check(make_batch(7, q_lens, list(kv_lens), pad_tokens=5, pad_seqs=2), TOL["float32"])


def test_plain_bf16_cache_matches_uint16_storage():
    a = make_batch(2, **MIXED, cache_dtype="uint16")
    b = make_batch(2, **MIXED, cache_dtype="bfloat16")
    out_a = ragged_paged_attention(*a, interpret=INTERPRET)
    out_b = ragged_paged_attention(*b, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(out_a, np.float32), np.asarray(out_b, np.float32))


@pytest.mark.parametrize("cache_dtype", ["float32", "uint16", "int8", "fp8"])
def test_sliding_window_and_soft_cap(cache_dtype):
    tol = TOL["bfloat16" if cache_dtype == "uint16" else "float32"]
    args = make_batch(3, **MIXED, cache_dtype=cache_dtype)
    check(args, tol, sliding_window=20)
    # One-page key blocks: the window lets the page loop start past the first pages.
    check(args, tol, sliding_window=20, tile_keys=16)
    check(args, tol, logits_soft_cap=5.0, sm_scale=0.3)
    check(args, tol, sliding_window=7, logits_soft_cap=2.0)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,page_size", [(4, 4, 8), (8, 2, 32)])
def test_head_groups_and_page_sizes(num_q_heads, num_kv_heads, page_size):
    # MHA with pages smaller than a key block, and pages larger than a key block.
    args = make_batch(
        4,
        [1, 11, 1],
        [9, 30, 60],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        page_size=page_size,
        pages_per_seq=-(-64 // page_size),
    )
    check(args, TOL["float32"])


def test_rejects_bad_shapes():
    q, k, v, kv_lens, page_tables, cu_q_lens, num_seqs = make_batch(0, [1], [5])
    with pytest.raises(ValueError, match="num_kv_heads"):
        ragged_paged_attention(q[:, :8], k, v, kv_lens, page_tables, cu_q_lens, num_seqs)
    with pytest.raises(ValueError, match="head_dim 48"):
        ragged_paged_attention(q[..., :48], k[..., :48], v[..., :48], kv_lens, page_tables, cu_q_lens, num_seqs)


def lower_kernel(num_q_heads, num_kv_heads, head_dim, cache_dtype, **kwargs):
    num_tokens, num_seqs_max, num_pages, page_size, pages_per_seq = 256, 64, 2048, 16, 128
    q_dtype = jnp.bfloat16 if cache_dtype == jnp.uint16 or cache_dtype == jnp.bfloat16 else jnp.float32
    row = head_dim + (4 if cache_dtype in (jnp.int8, jnp.uint8) else 0)  # int8 / fp8 rows: codes, then the scale
    pages = arg((num_kv_heads, num_pages, page_size, row), cache_dtype)
    args = (
        arg((num_tokens, num_q_heads, head_dim), q_dtype),
        pages,
        pages,
        arg((num_seqs_max,), jnp.int32),
        arg((num_seqs_max, pages_per_seq), jnp.int32),
        arg((num_seqs_max + 1,), jnp.int32),
        arg((), jnp.int32),
    )
    return lower_for_cuda(functools.partial(ragged_paged_attention, **kwargs), *args)


@pytest.mark.parametrize(
    "cache_dtype", [jnp.uint16, jnp.float32, jnp.int8, jnp.uint8], ids=["bf16", "f32", "int8", "fp8"]
)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)], ids=["default_model", "llama3_8b"]
)
def test_lowers_for_cuda_with_triton(num_q_heads, num_kv_heads, head_dim, cache_dtype):
    text = lower_kernel(num_q_heads, num_kv_heads, head_dim, cache_dtype)
    assert "__gpu$xla.gpu.triton" in text
    assert "ragged_paged_attention" in text


def test_lowers_for_cuda_with_window_and_soft_cap():
    text = lower_kernel(32, 8, 128, jnp.bfloat16, sliding_window=4096, logits_soft_cap=50.0)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("num_q_heads", [32, 64], ids=["llama3_8b", "llama3_70b"])
def test_lowers_for_cuda_per_shard_under_shard_map(num_q_heads):
    """Tensor parallelism runs the kernel per shard (jaxllm/parallel.py): Llama-3-8B's 32 (70B's
    64) query and 8 KV heads over an abstract 8-device mesh leave each shard 4 (8) query heads
    and 1 KV head."""
    from jax.sharding import PartitionSpec as P

    mesh = gpu_mesh(8)
    num_tokens, num_seqs_max, pages_per_seq = 256, 64, 128
    pages = arg((8, 2048, 16, 128), jnp.uint16, mesh, P("model"))
    args = (
        arg((num_tokens, num_q_heads, 128), jnp.bfloat16, mesh, P(None, "model")),
        pages,
        pages,
        arg((num_seqs_max,), jnp.int32),
        arg((num_seqs_max, pages_per_seq), jnp.int32),
        arg((num_seqs_max + 1,), jnp.int32),
        arg((), jnp.int32),
    )
    per_shard = jax.shard_map(
        ragged_paged_attention,
        mesh=mesh,
        check_vma=False,
        in_specs=(P(None, "model"), P("model"), P("model"), P(), P(), P(), P()),
        out_specs=P(None, "model"),
    )
    text = lower_for_cuda(per_shard, *args, mesh=mesh)
    assert "__gpu$xla.gpu.triton" in text
    assert f"tensor<{num_tokens}x{num_q_heads // 8}x128xbf16>" in text and "tensor<1x2048x16x128xui16>" in text
