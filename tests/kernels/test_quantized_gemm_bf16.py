"""The C++ GEMM of 4-, 6- and 8-bit codes x bf16 activations (`kernels.gemm.matmul_quantized_bf16`,
csrc/gemm_quant_bf16.cc) against NumPy and against the packed bf16 GEMM of the same weights
dequantized and rounded to bf16, which it must equal bit for bit, on every code path the build
has: the in-register rows, the converted panels, the SwiGLU epilogue, two-level scales, live
rows; then the weight type that carries such codes (`with_bf16_activations`) and the engine,
which must equal the bf16 engine on the same values."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.kernels import gemm, native
from jaxllm.quantization import QuantizedWeight, dequantize, matmul
from jaxllm.quantization.activations import with_bf16_activations, with_factored
from jaxllm.quantization.weights import _unpacked_codes, embedding_rows, make_weight

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The C++ kernels run on the CPU device (on a GPU machine too)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def random_codes(rng, bits: int, k: int, n: int, groups: int, with_offset: bool, scale_dtype):
    low, high = {4: (0, 16), 6: (-32, 32), 8: (-127, 128)}[bits]
    codes = rng.integers(low, high, (k, n))
    scale = (rng.random((groups, n)) * 0.05 + 1e-3).astype(scale_dtype)
    offset = (-rng.random((groups, n)) * 0.3).astype(scale_dtype) if with_offset else None
    # `d * q + m` rounded once to f32, as the kernel's fused multiply-add rounds it (rounding the
    # product first moves a weight near a bf16 tie by one bf16 step, now and then).
    w = codes.astype(np.float64) * np.repeat(scale.astype(np.float64), k // groups, 0)
    if offset is not None:
        w = w + np.repeat(offset.astype(np.float64), k // groups, 0)
    return codes, scale, offset, w.astype(np.float32)


SIX = pytest.param(6, marks=pytest.mark.skipif(not native.has_six_bit_codes(), reason="no 6-bit codes (AVX512_VBMI)"))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 13, 97])
@pytest.mark.parametrize("k", [72, 96])
@pytest.mark.parametrize("bits", [4, SIX, 8])
@pytest.mark.parametrize(
    "groups, with_offset, scale_dtype", [(3, True, np.float16), (1, False, np.float32), (6, True, np.float32)]
)
def test_matmul_quantized_bf16_is_the_bf16_gemm_of_the_rounded_weights(rows, k, bits, groups, with_offset, scale_dtype):
    # K = 72 (groups of 72, 24, 12 rows) or 96 (AMX's tiles take 32 at a time: from 2 rows the
    # call runs on them, on both sides, where the CPU has them), 7 panels: items of 4, 2 and 1 panels.
    rng = np.random.default_rng(rows * 7 + groups + bits + k)
    n = 112
    codes, scale, offset, w = random_codes(rng, bits, k, n, groups, with_offset, scale_dtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = gemm.pack_codes(codes, bits, pairs=bits == 4)
    assert packed.shape == {4: (n // 16, k // 4, 32), 6: (n // 16, k // 4, 48), 8: (n // 16, k, 16)}[bits]
    ref = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64)
    bf16_panels = gemm.pack_weight(w.astype(ml_dtypes.bfloat16), dtype=ml_dtypes.bfloat16)
    for path in ("auto", *native.kernel_paths()):
        if path == "avx2":
            continue  # the bf16 kernels have portable, AVX-512 and AMX code only
        call = functools.partial(gemm.matmul_quantized_bf16, bits=bits, path=path)
        y = jax.jit(call)(x, packed, gemm.pack_scales(scale), gemm.pack_scales(offset))
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        same = jax.jit(functools.partial(gemm.matmul_packed, path=path))(x, bf16_panels)
        np.testing.assert_array_equal(y, same)


@pytest.mark.parametrize("rows", [1, 3, 7, 30])
def test_matmul_quantized_bf16_swiglu_two_level_scales_and_live_rows(rows):
    # [gate | up], 3 panels each, with GGUF K-quant style scales: int8 sub-scales of f16 supers
    # (two groups to a super-group); then only the first rows - 1 rows live.
    rng = np.random.default_rng(rows)
    k, n, groups = 64, 96, 4
    codes = rng.integers(0, 16, (k, n))
    sub_s, sub_o = rng.integers(1, 64, (groups, n)).astype(np.int8), rng.integers(0, 64, (groups, n)).astype(np.int8)
    sup_s = (rng.random((groups // 2, n)) * 1e-3).astype(np.float16)
    sup_o = (-rng.random((groups // 2, n)) * 5e-3).astype(np.float16)
    s = sub_s.astype(np.float32) * np.repeat(sup_s.astype(np.float32), 2, 0)
    o = sub_o.astype(np.float32) * np.repeat(sup_o.astype(np.float32), 2, 0)
    w = codes * np.repeat(s, k // groups, 0) + np.repeat(o, k // groups, 0)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    h = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64)
    ref = h[:, : n // 2] / (1 + np.exp(-h[:, : n // 2])) * h[:, n // 2 :]
    packed = gemm.pack_codes(codes, 4, pairs=True)
    sub_s, sub_o = gemm.pack_scales(sub_s), gemm.pack_scales(sub_o)
    for path in ("auto", "portable"):
        call = functools.partial(
            gemm.matmul_quantized_bf16,
            bits=4,
            path=path,
            swiglu=True,
            super_scale=gemm.pack_scales(sup_s),
            super_offset=gemm.pack_scales(sup_o),
        )
        y = jax.jit(call)(x, packed, sub_s, sub_o)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
        live = jax.jit(call)(x, packed, sub_s, sub_o, rows=np.int32(rows - 1))
        np.testing.assert_array_equal(live[: rows - 1], y[: rows - 1])
        assert not np.asarray(live[rows - 1 :]).any()


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 17])
@pytest.mark.parametrize("groups, two_level", [(3, False), (8, True)])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("bits", [4, SIX, 8])
def test_factored_codes_are_the_exact_products_summed_in_f32(rows, groups, two_level, swiglu, bits):
    # `factored=True`: calls of up to 16 rows on the AVX-512 path take each group's scale and
    # offset out of its sums (csrc/gemm_quant_factored.h): bf16(x) times the dequantized weights
    # themselves (not rounded to bf16), within f32 rounding; groups of 32 or 12 rows, one- and
    # two-level scales, 8 panels (items of 4, 2, 1; two at a time from 3 rows), the SwiGLU
    # epilogue, rows 8 at a time (13: 8 and 5); 4-bit codes, 6-bit ones and 8-bit ones within
    # [-64, 63].
    # Past 16 rows, on the portable path and on AMX's tiles (path amx, or auto from 2 rows where
    # the CPU has them), the call is the bf16 GEMM's as without the flag, bit for bit.
    rng = np.random.default_rng(rows * 10 + groups + swiglu + bits)
    k, n = 96, 128
    low, high = {4: (0, 16), 6: (-32, 32), 8: (-64, 64)}[bits]
    codes = rng.integers(low, high, (k, n)).astype(np.int8)
    if two_level:
        sub_s, sub_o = (
            rng.integers(1, 64, (groups, n)).astype(np.int8),
            rng.integers(0, 64, (groups, n)).astype(np.int8),
        )
        sup_s = (rng.random((groups // 2, n)) * 1e-3).astype(np.float16)
        sup_o = (-rng.random((groups // 2, n)) * 5e-3).astype(np.float16)
        s = sub_s.astype(np.float64) * np.repeat(sup_s.astype(np.float64), 2, 0)
        o = sub_o.astype(np.float64) * np.repeat(sup_o.astype(np.float64), 2, 0)
        args = (gemm.pack_scales(sub_s), gemm.pack_scales(sub_o))
        supers = dict(super_scale=gemm.pack_scales(sup_s), super_offset=gemm.pack_scales(sup_o))
    else:
        _, scale, offset, _ = random_codes(rng, 4, k, n, groups, True, np.float16)
        s, o = scale.astype(np.float64), offset.astype(np.float64)
        args, supers = (gemm.pack_scales(scale), gemm.pack_scales(offset)), {}
    w = codes * np.repeat(s, k // groups, 0) + np.repeat(o, k // groups, 0)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ref = bf16(x).astype(np.float64) @ w
    if swiglu:
        ref = ref[:, : n // 2] / (1 + np.exp(-ref[:, : n // 2])) * ref[:, n // 2 :]
    packed = gemm.pack_codes(codes, bits, pairs=bits == 4)
    call = functools.partial(gemm.matmul_quantized_bf16, bits=bits, swiglu=swiglu, **supers)
    for path in ("auto", "portable", *native.kernel_paths()):
        if path == "avx2":
            continue
        exact = jax.jit(functools.partial(call, path=path))(x, packed, *args)
        got = jax.jit(functools.partial(call, path=path, factored=True))(x, packed, *args)
        tiles = path == "amx" or (path == "auto" and rows >= 2 and "amx" in native.kernel_paths())
        if rows > 16 or path == "portable" or tiles or not native.has_bf16_dots():
            np.testing.assert_array_equal(got, exact)
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6 * np.abs(ref).max(), err_msg=path)
            assert not np.array_equal(got, exact)  # (the weights' bf16 rounding is gone)


def test_matmul_quantized_bf16_rejects_what_it_cannot_run():
    rng = np.random.default_rng(0)
    codes, scale, offset, _ = random_codes(rng, 4, 24, 32, 4, True, np.float16)  # groups of 6 rows
    scale, offset = gemm.pack_scales(scale), gemm.pack_scales(offset)
    x = jnp.ones((2, 24), jnp.float32)
    with pytest.raises(Exception, match="groups of a multiple of 4 rows"):
        jax.block_until_ready(gemm.matmul_quantized_bf16(x, gemm.pack_codes(codes, 4, pairs=True), scale, offset, 4))
    with pytest.raises(Exception, match="int8 \\[N / 16, K, 16\\] \\(bits 8\\)"):  # 4-bit panels as 8-bit
        jax.block_until_ready(gemm.matmul_quantized_bf16(x, gemm.pack_codes(codes, 4), scale[:, :1], None, 8))


def test_with_bf16_activations_keeps_the_weight():
    # The pairs layout holds the same codes (dequantize, shape) and multiplies as the bf16 GEMM
    # of the rounded weights; 8-bit codes likewise in their own panels; groups of 2 rows stay.
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    q = make_weight(w, "int4", panels=True, activations="float")
    p = with_bf16_activations(q)
    assert isinstance(p, QuantizedWeight) and p.activations == "bf16" and p.shape == q.shape == (64, 48)
    np.testing.assert_array_equal(_unpacked_codes(p, np), _unpacked_codes(q, np))
    # (repacked panel by panel, `gemm.pairs_from_panels`: as packing the codes afresh)
    np.testing.assert_array_equal(np.asarray(p.codes), gemm.pack_codes(_unpacked_codes(q, np), 4, pairs=True))
    np.testing.assert_array_equal(dequantize(p), dequantize(q))
    x = rng.standard_normal((5, 64)).astype(np.float32)
    ref = bf16(x).astype(np.float64) @ bf16(dequantize(q)).astype(np.float64)
    np.testing.assert_allclose(jax.jit(matmul)(x, p), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    q8 = make_weight(w, "int8", panels=True, activations="float")
    p8 = with_bf16_activations(q8)  # 8-bit codes keep their panels
    assert p8.activations == "bf16" and p8.codes is q8.codes
    ref8 = bf16(x).astype(np.float64) @ bf16(dequantize(q8)).astype(np.float64)
    np.testing.assert_allclose(jax.jit(matmul)(x, p8), ref8, rtol=1e-5, atol=1e-5 * np.abs(ref8).max())
    tokens = np.array([0, 17, 40])  # embedding rows: the bf16 table's
    np.testing.assert_array_equal(jax.jit(embedding_rows)(p8, tokens), bf16(dequantize(q8).T[tokens]))
    two_row_groups = QuantizedWeight(
        q.codes, jnp.repeat(q.scale, 16, 1), jnp.repeat(q.offset, 16, 1), 4, "panels", "float"
    )
    assert with_bf16_activations(two_row_groups) is two_row_groups


@pytest.mark.skipif(not native.has_six_bit_codes(), reason="no 6-bit codes (AVX512_VBMI)")
def test_with_factored_keeps_narrow_8bit_codes_in_6_bits():
    # 8-bit codes within [-32, 31] (GGUF's Q6_K, Q5_0) factored: repacked in 6 bits, three
    # quarters of the bytes; the same codes, weights, table rows and unfactored products (bit for
    # bit), factored ones within f32 rounding of the 8-bit codes'. Wider codes stay in 8 bits.
    rng = np.random.default_rng(2)
    k, n, groups = 64, 48, 4
    codes, scale, _, _ = random_codes(rng, 6, k, n, groups, False, np.float32)
    q8 = with_bf16_activations(
        QuantizedWeight(jnp.asarray(gemm.pack_codes(codes, 8)), gemm.pack_scales(scale), None, 8, "panels", "float")
    )
    q6 = with_factored(q8)
    assert (q6.bits, q6.factored, q6.shape) == (6, True, q8.shape) and q6.codes.nbytes * 4 == q8.codes.nbytes * 3
    np.testing.assert_array_equal(_unpacked_codes(q6, np), codes)
    np.testing.assert_array_equal(_unpacked_codes(q6, jnp), codes)
    np.testing.assert_array_equal(dequantize(q6), dequantize(q8))
    tokens = np.array([0, 17, 40])
    np.testing.assert_array_equal(jax.jit(embedding_rows)(q6, tokens), embedding_rows(q8, tokens))
    for rows in (3, 20):  # factored, then past 16 rows the bf16 GEMM over codes
        x = rng.standard_normal((rows, k)).astype(np.float32)
        want = jax.jit(matmul)(x, dataclasses.replace(q8, factored=True))
        got = jax.jit(matmul)(x, q6)
        if rows > 16:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    wide = codes.copy()
    wide[5, 7] = -33
    q8 = dataclasses.replace(q8, codes=jnp.asarray(gemm.pack_codes(wide, 8)))
    assert (with_factored(q8).bits, with_factored(q8).factored) == (8, True)


def bf16_valued_copy(model_dir: str, out: str) -> str:
    """`model_dir` with every weight rounded to bf16 (stored in float32): under dtype bfloat16
    the engine then quantizes the values the checkpoint holds, as the float32 reference does."""
    import shutil

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.save_pretrained(out)
    for name in os.listdir(model_dir):
        if "token" in name or "template" in name:
            shutil.copy(os.path.join(model_dir, name), out)
    return out


@pytest.mark.skipif(not native.has_bf16_dots(), reason="no AVX512_BF16 here: bf16 weights are not packed")
def test_int4_engine_under_bf16_is_the_bf16_engine_on_quantized_values(tiny_model_dir, tmp_path):
    # Under dtype bfloat16 every quantized matrix (4-bit layers, the 8-bit tied LM head) takes
    # bf16 activations and its dequantized weights rounded to bf16, and the embedding rows are
    # rounded too: the bf16 engine on the same values, token for token and logprob for logprob.
    from tests.helpers.quantized_checkpoints import PROMPTS, fake_quantized_checkpoint
    from tests.helpers.tiny_model import TINY_ENGINE_ARGS

    from jaxllm import LLM, SamplingParams

    model = bf16_valued_copy(tiny_model_dir, str(tmp_path / "bf16-valued"))
    args = {**TINY_ENGINE_ARGS, "dtype": "bfloat16"}
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    ref = LLM(fake_quantized_checkpoint(model, "int4", str(tmp_path / "int4")), **args)
    ref_out = ref.generate(PROMPTS, greedy, use_tqdm=False)
    del ref
    llm = LLM(model, quantization="int4", **args)
    params = llm.engine.runner.params
    assert {params["layers"][0][name].activations for name in ("wqkv", "wo", "w_gate_up", "w_down")} == {"bf16"}
    assert params["embed"].activations == "bf16" and params["embed"].bits == 8
    for a, b in zip(llm.generate(PROMPTS, greedy, use_tqdm=False), ref_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs
        ]


@pytest.mark.slow
@pytest.mark.skipif(not native.has_bf16_dots(), reason="no AVX512_BF16 here: bf16 weights are not packed")
def test_default_gguf_kept_under_bf16_is_the_bf16_engine():
    # The default model's Q4_1 layers and Q8_0 embedding kept (`quantization="gguf"`, the
    # weights rounded to bf16 in every step: `small_step_factored=False`) against the same file
    # dequantized to bf16 (`quantization="none"`): the same tokens and logprobs.
    from jaxllm import LLM, SamplingParams

    args = dict(
        dtype="bfloat16",
        max_num_seqs=8,
        max_model_len=512,
        kv_cache_memory=32 << 20,
        warmup=False,
        background_compile=False,
    )
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    kept = LLM(quantization="gguf", small_step_factored=False, **args)
    assert kept.engine.runner.params["layers"][0]["wqkv"].activations == "bf16"
    out = kept.generate(prompts, greedy, use_tqdm=False)
    del kept
    ref = LLM(quantization="none", **args).generate(prompts, greedy, use_tqdm=False)
    for a, b in zip(out, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in d.items()} for d in b.outputs[0].logprobs
        ]
