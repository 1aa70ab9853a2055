"""Weight quantization (jaxllm/quantization): the schemes against hand-written NumPy, every
matmul path against a NumPy reference of the same scheme (the C++ quantized GEMM's own tests:
test_quantized_gemm.py), whole quantized engines against the float engine on a checkpoint
whose weights were replaced by their quantized values (the same scheme applied in NumPy to the HF weights), and the
perplexity tool against HF transformers."""

from __future__ import annotations

import functools
import json
import math

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import QUANTIZATION_METHODS, EngineArgs
from jaxllm.kernels import native
from jaxllm.quantization import (
    CHECKPOINT_METHODS,
    METHODS,
    QuantizedWeight,
    dequantize,
    matmul,
    quantize_matrix,
    weight_bytes,
)
from jaxllm.quantization.sharding import make_sharded_weight
from jaxllm.quantization.weights import embedding_rows, make_weight, relayout, w8a8_act_group

from tests.helpers.cuda_lowering import INTERPRET, arg, lower_for_cuda
from tests.helpers.quantized_checkpoints import PROMPTS, fake_quantized_checkpoint, reference_weight
from tests.helpers.tiny_model import FAMILY_ENGINE_ARGS, TINY_ENGINE_ARGS, offline_llm

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


def test_methods_agree_with_the_config_choices():
    assert (*METHODS, *CHECKPOINT_METHODS, "none") == QUANTIZATION_METHODS


@pytest.mark.parametrize("bits, group", [(8, None), (8, 16), (4, 32), (4, None)])
def test_quantize_matrix_matches_the_scheme(bits, group):
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    w[:, 3] = 0.0  # a zero column keeps a usable scale
    codes, scale, offset = quantize_matrix(w, bits, group)
    groups = 1 if group is None else 64 // group
    assert scale.shape == (groups, 48) and (offset is None) == (bits == 8)
    lo, hi = (-127, 127) if bits == 8 else (0, 15)
    assert codes.min() >= lo and codes.max() <= hi and codes.dtype == (np.int8 if bits == 8 else np.uint8)
    assert scale.dtype == (np.float32 if bits == 8 else np.float16)
    rows = 64 // groups
    scale, offset = scale.astype(np.float64), None if offset is None else offset.astype(np.float64)
    deq = codes * np.repeat(scale, rows, 0) + (0 if offset is None else np.repeat(offset, rows, 0))
    np.testing.assert_allclose(deq, reference_weight(w, bits, group), rtol=1e-5, atol=1e-6)
    # Within half a step of w, and (f16 rounding of the offset and scale) a little more at 4 bits.
    assert np.abs(deq - w).max() <= np.repeat(scale, rows, 0).max() * (0.5 if bits == 8 else 0.6)


