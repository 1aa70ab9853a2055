"""Quantized checkpoints run as they are: GGUF blocks (`quantization/gguf_blocks.py`) against
gguf-py's own dequantization, and AWQ / GPTQ checkpoints written here by reference packers
(the formats as AutoAWQ and AutoGPTQ define them) against the float engine on the weights
those codes stand for."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import gemm, native
from jaxllm.models.loader import load_model
from jaxllm.quantization import QuantizedWeight, matmul, weight_bytes
from jaxllm.quantization.activations import with_int8_activations
from jaxllm.quantization.weights import (
    dequantize as dequantize_weight,
    embedding_rows,
    flat_scales,
    relayout,
)

from tests.helpers.cpu_host import lscpu_flags
from tests.helpers.quantized_checkpoints import gguf_blocks, write_quantized_gguf, write_quantized_hf
from tests.helpers.tiny_model import TINY_ENGINE_ARGS

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_keep_exactly_the_values_gguf_py_dequantizes(name, monkeypatch):
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from jaxllm.quantization.gguf_blocks import gguf_rows

    t = T[name]
    rng = np.random.default_rng(int(t))
    data = gguf_blocks(rng, (32, 512), t)
    rows = gguf_rows(data, t, (32, 512))
    assert rows.bits == (4 if name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    np.testing.assert_array_equal(rows.dequantize(), dequantize(data, t).reshape(32, 512))
    # ... and the C++ GEMM and the plain path multiply by those values.
    weight = rows.to_weight()
    x = rng.standard_normal((5, 512)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(data, t).reshape(32, 512).T.astype(np.float64)
    assert relayout(weight, panels=True).layout == "panels"
    for w in (weight, relayout(weight, panels=True)):
        np.testing.assert_allclose(matmul(x, w), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if t not in (T.Q4_K, T.Q5_K, T.Q6_K):
        return
    # The K-quants keep two-level scales (int8 sub-scales of an f16 per 256 rows): 4.625 bits a
    # weight for Q4_K, 8.625 for the 8-bit codes ...
    assert rows.scale.dtype == np.int8 and rows.super_scale.dtype == np.float16
    assert rows.super_scale.shape == (32, 2) and (rows.offset is None) == (t == T.Q6_K)
    bits = weight_bytes(relayout(weight, panels=True)) * 8 / (32 * 512)
    assert bits <= (4.625 if t == T.Q4_K else 8.625), bits
    # ... and every path gives exactly what the scales multiplied out give (the same f32 scales).
    flat = flat_scales(weight)
    assert flat.super_scale is None and flat.scale.dtype == np.float32
    tokens = jnp.asarray([0, 5, 31, 7])
    np.testing.assert_array_equal(embedding_rows(weight, tokens), embedding_rows(flat, tokens))
    for a, b in [(weight, flat), (relayout(weight, panels=True), relayout(flat, panels=True))]:
        np.testing.assert_array_equal(matmul(x, a), matmul(x, b))
    if t == T.Q4_K:  # 4-bit codes x int8 activations (llama.cpp's scheme) read them too
        a, b = (with_int8_activations(relayout(w, panels=True)) for w in (weight, flat))
        assert a.activations == "int8"
        np.testing.assert_array_equal(matmul(x, a), matmul(x, b))
    # For a GPU (the Pallas kernel takes one level) they are multiplied out once, when laid out.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    on_gpu = relayout(weight, panels=False)
    assert on_gpu.super_scale is None and on_gpu.scale.dtype == np.float32
    np.testing.assert_array_equal(dequantize_weight(on_gpu), dequantize_weight(weight))
    monkeypatch.undo()
    # The C++ GEMM refuses int8 sub-scales without their super-scales, and super-scales that
    # do not divide the groups.
    packed = relayout(weight, panels=True)
    for super_scale in (None, packed.super_scale[:, :1].repeat(3, axis=1)):
        with pytest.raises(Exception, match="two-level"):
            gemm.matmul_quantized(
                x,
                packed.codes,
                packed.scale,
                packed.offset,
                packed.bits,
                super_scale=super_scale,
                super_offset=packed.super_offset,
            )


def test_fused_parts_of_different_block_types_share_the_widest_format():
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from jaxllm.quantization.checkpoint import concat_rows
    from jaxllm.quantization.gguf_blocks import gguf_rows

    rng = np.random.default_rng(0)
    parts = [(T.Q4_K, 32), (T.Q6_K, 16), (T.Q4_1, 16)]
    datas = [gguf_blocks(rng, (out, 256), t) for t, out in parts]
    fused = concat_rows([gguf_rows(d, t, (out, 256)) for d, (t, out) in zip(datas, parts)])
    assert (fused.bits, fused.scale.shape, fused.scale.dtype) == (8, (64, 16), np.float32)
    ref = np.concatenate([dequantize(d, t).reshape(out, 256) for d, (t, out) in zip(datas, parts)])
    np.testing.assert_array_equal(fused.dequantize(), ref)
    # K-quant parts alone keep two levels: Q4_K's 32-row sub-scales repeated to Q6_K's 16.
    two = concat_rows([gguf_rows(d, t, (out, 256)) for d, (t, out) in zip(datas[:2], parts[:2])])
    assert (two.bits, two.scale.dtype, two.scale.shape, two.super_scale.shape) == (8, np.int8, (48, 16), (48, 1))
    np.testing.assert_array_equal(two.dequantize(), ref[:48])
    # So fused (offsets of 16-row groups), their codes within [-32, 31] take int8 rows from 6 bits.
    six = with_int8_activations(relayout(two.to_weight(), panels=True), six_bit=True)
    assert (six.bits, six.activations, six.offset is not None) == (6, "int8", True)
    np.testing.assert_array_equal(dequantize_weight(six), ref[:48].T)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    want = x.astype(np.float64) @ ref[:48].T.astype(np.float64)
    np.testing.assert_allclose(matmul(x, six), want, rtol=0, atol=0.02 * np.abs(want).max())
    # Four-bit parts with f16 scales stay so.
    q41 = [gguf_rows(gguf_blocks(rng, (16, 256), T.Q4_1), T.Q4_1, (16, 256)) for _ in range(2)]
    both = concat_rows(q41)
    assert (both.bits, both.scale.dtype) == (4, np.float16)


def test_gguf_engine_kept_quantized_matches_the_dequantized_engine(tiny_model_dir, tmp_path, monkeypatch):
    # The reference: the same file dequantized by gguf-py into the float32 engine (checked
    # against HF transformers in test_loader.py).
    path = write_quantized_gguf(str(tmp_path / "tiny.gguf"))
    prompts = [{"prompt_token_ids": list(range(i, i + 7 + 3 * i))} for i in range(4)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, detokenize=False)
    args = dict(TINY_ENGINE_ARGS, params_cache_dir=str(tmp_path / "params"))
    ref_llm = LLM(path, quantization="none", **args)
    ref = ref_llm.generate(prompts, greedy, use_tqdm=False)
    float_bytes = weight_bytes(ref_llm.engine.runner.params)
    del ref_llm
    packed = []
    monkeypatch.setattr(gemm, "pack_codes", lambda *a, pack=gemm.pack_codes, **kw: packed.append(1) or pack(*a, **kw))
    for run in range(2):  # the second from the params cache, which keeps the packed layout
        packed.clear()
        llm = LLM(path, **args)  # float32 on a CPU with the C++ kernels: kept quantized by default
        assert bool(packed) == (run == 0)
        assert llm.engine.config.quantization == "gguf"
        params = llm.engine.runner.params
        assert isinstance(params["embed"], QuantizedWeight) and params["embed"].layout == "panels"
        assert [params["layers"][i]["wqkv"].bits for i in range(2)] == [8, 4]
        out = llm.generate(prompts, greedy, use_tqdm=False)
        for a, b in zip(out, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, rtol=1e-4)
        assert weight_bytes(params) < 0.4 * float_bytes, (weight_bytes(params), float_bytes)
        del llm
    with pytest.raises(ValueError, match="needs a GGUF"):
        LLM(tiny_model_dir, quantization="gguf", **TINY_ENGINE_ARGS)


def test_gguf_untied_table_keeps_its_codes(tmp_path):
    """An untied GGUF table (Q4_K, beside a Q6_K output.weight) stays codes, its rows looked up
    from them in f32: the dequantized engine's outputs, from a table of about a seventh of its
    float32 bytes."""
    path = write_quantized_gguf(str(tmp_path / "untied.gguf"), untied=True)
    prompts = [{"prompt_token_ids": list(range(3 * i, 3 * i + 9 + 5 * i))} for i in range(3)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, detokenize=False)
    args = dict(TINY_ENGINE_ARGS, params_cache_dir=str(tmp_path / "params"))
    ref_llm = LLM(path, quantization="none", **args)
    ref = ref_llm.generate(prompts, greedy, use_tqdm=False)
    assert isinstance(ref_llm.engine.runner.params["embed"], jax.Array)
    float_table = ref_llm.engine.runner.params["embed"].nbytes
    del ref_llm
    llm = LLM(path, **args)
    assert not llm.engine.runner.cfg.tie_word_embeddings and llm.engine.config.quantization == "gguf"
    table = llm.engine.runner.params["embed"]
    assert isinstance(table, QuantizedWeight) and (table.bits, table.shape) == (4, (256, 512))
    assert weight_bytes(table) < float_table / 6, (weight_bytes(table), float_table)
    for a, b in zip(llm.generate(prompts, greedy, use_tqdm=False), ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # (the decodes' codes factor their scales out of the sums: f32 rounding of two group sums)
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, rtol=1e-3)


def test_which_ggufs_have_codes_for_int8_dots(tmp_path, monkeypatch):
    """`int8_dot_codes`: every matrix a step multiplies of a type the int8 dot kernels take; an
    untied table is a lookup. On the files themselves: the tiny GGUFs, the default model (a
    tied Q8_0 LM head) and the fetched Qwen2.5-Coder files."""
    from types import SimpleNamespace

    from gguf.constants import GGMLQuantizationType as T

    from jaxllm.models import catalog
    from jaxllm.models.gguf_checkpoint import read_gguf
    from jaxllm.models.loader import default_model_path, local_gguf
    from jaxllm.quantization.gguf_blocks import int8_dot_codes

    def m(t, shape=(64, 64)):
        return SimpleNamespace(shape=shape, ggml_type=t)

    layers = {
        "blk.0.attn_q.weight": m(T.Q4_K),
        "blk.0.ffn_down.weight": m(T.Q6_K),
        "blk.0.attn_norm.weight": m(T.F32, (64,)),
    }
    assert int8_dot_codes({**layers, "token_embd.weight": m(T.Q4_K)})
    assert not int8_dot_codes({**layers, "token_embd.weight": m(T.Q8_0)})  # a tied Q8_0 LM head
    assert int8_dot_codes({**layers, "token_embd.weight": m(T.Q8_0), "output.weight": m(T.Q6_K)})
    assert not int8_dot_codes({**layers, "token_embd.weight": m(T.Q4_K), "output.weight": m(T.F16)})
    assert not int8_dot_codes(
        {**layers, "token_embd.weight": m(T.Q4_K), "blk.0.ffn_up_exps.weight": m(T.Q4_K, (4, 64, 64))}
    )
    assert not int8_dot_codes({"blk.0.attn_norm.weight": m(T.F32, (64,))})

    (tmp_path / "c").mkdir()
    files = {
        write_quantized_gguf(str(tmp_path / "a.gguf")): False,  # its Q8_0 attn_v and table
        write_quantized_gguf(str(tmp_path / "b.gguf"), untied=True): False,  # its Q8_0 attn_v
        write_quantized_gguf(str(tmp_path / "c" / "c.gguf"), int8_dots=True): True,
        default_model_path(): False,
    }
    for name, want in [("qwen2.5-coder-1.5b", True), ("qwen2.5-coder-0.5b", False)]:  # (Q8_0 in the 0.5B)
        if os.path.isfile(os.path.join(catalog.models_dir(), catalog.MODELS[name].file)):
            files[catalog.path_of(name)] = want
    for path, want in files.items():
        assert int8_dot_codes(read_gguf(path)[1]) is want, path
    # The files the engine would read without a download: a path, a folder of one, the default.
    assert local_gguf(str(tmp_path / "a.gguf")) == str(tmp_path / "a.gguf")
    assert local_gguf(str(tmp_path / "c")) == str(tmp_path / "c" / "c.gguf")
    assert local_gguf(None) == default_model_path()
    assert local_gguf(str(tmp_path)) is None  # two GGUFs: the load says which it cannot pick
    assert local_gguf("some-org/some-model") is None and local_gguf(str(tmp_path / "none.gguf")) is None
    # The engine asks only where the platform weighs it (elsewhere the header is not even read).
    from jaxllm.config import EngineArgs
    from jaxllm.weights import prepare
    from tests.helpers.plan_platforms import XEON_AMX, ZEN3, ZEN4

    int8_file = EngineArgs(model=str(tmp_path / "c"))
    assert prepare.int8_dot_checkpoint(int8_file, ZEN4, one_device=True)
    assert not prepare.int8_dot_checkpoint(EngineArgs(model=str(tmp_path / "a.gguf")), ZEN4, one_device=True)
    assert not prepare.int8_dot_checkpoint(int8_file, ZEN4, one_device=False)
    assert prepare.int8_dot_checkpoint(int8_file, XEON_AMX, one_device=True)
    monkeypatch.setattr(prepare, "read_gguf", None)  # (called, it would raise)
    assert not prepare.int8_dot_checkpoint(int8_file, ZEN3, one_device=True)


@pytest.mark.skipif(
    not {"avx512_bf16", "avx512_vnni"} <= lscpu_flags(),
    reason="dtype auto weighs int8 dots on CPUs with AVX512_BF16 and AVX512_VNNI",
)
def test_dtype_auto_serves_a_gguf_of_int8_dot_codes_with_int8_activations(tmp_path):
    """On a Zen 4 / Zen 5 or AMX kind of CPU a GGUF whose matrices are all 4- or 6-bit codes runs by
    default as it does when asked for float32 with int8 activations on bf16 KV pages (the same
    tokens and logprobs), with speculative decoding too; int8_activations=False or a Q8_0 matrix
    keeps bfloat16."""
    path = write_quantized_gguf(str(tmp_path / "int8-dots.gguf"), int8_dots=True)
    prompts = [{"prompt_token_ids": list(range(5 * i, 5 * i + 7 + 9 * i))} for i in range(3)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, detokenize=False)
    args = dict(TINY_ENGINE_ARGS, dtype="auto", params_cache_dir=str(tmp_path / "params"))
    auto = LLM(path, **args)
    config = auto.engine.config
    assert (config.dtype, config.cache.dtype, config.int8_activations) == ("float32", "bfloat16", True)
    params = auto.engine.runner.params  # (the untied table: a lookup of its codes)
    matmuls = [
        *(layer[n] for layer in params["layers"] for n in ("wqkv", "wo", "w_gate_up", "w_down")),
        params["lm_head"],
    ]
    # (the first layer's fused QKV, its Q4_K query beside a Q6_K key and value, in 6 bits too:
    # groups of 16 rows with offsets)
    mixed = params["layers"][0]["wqkv"]
    assert (mixed.bits, mixed.activations, mixed.offset is not None) == (6, "int8", True)
    assert all(w.activations == "int8" for w in matmuls) and {w.bits for w in matmuls} == {4, 6}
    got = auto.generate(prompts, greedy, use_tqdm=False)
    del auto
    asked = LLM(path, **{**args, "dtype": "float32", "int8_activations": True, "kv_cache_dtype": "bfloat16"})
    for a, b in zip(got, asked.generate(prompts, greedy, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
    del asked
    assert LLM(path, **args, int8_activations=False).engine.config.dtype == "bfloat16"
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = LLM(path, **args, speculative_config=ngram).engine.config
    assert (config.dtype, config.int8_activations) == ("float32", True)
    # A draft quantized on load multiplies int8 rows as the target does (its 4-bit codes, and
    # its 8-bit LM head rounded to 6 bits); the outputs stay the target's.
    draft = {"model": path, "num_speculative_tokens": 3, "quantization": "int4"}
    spec = LLM(path, **args, speculative_config=draft)
    codes = jax.tree.leaves(
        spec.engine.scheduler.proposer.runner.params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    codes = [w for w in codes if isinstance(w, QuantizedWeight) and w.layout == "panels"]
    assert {w.bits for w in codes} == {4, 6} and all(w.activations == "int8" for w in codes)
    spec_greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    for a, b in zip(got, spec.generate(prompts, spec_greedy, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert spec.engine.engine_core.stats.num_accepted_tokens > 0
    del spec
    other = write_quantized_gguf(str(tmp_path / "q8.gguf"), untied=True)
    assert LLM(other, **args).engine.config.dtype == "bfloat16"


def test_verification_steps_keep_int8_rows_where_bf16_dots_take_larger_calls(tmp_path, monkeypatch):
    """Int8 rows' calls of `act8_bf16_rows` rows or more take bf16 dots (other numbers: AMX's
    tiles, or VDPBF16PS over 6-bit codes, here from 17 rows); a speculating engine's
    verification steps keep the int8 rows (`check_path`), so that each row computes what its
    decode would: with drafts for 6 sequences at once (checks of up to 24 rows) the greedy
    outputs and logprobs are those without drafts."""
    with native.act8_bf16_rows_set(6, 17):
        if not gemm.act8_on_bf16("auto", 4096, 6):
            pytest.skip("no bf16 dots for int8 rows' codes here (AVX512_BF16 and AVX512_VBMI)")
        _check_int8_rows_kept(tmp_path, monkeypatch)


def _check_int8_rows_kept(tmp_path, monkeypatch):
    from tests.helpers.oracle_proposer import OracleProposer

    path = write_quantized_gguf(str(tmp_path / "int8-dots.gguf"), int8_dots=True)
    prompts = [{"prompt_token_ids": list(range(7 * i, 7 * i + 9 + 2 * i))} for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True, detokenize=False)
    args = dict(TINY_ENGINE_ARGS, dtype="float32", int8_activations=True, params_cache_dir=str(tmp_path / "params"))
    plain = LLM(path, **args).generate(prompts, greedy, use_tqdm=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec = LLM(path, **args, speculative_config=ngram)
    runner = spec.engine.runner
    check = max((b for b in runner.buckets if b.all_logits), key=lambda b: b.num_tokens)
    assert runner.check_path == "avx512" and check.num_tokens >= native.act8_bf16_rows(6)  # (its 6-bit QKVs)
    assert runner.step_params(check)["layers"][0]["wqkv"].path == "avx512"
    assert runner.params["layers"][0]["wqkv"].path == "auto"  # (a prompt's steps: bf16 dots)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    monkeypatch.setattr(spec.engine.scheduler, "proposer", OracleProposer(sequences, k=3, vocab=512))
    for a, b in zip(spec.generate(prompts, greedy, use_tqdm=False), plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
    assert spec.engine.stats.num_accepted_tokens > 0


def test_gguf_engine_loads_float_weights_when_the_kernel_build_fails(tmp_path, monkeypatch):
    """The engine decides to keep a GGUF's blocks before the C++ kernels' build (on its thread)
    is done; if the build then fails, it loads the weights as floats for the jnp paths."""
    path = write_quantized_gguf(str(tmp_path / "tiny.gguf"))
    prompts = [{"prompt_token_ids": list(range(i, i + 7 + 3 * i))} for i in range(3)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    args = dict(TINY_ENGINE_ARGS, params_cache_dir=str(tmp_path / "params"))
    ref = LLM(path, quantization="none", attention_backend="cpu", **args).generate(prompts, greedy, use_tqdm=False)

    def failed():
        raise RuntimeError("jaxllm's native CPU kernels are unavailable: the build failed (simulated)")

    monkeypatch.setattr(native, "expected", lambda: True)  # a compiler is there, the build under way
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "require", failed)
    llm = LLM(path, **args)
    assert llm.engine.config.quantization is None and llm.engine.runner.attention.name == "cpu"
    assert not any(
        isinstance(w, QuantizedWeight)
        for w in jax.tree_util.tree_leaves(llm.engine.runner.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    )
    out = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


# ----------------------------------------------------------------------------- AWQ and GPTQ


@pytest.mark.parametrize("method, bits, act_order", [("awq", 4, False), ("gptq", 4, True), ("gptq", 8, False)])
def test_awq_and_gptq_checkpoints_match_the_float_engine_on_their_values(
    method, bits, act_order, tiny_model_dir, tmp_path
):
    out, ref_dir = str(tmp_path / method), str(tmp_path / "ref")
    write_quantized_hf(tiny_model_dir, method, bits, act_order, out, ref_dir)
    prompts = ["Hello, my name is", "The capital of France is", "1 2 3 4 5", "def main():"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    args = dict(TINY_ENGINE_ARGS, params_cache_dir=str(tmp_path / "params"))
    ref_llm = LLM(ref_dir, **args)
    ref = ref_llm.generate(prompts, greedy, use_tqdm=False)
    del ref_llm
    llm = LLM(out, **args)
    assert llm.engine.config.quantization == method
    wqkv = llm.engine.runner.params["layers"][0]["wqkv"]
    assert isinstance(wqkv, QuantizedWeight) and wqkv.bits == bits and (wqkv.perm is not None) == act_order
    for a, b in zip(llm.generate(prompts, greedy, use_tqdm=False), ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, rtol=1e-3)
    del llm
    with pytest.raises(ValueError, match="already quantized"):
        LLM(out, quantization="int8", **args)
    with pytest.raises(ValueError, match="needs a checkpoint quantized so"):
        LLM(ref_dir, quantization=method, **args)
    # Over two pipeline stages each layer slot's matrices stack [stage, ...] in the plain layout
    # (act-order: each stage's own row order); test_quantized_checkpoints_run_tensor_and_pipeline_parallel
    # runs them.
    staged = load_model(out, pipeline_parallel_size=2, use_cache=False).params["layers"][0]["wqkv"]
    assert staged.layout == "plain" and staged.codes.shape[0] == staged.scale.shape[0] == 2
    assert (staged.perm is not None and staged.perm.shape == (2, staged.shape[0])) == act_order


@pytest.mark.multiprocess
def test_quantized_checkpoints_run_tensor_and_pipeline_parallel(tiny_model_dir, run_on_virtual_devices):
    """GGUF blocks (a tied table and an untied one, each kept as codes split by vocabulary) and
    AWQ codes split over two devices (each holds half of every split matrix's codes and scales)
    generate what one device does (GPTQ's codes take the same path as AWQ's);
    so do the GGUF over two pipeline stages, its two layers in different block types (each slot
    stacked in the wider format), and act-order GPTQ (each stage's own row order); GPTQ's
    act-order cannot split its row-parallel matrices over tensor-parallel shards and says so."""
    results = run_on_virtual_devices(2, "quantized_checkpoints", tiny_model_dir, timeout=900)
    checkpoints = [("gguf", "gguf"), ("gguf-untied", "gguf"), ("awq", "awq"), ("gptq-act-order", "gptq")]
    layouts = {"gguf": ("2x1", "1x2"), "gguf-untied": ("2x1", "1x2"), "awq": ("2x1",), "gptq-act-order": ("1x2",)}
    for name, method in checkpoints:
        one = results[f"{name}:1x1"]
        assert one["quantization"] == method and one["qkv_bytes"][1] == 0
        for layout in layouts[name]:
            many = results[f"{name}:{layout}"]
            assert many["quantization"] == method and many["table_codes"] == name.startswith("gguf")
            assert many["token_ids"] == one["token_ids"], layout
            np.testing.assert_allclose(many["logprobs"], one["logprobs"], rtol=1e-4, atol=1e-4)
            # The fused QKV splits by columns, or its slot's stack by stage: each device holds half.
            assert many["qkv_bytes"][0] == many["qkv_bytes"][1]
        # Tensor-parallel: half of the plain layout's codes and scales of one device (which holds
        # them all, packed for the C++ GEMM or not).
        if name != "gptq-act-order":
            two = results[f"{name}:2x1"]["qkv_bytes"][0]
            assert abs(2 * two - one["qkv_bytes"][0]) <= 0.02 * one["qkv_bytes"][0]
    assert "cannot be split along their input rows" in results["gptq-act-order:2x1"]["error"]
