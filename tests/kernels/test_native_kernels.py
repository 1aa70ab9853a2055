"""The C++ CPU kernels (XLA FFI) against their references: paged attention against the jnp
oracle, the GEMMs against NumPy, the KV write against the scatter, the sampler's reductions."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from jaxllm.kernels import gemm, native

from tests.helpers.attention_batches import MIXED, assert_matches_reference, make_batch
from tests.helpers.cpu_host import lscpu_flags

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native kernel: {native.unavailable_reason()}")

# Both sides compute in f32 from the same (possibly bf16-rounded) q, K and V: only the
# summation order differs.
TOL = 2e-5


def check(args, **kwargs):
    """Every code path this CPU's build has (portable, AVX2, AVX-512) against the oracle."""
    # make_batch gives bf16 q with a bf16 cache; the engine's q is f32 (a bf16 result would
    # round away the comparison).
    args = (args[0].astype(np.float32), *args[1:])
    for path in ("auto", *native.kernel_paths()):
        out = jax.jit(lambda *a: native.paged_attention_cpu(*a, path=path, **kwargs))(*args)
        assert_matches_reference(out, args, TOL, **kwargs)


@pytest.mark.parametrize("cache_dtype", ["float32", "uint16", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_prefill_and_decode(cache_dtype, seed):
    check(make_batch(seed, **MIXED, cache_dtype=cache_dtype))


def test_long_prompts_span_tiles_and_chunks():
    # 40- and 17-token chunks cover several 16-token tiles (the last one partial); contexts up
    # to 200 keys cross the kernel's 64-key chunks at page and mid-page boundaries.
    check(make_batch(5, [1, 40, 17, 1, 3], [200, 90, 17, 65, 130], pages_per_seq=13, cache_dtype="uint16"))


@pytest.mark.parametrize("cache_dtype", ["float32", "uint16", "int8", "fp8"])
def test_sliding_window_and_soft_cap(cache_dtype):
    args = make_batch(3, [1, 40, 1, 19], [150, 90, 33, 19], pages_per_seq=10, cache_dtype=cache_dtype)
    check(args, sliding_window=20)
    check(args, sliding_window=70)
    check(args, logits_soft_cap=5.0, sm_scale=0.3)
    check(args, sliding_window=7, logits_soft_cap=2.0)


@pytest.mark.parametrize("cache_dtype", ["float32", "uint16", "int8"])
@pytest.mark.parametrize("head_dim", [32, 64, 80])
def test_bidirectional_attention_over_whole_prompts(cache_dtype, head_dim):
    """`causal=False` (an encoder's step: every sequence's whole prompt at once): each query
    sees every key of its sequence, on every path (head_dim 80: the portable one)."""
    q_lens = [7, 40, 1, 19, 64]
    args = make_batch(6, q_lens, q_lens, head_dim=head_dim, pages_per_seq=5, cache_dtype=cache_dtype)
    check(args, causal=False)
    causal = jax.jit(native.paged_attention_cpu)(args[0].astype(np.float32), *args[1:])
    both = jax.jit(functools.partial(native.paged_attention_cpu, causal=False))(args[0].astype(np.float32), *args[1:])
    assert not np.allclose(np.asarray(causal)[:7], np.asarray(both)[:7])  # (the mask matters)
    with pytest.raises(Exception, match="sliding window needs causal"):
        jax.block_until_ready(native.paged_attention_cpu(*args, causal=False, sliding_window=4))


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,page_size", [(4, 4, 32, 8), (8, 2, 128, 32), (12, 3, 64, 16), (6, 2, 80, 16)]
)
@pytest.mark.parametrize("cache_dtype", ["float32", "int8", "fp8"])
def test_head_groups_and_page_sizes(num_q_heads, num_kv_heads, head_dim, page_size, cache_dtype):
    # MHA with small pages, GQA 4 with head_dim 128 and pages of 32, GQA 4 at this model's
    # shapes; head_dim 80 takes the portable path (no SIMD path has code for it).
    args = make_batch(
        4,
        [1, 21, 1, 2],
        [9, 30, 100, 120],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=-(-128 // page_size),
        cache_dtype=cache_dtype,
    )
    check(args)


def test_many_sequences_spread_over_threads():
    rng = np.random.default_rng(11)
    kv_lens = rng.integers(1, 160, 48)
    q_lens = [int(min(n, rng.integers(2, 30))) if i % 6 == 0 else 1 for i, n in enumerate(kv_lens)]
    check(make_batch(11, q_lens, list(kv_lens), pages_per_seq=10, pad_tokens=7, pad_seqs=4, cache_dtype="uint16"))


def test_rejects_invalid_page_table():
    q, k, v, kv_lens, page_tables, cu_q_lens, num_seqs = make_batch(0, [1, 3], [20, 5])
    bad = page_tables.at[0, 1].set(k.shape[1])  # a page id past the pool, inside the context
    with pytest.raises(Exception, match="invalid page id"):
        jax.block_until_ready(native.paged_attention_cpu(q, k, v, kv_lens, bad, cu_q_lens, num_seqs))
    # Entries past a sequence's context are never read, so they may hold anything.
    unused = page_tables.at[1, 3].set(-7)
    check((q, k, v, kv_lens, unused, cu_q_lens, num_seqs))


def test_rejects_inconsistent_inputs_without_touching_memory():
    q, k, v, kv_lens, page_tables, cu_q_lens, num_seqs = make_batch(0, [1, 3], [20, 5])

    def run(*args):
        return jax.block_until_ready(native.paged_attention_cpu(*args))

    with pytest.raises(Exception, match="inconsistent cu_q_lens"):  # a query starting before q
        run(q, k, v, kv_lens, page_tables, cu_q_lens.at[0].set(-2), num_seqs)
    with pytest.raises(Exception, match="shorter than num_seqs"):
        run(q, k, v, kv_lens, page_tables, cu_q_lens[:2], num_seqs)
    with pytest.raises(Exception, match="kv heads"):
        run(q, k[:0], v[:0], kv_lens, page_tables, cu_q_lens, num_seqs)
    # A sequence without queries is not read, whatever its kv_lens and table say.
    idle = cu_q_lens.at[2].set(cu_q_lens[1])
    out = run(q, k, v, kv_lens.at[1].set(10**6), page_tables.at[1].set(-1), idle, num_seqs)
    ref = run(q, k, v, kv_lens, page_tables, idle, num_seqs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_wide_head_groups_use_shorter_tiles():
    # 7 query heads per kv head (Qwen2-7B's ratio): tiles of 64 // 7 = 9 tokens.
    check(make_batch(6, [1, 30, 1], [40, 30, 70], num_q_heads=14, num_kv_heads=2, head_dim=32, pages_per_seq=5))


def test_rejects_unsupported_shapes():
    args = make_batch(0, [1], [5], num_q_heads=9, num_kv_heads=3, head_dim=32)
    with pytest.raises(Exception, match="head_dim <= 256"):
        q = args[0]
        jax.block_until_ready(native.paged_attention_cpu(q[:, :8], *args[1:]))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_write_kv_stores_the_bytes_the_scatter_stores(cache_dtype):
    """The C++ KV write against kv_write.py's scatter: the same bytes in every slot (bf16
    rounding, int8 and fp8 codes and scales included), padding and out-of-range slots written nowhere,
    and the pages updated in place when donated."""
    from jaxllm import kernels

    rng = np.random.default_rng(4)
    heads, pages, page_size, head_dim, tokens = 3, 7, 4, 64, 10
    k_pages, v_pages = kernels.allocate_kv_cache(
        1, heads, pages, page_size, head_dim, kernels.kv_write.cache_dtype(cache_dtype)
    )[0]
    # Pages already holding other tokens' rows (random bytes), which must survive.
    k_pages = jax.numpy.asarray(rng.integers(-100, 100, k_pages.shape).astype(k_pages.dtype))
    v_pages = jax.numpy.asarray(rng.integers(-100, 100, v_pages.shape).astype(v_pages.dtype))
    k = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32) * 3
    v = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    k[2] = 0.0  # int8: a zero row keeps a scale of 1
    k[3, 0, :4] = [0.5, 1.5, -2.5, 1e-30]  # halfway cases round to even
    # fp8 (scale 1 with 448 the row's largest): ties between E4M3 codes, subnormal ones, one
    # carrying into the smallest normal, -0.
    k[4, 0, :7] = [448.0, 1.0625, 1.1875, 1.5 * 2**-9, 7.5 * 2**-9, -300.0, -0.0]
    slots = np.array([0, 5, -1, 27, 3, pages * page_size, 14, 9, 26, -5], np.int32)
    want = jax.jit(kernels.write_kv)(k_pages, v_pages, k, v, slots)
    before = [np.asarray(x).copy() for x in (k_pages, v_pages)]
    got = jax.jit(native.write_kv, donate_argnums=(0, 1))(k_pages, v_pages, k, v, slots)
    for g, w, old in zip(got, want, before):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert not np.array_equal(np.asarray(g), old)


def test_write_kv_rejects_mismatched_shapes():
    from jaxllm import kernels

    k_pages, v_pages = kernels.allocate_kv_cache(1, 2, 4, 4, 8, jax.numpy.float32)[0]
    x = np.zeros((3, 2, 8), np.float32)
    with pytest.raises(Exception, match="do not match"):
        jax.block_until_ready(native.write_kv(k_pages, v_pages, x[:, :1], x[:, :1], np.zeros(3, np.int32)))
    with pytest.raises(Exception, match="do not match"):
        jax.block_until_ready(native.write_kv(k_pages, v_pages, x, x, np.zeros(2, np.int32)))


def rounded(a, dtype):
    """a as float64, rounded to bf16 first for dtype bfloat16: the values the bf16 GEMM
    multiplies (the products are exact, the sums f32)."""
    a = np.asarray(a, np.float32)
    return np.asarray(a.astype(jax.numpy.bfloat16) if dtype == "bfloat16" else a, np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 6, 12, 13, 25, 96, 97, 200])
def test_matmul_packed_matches_numpy(rows, dtype):
    # Row counts around the register blocks (6 rows for f32; 6 and 12 for bf16) and the 96-row
    # work items; 7 panels (bf16 takes them four, two and one at a time); K odd where the dtype
    # allows (bf16 packs row pairs); a weight packed from [K, N] and from its transpose (a tied
    # LM head); every code path here (f32 has AVX2 code, bf16 AVX512_BF16: other paths run the
    # portable loop); a live-row count.
    rng = np.random.default_rng(rows)
    k, n = (38 if dtype == "bfloat16" else 37), 112
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    ref = rounded(x, dtype) @ rounded(w, dtype)
    shape = (n // 16, k // 2, 16, 2) if dtype == "bfloat16" else (n // 16, k, 16)
    for packed in (
        gemm.pack_weight(w, dtype=dtype),
        gemm.pack_weight(np.ascontiguousarray(w.T), transposed=True, dtype=dtype),
    ):
        assert packed.shape == shape and packed.dtype == dtype
        for path in ("auto", *native.kernel_paths()):
            y = jax.jit(functools.partial(gemm.matmul_packed, path=path))(x, packed)
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    packed = gemm.pack_weight(w, dtype=dtype)
    batched = jax.jit(gemm.matmul_packed)(x.reshape(1, rows, k), packed)
    np.testing.assert_allclose(batched[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    live = jax.jit(gemm.matmul_packed)(x, packed, rows=rows // 2)
    np.testing.assert_allclose(live[: rows // 2], ref[: rows // 2], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert not np.asarray(live[rows // 2 :]).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,live", [(1, None), (7, 5), (100, None), (100, 61)])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_matches_numpy(rows, live, add, dtype):
    # RMSNorm after the residual add, one row at a time or (100 rows of 576: past the
    # one-thread size) shared over threads; the sum is x + delta in f32 exactly, the normed rows
    # the float64 norm to f32 precision, or in bf16 within its rounding; rows past `live` zeros.
    rng = np.random.default_rng(rows)
    h, eps = 576, 1e-5
    x = (rng.standard_normal((rows, h)) * 3).astype(np.float32)
    delta = rng.standard_normal((rows, h)).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    s = x + delta if add else x
    ref = s / np.sqrt(np.mean(np.square(s, dtype=np.float64), axis=1, keepdims=True) + eps) * w
    out = jax.jit(functools.partial(native.rms_norm, eps=eps, dtype=jax.numpy.dtype(dtype)))(
        x, w, delta=delta if add else None, rows=live
    )
    if add:
        total, out = out
        live_rows = rows if live is None else live
        np.testing.assert_array_equal(total[:live_rows], s[:live_rows])
        assert not np.asarray(total[live_rows:]).any()
    assert out.dtype == jax.numpy.dtype(dtype)
    out = np.asarray(out, np.float32)
    n = rows if live is None else live
    assert not out[n:].any()
    tolerance = 2.0**-8 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(out[:n], ref[:n], rtol=tolerance, atol=tolerance * 1e-3)


@pytest.mark.parametrize("live", [0, 1, 7, 97, 200, 500])
def test_gemms_skip_rows_past_the_live_count(live):
    # `rows` (traced, as the step passes its real token count): the first rows are the product,
    # the rest zeros, whatever their input was; a count past the rows means all of them.
    rng = np.random.default_rng(live)
    k, n, m = 40, 32, 200
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    codes = rng.integers(-127, 128, (k, n))
    scale = rng.random((2, n)).astype(np.float32)
    w_q = codes * np.repeat(scale.astype(np.float64), k // 2, 0)
    for y, weight in (
        (jax.jit(gemm.matmul_packed)(x, gemm.pack_weight(w), rows=live), w),
        (
            jax.jit(functools.partial(gemm.matmul_quantized, bits=8))(
                x, gemm.pack_codes(codes, 8), gemm.pack_scales(scale), None, rows=np.int32(live)
            ),
            w_q,
        ),
    ):
        y, ref = np.asarray(y), x.astype(np.float64) @ weight
        np.testing.assert_allclose(y[:live], ref[:live], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert not y[live:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 6, 12, 13, 29, 97])
def test_matmul_packed_swiglu_matches_numpy(rows, dtype):
    # silu(x @ gate) * (x @ up) from one [gate | up] weight: gate values of both signs and large
    # magnitudes (silu's two branches, exp's clamp), 3 output panels (bf16: a pair, whose gate
    # and up panels make four, and a single one), every code path, a live-row count.
    rng = np.random.default_rng(rows)
    k, inter = 24, 48
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((k, 2 * inter)) * 3).astype(np.float32)
    w[:, 0] = 40.0
    g, u = np.split(rounded(x, dtype) @ rounded(w, dtype), 2, axis=1)
    ref = g / (1 + np.exp(-g)) * u
    packed = gemm.pack_weight(w, dtype=dtype)
    for path in ("auto", *native.kernel_paths()):
        y = jax.jit(functools.partial(gemm.matmul_packed, path=path, swiglu=True))(x, packed)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    live = jax.jit(functools.partial(gemm.matmul_packed, swiglu=True))(x, packed, rows=rows // 2)
    np.testing.assert_allclose(live[: rows // 2], ref[: rows // 2], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert not np.asarray(live[rows // 2 :]).any()


@pytest.mark.parametrize("swiglu", [False, True])
def test_bf16_gemm_on_amx_tiles(swiglu):
    # K a multiple of 32 (AMX takes 16 k-pairs a tile; other K run AVX-512 even on path amx), row
    # counts around the 16-row tiles and 32-row blocks, 7 panels (pairs and a single one; with
    # swiglu 3 output panels of gate and up), live rows. The tiles' sums are f32 in an order of
    # their own: within f32 rounding of NumPy's, and not VDPBF16PS's bit for bit. Path auto takes
    # AMX for every row of a call from 2 rows (live ones), VDPBF16PS for one.
    if "amx" not in native.kernel_paths():
        pytest.skip("no AMX tiles on this CPU (or not granted to this process)")
    k, n = 96, (96 if swiglu else 112)
    for rows in (1, 15, 16, 17, 31, 32, 33, 70):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w = (rng.standard_normal((k, n)) * (3 if swiglu else 1)).astype(np.float32)
        ref = rounded(x, "bfloat16") @ rounded(w, "bfloat16")
        if swiglu:
            g, u = np.split(ref, 2, axis=1)
            ref = g / (1 + np.exp(-g)) * u
        packed = gemm.pack_weight(w, dtype="bfloat16")
        run = {
            path: np.asarray(jax.jit(functools.partial(gemm.matmul_packed, path=path, swiglu=swiglu))(x, packed))
            for path in ("auto", "avx512", "amx")
        }
        for y in run.values():
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert (run["amx"] != run["avx512"]).any()
        np.testing.assert_array_equal(run["auto"], run["amx" if rows >= 2 else "avx512"])
        live = jax.jit(functools.partial(gemm.matmul_packed, path="amx", swiglu=swiglu))(x, packed, rows=rows // 2)
        np.testing.assert_array_equal(live[: rows // 2], run["amx"][: rows // 2])
        assert not np.asarray(live[rows // 2 :]).any()


def test_bf16_gemm_dots_follow_the_cpu():
    # AVX512_BF16 dots exactly where the CPU has them (the build is -march=native); the engine
    # packs bf16 weights only then.
    assert native.has_bf16_dots() == ("avx512_bf16" in lscpu_flags())
    assert gemm.packable((38, 48), dtype=jax.numpy.bfloat16)
    assert not gemm.packable((37, 48), dtype=jax.numpy.bfloat16) and gemm.packable((37, 48))
    with pytest.raises(Exception, match="matmul_packed_bf16"):
        jax.block_until_ready(
            gemm.matmul_packed(np.ones((2, 8), np.float32), np.ones((1, 3, 16, 2), jax.numpy.bfloat16))
        )


def test_argmax_logsumexp_first_max_anywhere():
    # The first index of the maximum: ties inside one 8-lane block and across blocks, the
    # maximum in the tail past the last full block (vocab 3003), at index 0; against numpy.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3003)).astype(np.float32)
    x[0, [10, 13]] = 9.0
    x[1, [5, 2990]] = 9.0
    x[2, 3001:] = 9.0
    x[3, 0] = 9.0
    idx, lse = jax.jit(native.argmax_logsumexp)(x)
    np.testing.assert_array_equal(np.asarray(idx), np.argmax(x, -1))
    ref = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(lse), np.log(np.exp(ref).sum(-1)), rtol=1e-6)


def test_argmax_logsumexp_over_the_tokens_a_mask_allows():
    # A structured-output mask (bit t % 32 of word t // 32): rows all allowed (the kernel's
    # fast path), a row that masks out its maximum, a sparse row, a row allowing one token in
    # the last partial word; against numpy over the allowed tokens.
    rng = np.random.default_rng(1)
    vocab = 3003
    x = rng.standard_normal((5, vocab)).astype(np.float32)
    allowed = np.ones((5, vocab), bool)
    allowed[1, np.argmax(x[1])] = False
    allowed[2] = rng.random(vocab) < 0.01
    allowed[3] = False
    allowed[3, vocab - 2] = True
    bits = np.zeros((5, 32 * -(-vocab // 32)), np.uint8)
    bits[:, :vocab] = allowed
    bits[0, vocab:] = 1  # bits past the vocabulary are ignored
    mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    idx, lse = jax.jit(native.argmax_logsumexp)(x, mask)
    ref = np.where(allowed, x.astype(np.float64), -np.inf)
    np.testing.assert_array_equal(np.asarray(idx), np.argmax(ref, -1))
    np.testing.assert_allclose(np.asarray(lse), np.log(np.exp(ref).sum(-1)), rtol=1e-6)


def test_matmul_packed_rejects_mismatched_shapes():
    assert not gemm.packable((64, 40)) and gemm.packable((64, 48)) and gemm.packable((48, 7), transposed=True)
    with pytest.raises(Exception, match="matmul_packed"):
        jax.block_until_ready(gemm.matmul_packed(np.ones((2, 8), np.float32), np.ones((1, 9, 16), np.float32)))


def amx_granted() -> bool:
    """Whether Linux lets this process use AMX's tiles (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA, asked through libc here, apart from the kernels' own request)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64


def test_kernel_paths_follow_the_cpu():
    # The build has the SIMD paths this CPU's flags allow (-march=native), so each is tested here;
    # AMX where the CPU has its bf16 tiles and the kernel lets the process use them.
    flags = lscpu_flags()
    amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags and amx_granted()
    expected = (
        ("portable",)
        + (("avx2",) if {"avx2", "fma"} <= flags else ())
        + (("avx512",) if "avx512f" in flags else ())
        + (("amx",) if amx else ())
    )
    assert native.kernel_paths() == expected
    args = make_batch(0, [1], [5])
    with pytest.raises(ValueError, match="not in this build"):
        native.paged_attention_cpu(*args, path="sse9")


def _one_unit(folder) -> str:  # (a build of seconds, not the kernels' minute; built into folder/cache)
    (folder / "unit.cc").write_text('extern "C" int jaxllm_test_unit() { return 1; }\n')
    return str(folder / "unit.cc")


def test_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "SOURCES", (_one_unit(tmp_path),))
    first = native.build(str(tmp_path / "cache"))
    mtime = os.stat(first).st_mtime_ns
    assert native.build(str(tmp_path / "cache")) == first
    assert os.stat(first).st_mtime_ns == mtime


def test_build_key_covers_every_file_in_csrc(tmp_path, monkeypatch):
    # The compiled units only include the other files: an edited header must give a new library.
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.dirname(native.SOURCES[0]), csrc)
    monkeypatch.setattr(native, "SOURCES", tuple(str(csrc / os.path.basename(src)) for src in native.SOURCES))
    before = native._sources_digest()
    with open(csrc / "simd.h", "a") as f:
        f.write("// edited\n")
    assert native._sources_digest() != before


# x86-64-v2: the portable paths alone; x86-64-v3: AVX2 + FMA + F16C (Zen 2, Zen 3); sapphirerapids:
# AVX-512 with BF16, VNNI and AMX (the paths of Zen 4, Zen 5 and the Intel Xeon).
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3", "sapphirerapids"])
def test_the_kernels_compile_for_every_cpu_kind(march):
    # The build is -march=native: each machine compiles only its own CPU's paths, so a path that
    # does not compile would break the build on another kind unseen here (an AVX2 helper's name
    # once clashed with the AVX-512 one, and the AVX-512 machines ran without the kernels for a
    # day). The compiler checks every unit as that CPU's build would see it (no code generated).
    cxx = native._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = [f for f in native.FLAGS if f not in ("-O3", "-march=native")]
    procs = [
        subprocess.Popen(
            [cxx, *flags, f"-march={march}", "-fsyntax-only", "-w", "-I", jax.ffi.include_dir(), src],
            stderr=subprocess.PIPE,
            text=True,
        )
        for src in native.SOURCES
    ]
    for src, proc in zip(native.SOURCES, procs):
        errors = proc.communicate()[1]
        assert proc.returncode == 0, f"{os.path.basename(src)} does not compile for -march={march}:\n{errors[-4000:]}"


def test_build_reports_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build(str(tmp_path))
    monkeypatch.undo()
    (tmp_path / "broken.cc").write_text("this is not C++")
    monkeypatch.setattr(native, "SOURCES", (_one_unit(tmp_path), str(tmp_path / "broken.cc")))
    with pytest.raises(RuntimeError, match="compiling the CPU kernels failed"):
        native.build(str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build must leave no library behind"


def test_loading_the_kernels_keeps_subnormal_floats():
    """Linking with -ffast-math would set flush-to-zero for the whole process at load time."""
    native.require()
    tiny = np.array([1e-40], np.float32)  # a subnormal float32
    assert (tiny * np.float32(2))[0] > 0  # 0 under denormals-are-zero or flush-to-zero


def test_default_backend_falls_back_to_jnp_rows_without_the_kernels(monkeypatch, caplog):
    from jaxllm.attention import get_attention_backend

    reason = "no C++ compiler found"

    def unavailable():
        raise RuntimeError(f"jaxllm's native CPU kernels are unavailable: {reason}")

    # What a machine without a compiler reports (the platform asks `available`; a backend asked
    # for by name, `require`).
    monkeypatch.setattr(native, "require", unavailable)
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: reason)
    with caplog.at_level("WARNING"):
        assert get_attention_backend(None, "cpu").name == "cpu"
    assert "no C++ compiler found" in caplog.text
    assert get_attention_backend(None, "gpu").name == "pallas"
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        get_attention_backend("native", "cpu")  # asked for by name: no silent fallback
    monkeypatch.undo()
    assert get_attention_backend(None, "cpu").name == "native"
