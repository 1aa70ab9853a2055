"""The quantized KV caches' storage (kernels/kv_write.py): int8 and fp8 (E4M3) rows against NumPy
and `ml_dtypes`, and engines on them against the dense `jnp` oracle and the float cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, kernels

from tests.helpers.tiny_model import TINY_ENGINE_ARGS, offline_llm

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5", "def main():"]


def test_int8_rows_hold_codes_and_a_scale_per_token_and_head():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    x[1, 0] = 0.0  # a zero row keeps a usable scale
    rows = np.asarray(kernels.kv_write.quantize_rows(jnp.asarray(x)))
    assert rows.shape == (5, 2, 12) and rows.dtype == np.int8
    scale = np.abs(x).max(-1) / 127
    codes = np.round(x / np.where(scale > 0, scale, 1)[..., None])
    np.testing.assert_array_equal(rows[..., :8], codes)
    stored = rows[..., 8:].copy().view(np.float32)[..., 0]
    np.testing.assert_array_equal(stored, np.where(scale > 0, scale, 1).astype(np.float32))
    np.testing.assert_allclose(np.asarray(kernels.logical_pages(jnp.asarray(rows))), x, atol=scale.max() / 2 + 1e-7)
    # Written through write_kv into the right slot, the padding token nowhere.
    k_pages = kernels.allocate_kv_cache(1, 2, 4, 4, 8, jnp.int8)[0][0]
    assert k_pages.shape == (2, 4, 4, 12)
    k2, _ = jax.jit(kernels.write_kv)(k_pages, k_pages, x[:2], x[:2], np.array([6, -1], np.int32))
    np.testing.assert_array_equal(np.asarray(k2)[:, 1, 2], rows[0])
    assert np.count_nonzero(np.asarray(k2)) == np.count_nonzero(rows[0])


def test_fp8_rows_hold_e4m3_codes_and_a_scale_per_token_and_head():
    # Against ml_dtypes' float8_e4m3fn (NumPy's, not XLA's conversion): the codes, the scale,
    # the values read back, and the integer-only decode the Triton kernel uses, on every code.
    import ml_dtypes

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 2, 8)) * 3.0 ** np.arange(-6, 6).reshape(6, 2, 1)).astype(np.float32)
    x[1, 0] = 0.0  # a zero row keeps a usable scale
    rows = np.asarray(kernels.kv_write.quantize_rows(jnp.asarray(x), jnp.uint8))
    assert rows.shape == (6, 2, 12) and rows.dtype == np.uint8
    amax = np.abs(x).max(-1)
    scale = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
    np.testing.assert_array_equal(rows[..., 8:].copy().view(np.float32)[..., 0], scale)
    codes = np.clip(x / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(rows[..., :8], codes.view(np.uint8))
    back = np.asarray(kernels.logical_pages(jnp.asarray(rows)))
    np.testing.assert_array_equal(back, codes.astype(np.float32) * scale[..., None])
    assert np.all(np.abs(back - x) <= np.abs(x) / 16 + scale[..., None] * 2.0**-10)  # 3 mantissa bits
    every = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(every.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(kernels.kv_write.fp8_bits_to_f32(jnp.asarray(every)))[finite],
        every.view(ml_dtypes.float8_e4m3fn).astype(np.float32)[finite],
    )


@pytest.mark.parametrize("kv_dtype, storage", [("int8", np.int8), ("fp8", np.uint8)])
def test_quantized_kv_cache_engine(tiny_model_dir, kv_dtype, storage):
    # The C++ kernel on int8 / fp8 pages against the dense jnp oracle on the same pages (both
    # read what the KV write stored), and the float cache's first tokens kept. (Swaps and
    # sharding of quantized pages: tests/parallel/test_sharding.py.)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    native_llm = LLM(tiny_model_dir, kv_cache_dtype=kv_dtype, **TINY_ENGINE_ARGS)
    out = native_llm.generate(PROMPTS, greedy, use_tqdm=False)
    float_llm = offline_llm(tiny_model_dir)
    cfg, cache = native_llm.engine.cfg, native_llm.engine.config.cache
    assert cache.dtype == {"fp8": "fp8_e4m3"}.get(kv_dtype, kv_dtype)
    assert native_llm.engine.runner.kv_cache[0][0].dtype == storage
    assert native_llm.engine.runner.kv_cache[0][0].shape[-1] == cfg.head_dim + 4
    # Blocks in the same budget: f32 rows of head_dim floats against head_dim codes and a scale.
    ratio = cache.num_pages / float_llm.engine.config.cache.num_pages
    assert ratio == pytest.approx(4 * cfg.head_dim / (cfg.head_dim + 4), rel=1e-3)
    del native_llm
    oracle = LLM(tiny_model_dir, kv_cache_dtype=kv_dtype, attention_backend="reference", **TINY_ENGINE_ARGS)
    for a, b in zip(out, oracle.generate(PROMPTS, greedy, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, rtol=1e-4)
    del oracle
    # E4M3 keeps 3 mantissa bits: on Gaussian rows its rounding error is about 4x int8's (2.5%
    # against 0.6% RMS), and so is the first logprobs' drift here (0.40 against 0.04 at most).
    tol = {"int8": 0.1, "fp8": 0.5}[kv_dtype]
    for a, b in zip(out, float_llm.generate(PROMPTS, greedy, use_tqdm=False)):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for token in set(first_a) & set(first_b):
            assert abs(first_a[token].logprob - first_b[token].logprob) < tol


@pytest.mark.parametrize("dtype, kv_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_float_pages_of_another_dtype_than_the_model(tiny_model_dir, dtype, kv_dtype):
    # kv_cache_dtype="bfloat16" under a float32 model (what dtype "auto" gives on CPUs without
    # hardware bf16 dots), and the other way round: the C++ kernel against the dense jnp oracle on
    # the same pages, the page count against the model's own dtype, the first tokens kept.
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    args = {**TINY_ENGINE_ARGS, "dtype": dtype}
    native_llm = LLM(tiny_model_dir, kv_cache_dtype=kv_dtype, **args)
    out = native_llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert native_llm.engine.config.cache.dtype == kv_dtype
    assert native_llm.engine.runner.kv_cache[0][0].dtype == kernels.storage_dtype(kernels.cache_dtype(kv_dtype))
    same_llm = LLM(tiny_model_dir, kv_cache_dtype=dtype, **args)
    ratio = native_llm.engine.config.cache.num_pages / same_llm.engine.config.cache.num_pages
    assert ratio == pytest.approx({"bfloat16": 2.0, "float32": 0.5}[kv_dtype], rel=1e-3)
    oracle = LLM(tiny_model_dir, kv_cache_dtype=kv_dtype, attention_backend="reference", **args)
    for a, b in zip(out, oracle.generate(PROMPTS, greedy, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, rtol=1e-3)
    del native_llm, oracle
    for a, b in zip(out, same_llm.generate(PROMPTS, greedy, use_tqdm=False)):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for token in set(first_a) & set(first_b):
            assert abs(first_a[token].logprob - first_b[token].logprob) < 0.1