def w8a8_reference(x: np.ndarray, w: np.ndarray, block: int = 0) -> np.ndarray:
    """W8A8 by hand: int8 rows of x (a scale per row and block of `block` columns; 0: per row),
    int8 columns of w (a scale per column), exact integer dots of the blocks, then both scales."""
    rows, k = x.shape
    b = block or k
    xb = x.reshape(rows, k // b, b)
    xs = np.abs(xb).max(2, keepdims=True) / 127
    ws = np.abs(w).max(0, keepdims=True) / 127
    xq = np.clip(np.round(xb / xs), -127, 127).astype(np.int64)
    wq = np.clip(np.round(w / ws), -127, 127).astype(np.int64)
    return (np.einsum("rbk,bkn->rbn", xq, wq.reshape(k // b, b, -1)) * xs).sum(1) * ws


@pytest.mark.parametrize(
    "method, panels, k",
    [
        ("int8", True, 96),
        ("int8", False, 96),
        ("int4", True, 96),
        ("int4", False, 96),
        ("w8a8", True, 132),
        ("w8a8", False, 132),
        ("w8a8", True, 320),
        ("w8a8", False, 320),
    ],
)
def test_every_matmul_path_matches_its_numpy_reference(method, panels, k):
    # On the CPU device, where the C++ GEMM's panels run (on a GPU machine too). W8A8 with K = 132
    # scales x per row, with K = 320 per block of 160 columns (`w8a8_act_group`).
    with jax.default_device(jax.devices("cpu")[0]):
        check_matmul_paths(method, panels, k=k)


@pytest.mark.parametrize("method, k", [("int8", 96), ("int4", 96), ("w8a8", 132), ("w8a8", 320)])
def test_plain_matmul_matches_its_numpy_reference_on_the_default_device(method, k):
    # The plain layout on whatever backend runs the tests: on a GPU the Pallas kernel (int8,
    # int4) and XLA's int8 dots (w8a8).
    check_matmul_paths(method, panels=False, other_layout=jax.default_backend() == "cpu", k=k)


def check_matmul_paths(method: str, panels: bool, other_layout: bool = True, k: int = 96):
    """A weight [k, 80] quantized by `method` in one layout: its values, its product with x and
    its embedding rows against NumPy; then (`other_layout`) the same in the other layout."""
    rng = np.random.default_rng(len(method) + panels)
    n = 80
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((7, k)).astype(np.float32)
    x[:, 5] *= 30  # an outlier channel
    q = make_weight(w, method, panels=panels, activations="int8" if method == "w8a8" else "float")
    assert isinstance(q, QuantizedWeight) and q.layout == ("panels" if panels else "plain") and q.shape == (k, n)
    assert q.act_group == {132: 0, 320: 160}[k] if method == "w8a8" else q.act_group == 0
    bits, group = METHODS[method]
    deq = reference_weight(w, bits, group)
    np.testing.assert_allclose(dequantize(q), deq, rtol=1e-5, atol=1e-6)
    ref = w8a8_reference(x, w, q.act_group) if method == "w8a8" else x.astype(np.float64) @ deq
    y = jax.jit(matmul)(x, q)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    tokens = np.array([0, 17, 79, 40, 8, 15, 16])  # columns in every panel position and nibble half
    np.testing.assert_allclose(jax.jit(embedding_rows)(q, tokens), deq.T[tokens], rtol=1e-5, atol=1e-6)
    if not other_layout:
        return
    other = relayout(q, panels=not panels)  # the other layout holds the same weight
    assert other.layout == ("plain" if panels else "panels")
    np.testing.assert_array_equal(dequantize(other), dequantize(q))
    np.testing.assert_allclose(jax.jit(matmul)(x, other), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_quantization_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="fp3").verify()
    EngineArgs(quantization="gguf", tensor_parallel_size=2, data_parallel_size=2, pipeline_parallel_size=2).verify()
    EngineArgs(quantization="int8_weight_only", num_processes=2, distributed_coordinator="localhost:1").verify()
    EngineArgs(quantization="int4", tensor_parallel_size=2, pipeline_parallel_size=2).verify()


@pytest.mark.parametrize("method, columns, rows", [("int4", 2, 1), ("int4", 1, 2), ("int8", 4, 1), ("w8a8", 1, 2)])
def test_sharded_weights_split_into_the_one_device_values(method, columns, rows):
    # Each shard of a tensor-parallel weight (columns or rows of every field, as parallel.spec_for
    # splits them) dequantizes to its slice of the one-device weight; a pipeline's stack, stage by stage.
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 128, 48)).astype(np.float32)  # [stages, K, N]
    q = make_sharded_weight(w, method, "int8" if method == "w8a8" else "float", columns, rows)
    for stage in range(2):
        whole = dequantize(make_weight(w[stage], method, panels=False, activations="float"))
        axis = 1 if columns > 1 else 0
        for part in range(max(columns, rows)):
            shard = QuantizedWeight(
                *(
                    np.split(np.asarray(f[stage]), max(columns, rows), axis=axis)[part] if f is not None else None
                    for f in (q.codes, q.scale, q.offset)
                ),
                q.bits,
                q.layout,
                q.activations,
            )
            want = np.split(np.asarray(whole), max(columns, rows), axis)[part]
            np.testing.assert_array_equal(dequantize(shard), want)
    with pytest.raises(ValueError, match="4 groups of 32 rows cannot be split over 3 shards"):
        make_sharded_weight(w[0], "int4", "float", rows=3)


def test_w8a8_activation_blocks_fit_the_shards():
    # A scale per block of up to 256 columns of x; per row where no such block divides K or one
    # block would be the row; a row-parallel shard keeps one device's blocks where they fit it
    # (per row over every shard where one device's is per row), else takes its own.
    assert [w8a8_act_group(k) for k in (64, 128, 132, 256, 320, 576, 1536)] == [0, 0, 0, 0, 160, 192, 256]
    for k, rows, want in ((512, 2, 256), (576, 2, 96), (128, 2, 0), (576, 1, 192), (1536, 4, 192)):
        q = make_sharded_weight(np.ones((k, 16), np.float32), "w8a8", "int8", rows=rows)
        assert q.act_group == want, (k, rows)


@pytest.mark.parametrize("method", ["int8_weight_only", "int4"])
def test_weight_only_engine_matches_the_float_engine_on_quantized_values(method, tiny_model_dir, tmp_path):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    ref_llm = LLM(fake_quantized_checkpoint(tiny_model_dir, method, str(tmp_path / method)), **TINY_ENGINE_ARGS)
    ref = ref_llm.generate(PROMPTS, greedy, use_tqdm=False)
    del ref_llm
    llm = LLM(tiny_model_dir, quantization=method, **TINY_ENGINE_ARGS)
    out = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for a, b in zip(out, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, rtol=1e-3)
    # Memory: the tiny model is mostly its tied 49152 x 64 embedding, 1/4 (int8) of f32 plus scales.
    float_bytes = weight_bytes(offline_llm(tiny_model_dir).engine.runner.params)
    quant_bytes = weight_bytes(llm.engine.runner.params)
    assert quant_bytes < 0.3 * float_bytes, (quant_bytes, float_bytes)


@pytest.mark.parametrize("method, block", [("w8a8", None), ("int8", None), ("w8a8", 32)])
def test_w8a8_engine_stays_close_to_the_float_engine(method, block, tiny_model_dir, monkeypatch):
    # Activations are rounded too (each layer's product is checked exactly above), and the
    # weights are smoothed before they are quantized (tests/quantization/test_smoothing.py), so the reference
    # is the float engine and the measure is how close the first token's distribution stays:
    # within 0.3 nats (a wrong scale or a fold left out anywhere moves it by many). "int8" is
    # another name for W8A8: the same run. The tiny model's K (64, 128) take a scale per row
    # (`w8a8_act_group`); with blocks of up to 32 columns, a scale per 32.
    if block:
        monkeypatch.setattr("jaxllm.quantization.weights.W8A8_ACT_GROUP", block)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ref = offline_llm(tiny_model_dir).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, quantization=method, **TINY_ENGINE_ARGS)
    assert llm.engine.config.quantization == "w8a8"
    layer = llm.engine.runner.params["layers"][0]
    names = [name for name in ("wqkv", "wo", "w_gate_up", "w_down") if name in layer]
    assert {layer[name].activations for name in names} == {"int8"}
    assert {layer[name].act_group for name in names} == {block or 0}
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(out, ref):
        a_lp, b_lp = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token in set(a_lp) & set(b_lp):
            assert abs(a_lp[token].logprob - b_lp[token].logprob) < 0.3


def test_int8_activations_engine_stays_close_to_the_weight_only_engine(tiny_model_dir):
    # int4 weights with int8 activations (llama.cpp's scheme; each product checked above) against
    # the same weights with float activations: the first token's distribution within 0.3 nats.
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ref = LLM(tiny_model_dir, quantization="int4", **TINY_ENGINE_ARGS).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, quantization="int4", int8_activations=True, **TINY_ENGINE_ARGS)
    layer = llm.engine.runner.params["layers"][0]
    assert {layer[name].activations for name in ("wqkv", "wo", "w_gate_up", "w_down") if name in layer} == {"int8"}
    assert llm.engine.runner.params["embed"].activations == "float"  # the LM head: 8-bit codes
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(out, ref):
        a_lp, b_lp = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token in set(a_lp) & set(b_lp):
            assert abs(a_lp[token].logprob - b_lp[token].logprob) < 0.3


