"""A draft's cheaper weights: proposing among the first token ids only (`draft_vocab_size`: its
LM head's first columns, in every weight format), Q8_0's codes rounded to 6 bits and codes
quantized on load factored or multiplying int8 rows (`factored_draft`); the target's outputs
kept; an int4 draft's groups of DRAFT_INT4_GROUP rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import gemm, native
from jaxllm.models import linear
from jaxllm.quantization import QuantizedWeight
from jaxllm.quantization.activations import with_bf16_activations, with_factored
from jaxllm.quantization.weights import make_weight, relayout
from jaxllm.spec_decode.draft_model import DRAFT_INT4_GROUP, factored_draft
from jaxllm.weights.prepare import PreparedModel

from tests.helpers.int8_rows import int8_rows_reference
from tests.helpers.quantized_checkpoints import write_quantized_gguf
from tests.helpers.tiny_model import TINY_ENGINE_ARGS

needs_native = pytest.mark.skipif(not native.available(), reason="no native CPU kernels")
K, N, CUT = 64, 96, 32


def _six_bit(w: np.ndarray) -> QuantizedWeight:
    """8-bit codes within [-32, 31] (a Q6_K's) in panels, factored: 6-bit blocks where the build has them."""
    scale = np.abs(w).max(0, keepdims=True) / 31
    codes = np.clip(np.rint(w / scale), -32, 31).astype(np.int8)
    plain = QuantizedWeight(codes, scale.astype(np.float32), None, 8, "plain", "float")
    return with_factored(with_bf16_activations(relayout(plain, True)))


WEIGHTS = {
    "float": lambda w: jnp.asarray(w),
    "packed f32": lambda w: linear.PackedWeight(jnp.asarray(gemm.pack_weight(w))),
    "packed bf16": lambda w: linear.PackedWeight(jnp.asarray(gemm.pack_weight(w, dtype=jnp.bfloat16))),
    "int8 plain": lambda w: make_weight(w, "int8_weight_only", panels=False, activations="float"),
    "int4 plain": lambda w: make_weight(w, "int4", panels=False, activations="float"),
    "int8 panels": lambda w: make_weight(w, "int8_weight_only", panels=True, activations="float"),
    "int4 panels": lambda w: make_weight(w, "int4", panels=True, activations="float"),
    "w8a8 panels": lambda w: make_weight(w, "w8a8", panels=True, activations="int8"),
    "int4 x bf16": lambda w: with_bf16_activations(make_weight(w, "int4", panels=True, activations="float")),
    "int4 factored": lambda w: with_factored(
        with_bf16_activations(make_weight(w, "int4", panels=True, activations="float"))
    ),
    "six-bit factored": _six_bit,
}


@needs_native
@pytest.mark.parametrize("kind", WEIGHTS)
def test_first_columns_multiply_as_the_whole_weights_first_outputs(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((3, K)).astype(np.float32))
    whole = WEIGHTS[kind](w)
    cut = linear.first_columns(whole, CUT)
    if isinstance(whole, QuantizedWeight):
        assert cut.shape == (K, CUT) and cut.layout == whole.layout and isinstance(cut.codes, jax.Array)
    expected = np.asarray(linear.apply(whole, x))[:, :CUT]
    np.testing.assert_allclose(np.asarray(linear.apply(cut, x)), expected, rtol=1e-6, atol=1e-6)


def test_first_columns_take_whole_panels():
    with pytest.raises(ValueError, match="whole panels"):
        linear.first_columns(jnp.zeros((4, 32)), 20)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_draft_of_the_first_ids_keeps_the_targets_outputs(llm, tiny_model_dir, quantization):
    """The target drafting for itself (as it is, or in 4 bits), its head cut to the first half
    of the ids (tied: the table stays whole for the lookups): every draft is below the cut, the
    target's tokens past it are never drafted, and the outputs are the target's."""
    prompts = ["Hello, my name is", "The capital of France is", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    config = {"model": tiny_model_dir, "num_speculative_tokens": 3, "draft_vocab_size": 24570}
    engine = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, speculative_config={**config, "quantization": quantization})
    proposer = engine.engine.scheduler.proposer
    head = proposer.runner.params["lm_head"]
    assert proposer.runner.cfg.vocab_size == 24576 == linear.apply(head, jnp.zeros((1, 64))).shape[1]  # whole panels
    drafts, propose = [], proposer.propose_batch

    def recorded(requests, rooms):
        propose(requests, rooms)
        drafts.extend(t for r in requests for t in r.spec_token_ids)

    proposer.propose_batch = recorded
    outs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert outs == reference
    stats = engine.engine.stats
    assert drafts and max(drafts) < 24576 and stats.num_draft_tokens == len(drafts)
    assert any(t >= 24576 for out in reference for t in out)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # (those are never drafted)


def test_draft_vocab_size_is_a_draft_models_positive_count(tiny_model_dir):
    for config, match in (
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 100}, "draft_vocab_size"),
        ({"model": tiny_model_dir, "num_speculative_tokens": 2, "draft_vocab_size": 0}, "draft_vocab_size"),
        ({"model": tiny_model_dir, "num_speculative_tokens": 2, "draft_vocab_size": "1k"}, "draft_vocab_size"),
    ):
        with pytest.raises(ValueError, match=match):
            LLM(tiny_model_dir, **TINY_ENGINE_ARGS, speculative_config=config)