def test_int8_activations_without_4_bit_weights_warns(tiny_model_dir, caplog):
    # A float model (no quantization) has nothing to run so: said at start-up, not ignored.
    with caplog.at_level("WARNING", logger="jaxllm"):
        llm = LLM(tiny_model_dir, int8_activations=True, **TINY_ENGINE_ARGS)
    assert "activations stay float" in caplog.text
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_perplexity_matches_hf_transformers(tiny_model_dir, tmp_path):
    import torch
    import transformers

    from jaxllm.bench.perplexity import DEFAULT_TEXT, perplexity
    from jaxllm.entrypoints import cli
    from tests.helpers.tiny_model import tiny_engine_flags

    with open(DEFAULT_TEXT, encoding="utf-8") as f:
        text = f.read()[:1500]
    llm = offline_llm(tiny_model_dir)
    result = perplexity(llm, text, window=100)
    ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), 100):
            window = torch.tensor([ids[i : i + 100]])
            if window.shape[1] < 2:
                continue
            logp = torch.log_softmax(model(window).logits[0, :-1].double(), -1)
            nll -= logp.gather(1, window[0, 1:, None]).sum().item()
            count += window.shape[1] - 1
    assert result["tokens"] == count and result["windows"] == -(-len(ids) // 100)
    assert math.isclose(result["perplexity"], math.exp(nll / count), rel_tol=1e-3)
    # The CLI reports the same figure.
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "ppl.json"
    assert (
        cli.main(
            [
                "bench",
                "perplexity",
                "--model",
                tiny_model_dir,
                *tiny_engine_flags(),
                "--window",
                "100",
                "--text-file",
                str(tmp_path / "text.txt"),
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    assert math.isclose(json.loads(out.read_text())["perplexity"], result["perplexity"], rel_tol=1e-6)


@pytest.mark.parametrize(
    "method, k, n, scale_dtype", [("int8", 96, 128, None), ("int4", 96, 256, None), ("int4", 64, 128, np.float32)]
)
def test_pallas_quantized_matmul_matches_numpy_and_lowers_for_cuda(method, k, n, scale_dtype):
    # The GPU path of plain weights, in interpret mode against the dequantized weight in NumPy,
    # and lowered for cuda (Triton); f32 scales as the K-quants and AWQ / GPTQ carry them.
    from jaxllm.kernels.quant_matmul import quantized_matmul

    rng = np.random.default_rng(k + n)
    weight = make_weight(rng.standard_normal((k, n)).astype(np.float32), method, panels=False, activations="float")
    if scale_dtype is not None:
        weight = QuantizedWeight(
            weight.codes,
            weight.scale.astype(scale_dtype),
            weight.offset.astype(scale_dtype),
            weight.bits,
            weight.layout,
            weight.activations,
        )
    x = rng.standard_normal((5, k)).astype(np.float32)
    ref = x.astype(np.float64) @ np.asarray(dequantize(weight), np.float64)
    out = quantized_matmul(x, weight.codes, weight.scale, weight.offset, bits=weight.bits, interpret=INTERPRET)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    abstract = [
        arg((7, k), np.float32),
        *(None if a is None else arg(a.shape, a.dtype) for a in (weight.codes, weight.scale, weight.offset)),
    ]
    text = lower_for_cuda(functools.partial(quantized_matmul, bits=weight.bits), *abstract)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize(
    "bits, groups, tiles",
    [
        (8, 1, dict(block_m=16, block_n=32, block_k=32, split_k=4)),  # K split over programs
        (4, 4, dict(block_m=16, block_n=16, block_k=16, split_k=2)),  # several K steps per scale group
        (4, 2, dict(block_m=32, block_n=32, block_k=64, split_k=1)),  # one step per group, two row blocks
        (8, 8, dict(block_m=16, block_n=64, block_k=64, split_k=2)),  # four groups per step
        (4, 8, dict(block_m=32, block_n=32, block_k=32, split_k=2)),  # groups shorter than the row block
        (4, 1, dict(block_m=16, block_n=16, block_k=64, split_k=1)),  # 4-bit codes, one group over K
    ],
)
def test_pallas_quantized_matmul_tiles_agree_with_numpy(bits, groups, tiles):
    # Every tiling sums the same products: split K (partial sums added after), K steps that share
    # a scale group or span several, row blocks past the batch's rows, the scales applied at the
    # end, per group or to the tile first; float32 x dots in float32, bf16 x in bf16, where the
    # codes are exact (x's own rounding is the only error) and a tile scaled first is rounded.
    from jaxllm.kernels.quant_matmul import Tiles, choose_tiles, fits, quantized_matmul

    k, n, m = 128, 128, 37
    rng = np.random.default_rng(bits + groups)
    codes = (
        rng.integers(-128, 128, (k, n)).astype(np.int8)
        if bits == 8
        else rng.integers(0, 256, (k, n // 2)).astype(np.uint8)
    )
    scale = rng.uniform(0.5, 2.0, (groups, n)).astype(np.float32) / 64
    offset = None if bits == 8 else rng.standard_normal((groups, n)).astype(np.float32) / 8
    weight = QuantizedWeight(codes, scale, offset, bits, "plain", "float")
    dense = np.asarray(dequantize(weight), np.float64)
    tiles = Tiles(**tiles)
    assert fits(tiles, k, n, groups, bits) and fits(choose_tiles(m, k, n, groups, bits), k, n, groups, bits)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = quantized_matmul(x, codes, scale, offset, bits=bits, tiles=tiles, interpret=INTERPRET)
    ref = x.astype(np.float64) @ dense
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    xb = jax.numpy.asarray(x, jax.numpy.bfloat16)
    out = quantized_matmul(xb, codes, scale, offset, bits=bits, tiles=tiles, interpret=INTERPRET)
    scaled_first = groups > 1 and tiles.block_m > min(tiles.block_k, k // groups)
    w = (
        np.asarray(jax.numpy.asarray(dense, jax.numpy.bfloat16).astype(np.float32), np.float64)
        if scaled_first
        else dense
    )
    ref = np.asarray(xb.astype(np.float32), np.float64) @ w
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(ValueError, match="does not tile"):
        quantized_matmul(x, codes, scale, offset, bits=bits, tiles=Tiles(block_k=k, split_k=2), interpret=INTERPRET)


def test_moe_engine_quantizes_its_experts(tmp_path):
    # Mixtral's expert stacks are most of a MoE model's weights: `int8_weight_only` stores them as
    # codes (dequantized in the step, only the chosen experts' at decode), and the first token's
    # distribution stays within 0.1 nats of HF transformers' float model.
    import torch

    from tests.helpers.hf_reference import build_hf_model

    model = build_hf_model("mixtral", tmp_path / "m")
    ids = [5, 17, 33, 2, 41, 8, 19, 23, 4]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
    llm = LLM(
        str(tmp_path / "m"),
        quantization="int8_weight_only",
        **{**FAMILY_ENGINE_ARGS, "max_num_seqs": 4, "max_model_len": 64},
    )
    layer = llm.engine.runner.params["layers"][0]
    for name in ("experts_gate_up", "experts_down"):
        assert isinstance(layer[name], QuantizedWeight) and np.asarray(layer[name].codes).dtype == np.int8
    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False
    )
    got = out[0].outputs[0].logprobs[0]
    assert len(got) >= 5
    for token, entry in got.items():
        assert abs(entry.logprob - want[token]) < 0.1, (token, entry.logprob, want[token])