@needs_native
def test_a_drafts_full_byte_codes_are_rounded_to_six_bits_and_factor():
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (K, N)).astype(np.int8)  # Q8_0's range: too wide to factor
    scale = rng.uniform(0.01, 0.02, (K // 32, N)).astype(np.float32)
    w = with_bf16_activations(relayout(QuantizedWeight(codes, scale, None, 8, "plain", "float"), True))
    assert w.activations == "bf16" and not with_factored(w).factored
    model = factored_draft(PreparedModel(None, {"lm_head": w}, {"lm_head": w}))
    rounded = model.small_params["lm_head"]
    assert model.params["lm_head"] is rounded  # (a weight both trees hold: rounded once)
    assert rounded.factored and rounded.bits == (6 if native.has_six_bit_codes() else 8)
    x = rng.standard_normal((2, K)).astype(np.float32)
    dense = np.clip(np.rint(codes / 4), -32, 31) * np.repeat(4 * scale, 32, axis=0)
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    on_avx512 = dataclasses.replace(rounded, path="avx512")  # (AMX's tiles take two rows unfactored)
    np.testing.assert_allclose(np.asarray(linear.apply(on_avx512, jnp.asarray(x))), x16 @ dense, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("lo, hi, div", [(-127, 128, 4), (-64, 64, 2), (-32, 32, 1)])
def test_a_drafts_float_row_codes_multiply_int8_rows_under_int8_activations(lo, hi, div):
    # Under float32 with int8 activations, 8-bit float-row codes (an int4 draft's int8 LM head)
    # go to the 6-bit int8 kernel: Q8_0's full byte divided by 4, codes within [-64, 63] by 2.
    rng = np.random.default_rng(2)
    codes = rng.integers(lo, hi, (K, N)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, (K // 32, N)).astype(np.float32)
    w = relayout(QuantizedWeight(codes, scale, None, 8, "plain", "float"), True)
    rounded = factored_draft(PreparedModel(None, {"lm_head": w}, None), int8=True).params["lm_head"]
    assert (rounded.bits, rounded.activations) == (6, "int8")
    x = rng.standard_normal((3, K)).astype(np.float32)
    dense = np.clip(np.rint(codes / div), -32, 31) * np.repeat(div * scale.astype(np.float64), 32, axis=0)
    want = int8_rows_reference(x, dense, None)
    np.testing.assert_allclose(np.asarray(linear.apply(rounded, jnp.asarray(x))), want, rtol=1e-5, atol=1e-4)
    assert factored_draft(PreparedModel(None, {"lm_head": w}, None)).params["lm_head"].activations == "float"


@needs_native
@pytest.mark.skipif(not native.has_bf16_dots(), reason="no AVX512_BF16 dots here")
def test_a_gguf_draft_factors_its_q8_0_codes_and_keeps_the_outputs(tmp_path):
    # The tiny GGUF (Q8_0 V parts and a Q8_0 tied LM head among its types) drafting for itself
    # under bf16: its small steps (with AMX, its codes alone) factor every code, Q8_0's rounded
    # to 6 bits, and the outputs are the target's without speculation.
    path = write_quantized_gguf(str(tmp_path / "tiny.gguf"))
    args = dict(TINY_ENGINE_ARGS, dtype="bfloat16", params_cache_dir=str(tmp_path / "params"))
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 4 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    reference = [o.outputs[0].token_ids for o in LLM(path, **args).generate(prompts, params, use_tqdm=False)]
    engine = LLM(path, **args, speculative_config={"model": path, "num_speculative_tokens": 3})
    draft = engine.engine.scheduler.proposer.runner
    weights = jax.tree.leaves(
        draft.params if draft.small_params is None else draft.small_params,
        is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )
    codes = [w for w in weights if isinstance(w, QuantizedWeight)]
    assert codes and all(w.factored for w in codes if w.activations == "bf16")
    assert any(w.bits == 6 for w in codes) or not native.has_six_bit_codes()
    outs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert outs == reference and engine.engine.stats.num_accepted_tokens > 0


def alone_and_drafting(model_dir: str, args: dict, config: dict, max_tokens: int):
    """Two prompts, greedy sampling params, the greedy outputs of `model_dir` alone, and an
    engine of it with the speculative `config`: (prompts, params, outputs, engine)."""
    prompts = ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(model_dir, **args).generate(prompts, params, use_tqdm=False)]
    return prompts, params, reference, LLM(model_dir, **args, speculative_config=config)


@needs_native
@pytest.mark.skipif(not native.has_bf16_dots(), reason="no AVX512_BF16 dots here")
def test_an_int4_draft_factors_its_codes_under_bf16_and_keeps_the_outputs(tmp_path, tiny_model_dir):
    # The tiny model drafting for itself quantized on load to int4 under bf16: the draft's 4-bit
    # codes (and its 8-bit LM head, rounded to 6 bits) factor their scales, where the plan alone
    # leaves codes quantized on load unfactored; the outputs are the target's.
    args = dict(TINY_ENGINE_ARGS, dtype="bfloat16", params_cache_dir=str(tmp_path / "params"))
    config = {"model": tiny_model_dir, "num_speculative_tokens": 3, "quantization": "int4"}
    prompts, params, reference, engine = alone_and_drafting(tiny_model_dir, args, config, max_tokens=16)
    leaves = jax.tree.leaves(
        engine.engine.scheduler.proposer.runner.params, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )
    codes = [w for w in leaves if isinstance(w, QuantizedWeight) and w.layout == "panels"]
    assert {w.bits for w in codes} >= {4} and all(w.factored for w in codes if w.activations == "bf16")
    outs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert outs == reference and engine.engine.stats.num_accepted_tokens > 0


def test_an_int4_draft_quantizes_its_layers_in_groups_of_draft_int4_group_rows(tmp_path, tiny_model_dir):
    # The target asked for int4 keeps groups of 32 rows; its draft (the same checkpoint, int4
    # asked in the config) groups DRAFT_INT4_GROUP rows; greedy outputs stay the target's.
    args = dict(TINY_ENGINE_ARGS, quantization="int4", params_cache_dir=str(tmp_path / "params"))
    config = {"model": tiny_model_dir, "num_speculative_tokens": 2, "quantization": "int4"}
    prompts, params, reference, engine = alone_and_drafting(tiny_model_dir, args, config, max_tokens=12)

    def downs(runner):
        return [layer["w_down"] for layer in runner.params["layers"]]

    target, draft = downs(engine.engine.runner), downs(engine.engine.scheduler.proposer.runner)
    assert {w.bits for w in target + draft} == {4}
    assert all(w.groups == w.shape[0] // 32 for w in target)
    assert all(w.groups == w.shape[0] // DRAFT_INT4_GROUP for w in draft) and DRAFT_INT4_GROUP != 32
    outs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert outs == reference and engine.engine.stats.num_accepted_tokens > 0
