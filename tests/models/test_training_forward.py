"""models/training.py: the trainer's forward over the engine's params tree.

Against HF transformers (float32, eager attention) on a tiny random model of every family:
the logits, and the gradients of a mean token logprob (torch autograd; and a central finite
difference on one weight). Against the engine: the logprobs it reports for the tokens it
generates, greedy and sampled, over a chunked prompt and a prefix-cached one.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxllm import LLM, SamplingParams
from jaxllm.models import training
from jaxllm.models.linear import PackedWeight
from jaxllm.models.loader import load_model
from jaxllm.quantization.weights import make_weight

from tests.helpers.hf_reference import COMMON, MODELS, build_hf_model
from tests.helpers.tiny_model import TINY_ENGINE_ARGS

torch = pytest.importorskip("torch")

# Logits against HF float32: the tolerance tests/models/test_models.py holds the paged engine
# to. Both sides compute in float32 in different summation orders; measured max |diff| 1e-6 to
# 7e-6 over these families (logits up to ~7), so 1e-4 leaves room for other BLAS builds while a
# wrong mask, RoPE table or norm shows as differences of 0.1 and more.
F32_TOL = 1e-4
BATCH, SEQ_LEN = 3, 11  # longer than the windowed families' window of 6

forward = jax.jit(training.forward, static_argnames="cfg")
token_logprobs = jax.jit(training.token_logprobs, static_argnames=("cfg", "temperature"))


def _hf_pair(kind, path):
    hf = build_hf_model(kind, path)
    hf.set_attn_implementation("eager")
    return hf, load_model(str(path), dtype="float32", use_cache=False, progress=False)


def _random_ids(shape, vocab=COMMON["vocab_size"], seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_match_hf_float32(kind, tmp_path):
    hf, loaded = _hf_pair(kind, tmp_path)
    cfg = loaded.cfg
    assert all(w < SEQ_LEN for w in cfg.layer_windows), "a window the sequences do not exceed checks nothing"
    token_ids = _random_ids((BATCH, SEQ_LEN))
    with torch.no_grad():
        want = hf(torch.tensor(token_ids)).logits.float().numpy()
    got = np.asarray(forward(loaded.params, token_ids, cfg))
    assert got.shape == (BATCH, SEQ_LEN, cfg.vocab_size) and got.dtype == np.float32
    diff = float(np.abs(got - want).max())
    assert diff <= F32_TOL, f"{kind}: max |logit diff| {diff:.2e}"
    # One sequence alone ([T]) is the batch's row.
    np.testing.assert_allclose(np.asarray(forward(loaded.params, token_ids[1], cfg)), got[1], atol=F32_TOL, rtol=0)


def test_logprobs_with_temperature_and_of_a_completion(tmp_path):
    hf, loaded = _hf_pair("llama3_rope", tmp_path)
    token_ids = _random_ids((2, SEQ_LEN), seed=1)
    with torch.no_grad():
        logits = hf(torch.tensor(token_ids)).logits.double().numpy()[:, :-1]
    targets = token_ids[:, 1:, None]
    for temperature in (None, 0.7):
        scaled = logits / (temperature or 1.0)
        log_z = np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1)) + scaled.max(-1)
        want = np.take_along_axis(scaled, targets, -1)[..., 0] - log_z
        got = token_logprobs(loaded.params, token_ids, loaded.cfg, temperature=temperature)
        np.testing.assert_allclose(np.asarray(got), want, atol=F32_TOL, rtol=0)
    prompt, completion = token_ids[:, :4], token_ids[:, 4:]
    tail = jax.jit(training.sequence_logprobs, static_argnames="cfg")(loaded.params, prompt, completion, loaded.cfg)
    assert tail.shape == completion.shape
    whole = token_logprobs(loaded.params, token_ids, loaded.cfg)
    np.testing.assert_allclose(np.asarray(tail), np.asarray(whole)[:, 3:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        training.token_logprobs(loaded.params, token_ids, loaded.cfg, temperature=0.0)


@pytest.mark.parametrize("kind", ["llama3_rope", "opt"])  # RoPE, learned position rows
def test_positions_are_hf_position_ids(kind, tmp_path):
    hf, loaded = _hf_pair(kind, tmp_path)
    token_ids = _random_ids((2, SEQ_LEN), seed=3)
    positions = np.stack([np.arange(SEQ_LEN) + 5, np.arange(SEQ_LEN) * 2]).astype(np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(token_ids), position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
    got = np.asarray(forward(loaded.params, token_ids, loaded.cfg, positions))
    np.testing.assert_allclose(got, want, atol=F32_TOL, rtol=0)


# --------------------------------------------------------------------------- gradients


def _hf_grads_as_params(hf, cfg) -> dict:
    """The HF model's .grad laid out as the params tree of a Gemma 3 (`checkpoint._llama_layer`:
    matrices [in, out], q/k/v and gate/up fused; `1 + w` norms have w's gradient)."""

    def g(module):
        return module.weight.grad.double().numpy()

    model = hf.model
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            {
                "attn_norm": g(layer.input_layernorm),
                "wqkv": np.concatenate([g(attn.q_proj), g(attn.k_proj), g(attn.v_proj)]).T,
                "q_norm": g(attn.q_norm),
                "k_norm": g(attn.k_norm),
                "wo": g(attn.o_proj).T,
                "post_attn_norm": g(layer.post_attention_layernorm),
                "mlp_norm": g(layer.pre_feedforward_layernorm),
                "w_gate_up": np.concatenate([g(mlp.gate_proj), g(mlp.up_proj)]).T,
                "w_down": g(mlp.down_proj).T,
                "post_mlp_norm": g(layer.post_feedforward_layernorm),
            }
        )
    return {"embed": g(model.embed_tokens), "final_norm": g(model.norm), "lm_head": g(hf.lm_head).T, "layers": layers}


def test_grad_matches_torch_autograd_and_a_finite_difference(tmp_path):
    """Gemma 3 (sliding window, sandwich and QK norms, scaled embeddings, two RoPE tables): the
    gradient of the mean token logprob with respect to every leaf, against torch's."""
    hf, loaded = _hf_pair("gemma3", tmp_path)
    params, cfg = loaded.params, loaded.cfg
    token_ids = _random_ids((2, SEQ_LEN), seed=2)

    def loss(params):
        return training.token_logprobs(params, token_ids, cfg).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))

    ids = torch.tensor(token_ids, dtype=torch.long)
    logprobs = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1)
    hf_loss = logprobs.gather(-1, ids[:, 1:, None]).mean()
    hf_loss.backward()
    assert abs(float(value) - float(hf_loss.detach())) <= F32_TOL
    want = _hf_grads_as_params(hf, cfg)
    assert jax.tree.structure(want) == jax.tree.structure(params)
    for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        # Relative to the leaf's largest entry: float32 sums in two orders (measured <= 3e-6).
        scale = np.abs(expected).max()
        assert scale > 0, f"{jax.tree_util.keystr(path)}: no gradient reaches it"
        err = float(np.abs(np.asarray(got) - expected).max() / scale)
        assert err <= 1e-4, f"{jax.tree_util.keystr(path)}: max |grad diff| / max |grad| {err:.2e}"

    # A central difference on the query weight with the largest gradient (~0.6). The loss (~-5.5)
    # rounds to ~5e-7, which costs ~5e-7 / (2 * eps) of the difference, and the curvature
    # O(eps^2): measured 3e-4 relative at eps 1e-3 (1.3e-2 at 1e-2).
    wqkv = params["layers"][0]["wqkv"]
    i, j = np.unravel_index(int(jnp.argmax(jnp.abs(grads["layers"][0]["wqkv"]))), wqkv.shape)
    eps = 1e-3

    loss_jit = jax.jit(loss)

    def loss_at(delta):
        layers = [dict(layer) for layer in params["layers"]]
        layers[0]["wqkv"] = wqkv.at[i, j].add(delta)
        return float(loss_jit({**params, "layers": layers}))

    finite_difference = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    np.testing.assert_allclose(finite_difference, float(grads["layers"][0]["wqkv"][i, j]), rtol=2e-3)


def test_packed_and_quantized_leaves_are_refused_by_path(tmp_path):
    _, loaded = _hf_pair("llama3_rope", tmp_path)
    params, cfg = loaded.params, loaded.cfg
    wo = params["layers"][1]["wo"]
    for weight in (
        PackedWeight(panels=wo),  # any array will do: the check comes before any product
        make_weight(np.asarray(wo), "int8_weight_only", panels=False, activations="float"),
    ):
        layers = [dict(layer) for layer in params["layers"]]
        layers[1]["wo"] = weight
        with pytest.raises(TypeError, match=r"params\['layers'\]\[1\]\['wo'\] is a " + type(weight).__name__):
            training.forward({**params, "layers": layers}, _random_ids(SEQ_LEN), cfg)


# --------------------------------------------------------------------------- against the engine

# Engine logprobs against token_logprobs: the same numbers computed in float32 in different
# orders (the engine: C++ GEMMs and attention over pages, padded buckets, chunks; here XLA's dots
# over the whole sequence), on a model whose residual stream reaches ~57 (init range 0.3) and
# whose logits ~13. That is the float32 noise floor, not a difference in the math: measured max
# |diff| 2.7e-5 over 14 sequences of 5-73 prompt tokens and 12 generated ones, with the engine
# up to 3.3e-5 and token_logprobs up to 2.5e-5 from the same model run by HF in float64 (HF's
# own float32 forward: up to 1e-5; its hidden states and logits as far off as ours). 1e-5 would
# fail on that noise; a misaligned token, a temperature applied or a wrong mask is 1e-2 or more.
ENGINE_TOL = 5e-5
MAX_BATCHED = 32  # the long prompt runs in chunks of at most this many tokens
PROMPT_LENS = (5, 9, 70)


@pytest.fixture(scope="module")
def engine_and_params(tiny_model_dir, tmp_path_factory):
    # float32 pages: "auto" gives them here too, as dtype float32 is asked for (where dtype "auto"
    # picks float32 it gives bf16 pages, which round every cached key and value: up to 0.07 off).
    llm = LLM(
        tiny_model_dir,
        **{**TINY_ENGINE_ARGS, "max_num_batched_tokens": MAX_BATCHED},
        kv_cache_dtype="float32",
        params_cache_dir=str(tmp_path_factory.mktemp("params")),
    )
    assert llm.engine.config.cache.dtype == "float32"
    loaded = load_model(tiny_model_dir, dtype="float32", use_cache=False, progress=False)
    return llm, loaded


def _check_reported_logprobs(out, loaded, temperature=None) -> None:
    """Every generated token's reported logprob is token_logprobs' over prompt + completion."""
    prompt, completion = out.prompt_token_ids, out.outputs[0].token_ids
    reported = np.array([entry[token].logprob for entry, token in zip(out.outputs[0].logprobs, completion)])
    ids = jnp.array(prompt + completion)
    ours = np.asarray(token_logprobs(loaded.params, ids, loaded.cfg, temperature=temperature))[len(prompt) - 1 :]
    assert reported.shape == ours.shape == (len(completion),)
    diff = float(np.abs(reported - ours).max())
    assert diff <= ENGINE_TOL, f"prompt of {len(prompt)}: max |logprob diff| {diff:.2e}"


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0, logprobs=0), dict(temperature=0.8, seed=7, logprobs=1)],
    ids=["greedy", "sampled"],
)
def test_engine_logprobs_equal_token_logprobs(engine_and_params, sampling):
    llm, loaded = engine_and_params
    assert max(PROMPT_LENS) > MAX_BATCHED  # chunked prefill
    prompts = [_random_ids(n, loaded.cfg.vocab_size, seed=n).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False, **sampling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out in outs:
        _check_reported_logprobs(out, loaded)
    if sampling["temperature"]:  # the draws left the argmax somewhere
        completion = outs[0].outputs[0].token_ids
        logits = np.asarray(forward(loaded.params, jnp.array(prompts[0] + completion), loaded.cfg))
        assert (logits[len(prompts[0]) - 1 : -1].argmax(-1) != completion).any()


def test_engine_logprobs_after_a_prefix_cache_hit(engine_and_params):
    llm, loaded = engine_and_params
    prompt = _random_ids(80, loaded.cfg.vocab_size, seed=80).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=1, logprobs=0, ignore_eos=True, detokenize=False)
    first, second = (llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64  # 4 pages of 16
    for out in (first, second):
        _check_reported_logprobs(out, loaded)


def test_processed_logprobs_equal_token_logprobs_after_temperature(tiny_model_dir, engine_and_params):
    """logprobs_mode="processed_logprobs": the distribution sampled from, i.e. token_logprobs
    with the request's temperature (no top-k/top-p here, which would truncate it further)."""
    _, loaded = engine_and_params
    llm = LLM(
        tiny_model_dir,
        **{**TINY_ENGINE_ARGS, "max_num_batched_tokens": MAX_BATCHED},
        kv_cache_dtype="float32",
        logprobs_mode="processed_logprobs",
    )
    prompts = [_random_ids(n, loaded.cfg.vocab_size, seed=n).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=12, temperature=0.6, seed=3, logprobs=0, ignore_eos=True, detokenize=False)
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        _check_reported_logprobs(out, loaded, temperature=0.6)


def test_engine_logprobs_through_preemption(tiny_model_dir, engine_and_params):
    """A pool too small for the batch: requests are preempted and recomputed, and every
    reported logprob still equals token_logprobs'."""
    _, loaded = engine_and_params
    llm = LLM(
        tiny_model_dir,
        **{**TINY_ENGINE_ARGS, "kv_cache_memory": None, "num_gpu_blocks_override": 12},
        kv_cache_dtype="float32",
    )
    prompts = [_random_ids(40 + 7 * i, loaded.cfg.vocab_size, seed=100 + i).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, logprobs=0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for out in outs:
        _check_reported_logprobs(out, loaded)


# bf16 engine against the trainer's forward over the engine's own bf16 weights: both multiply in
# bf16 with f32 sums, but the engine's KV pages hold every key and value rounded to bf16 (the
# forward keeps them in f32) and its GEMMs sum in another order. Measured up to 0.11 on this
# model (logits up to ~13; the Xeon with AMX); the bound leaves room for the other CPU kinds'
# GEMM paths.
BF16_ENGINE_TOL = 0.25


def test_bf16_engine_logprobs_within_the_stated_bound(tiny_model_dir):
    llm = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "dtype": "bfloat16"})
    params = llm.engine.get_weights()
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params) if x.ndim == 2)
    cfg = llm.engine.cfg
    prompts = [_random_ids(n, cfg.vocab_size, seed=n).tolist() for n in PROMPT_LENS]
    sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=2, logprobs=0, ignore_eos=True, detokenize=False)
    worst = 0.0
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False):
        completion = out.outputs[0].token_ids
        reported = np.array([e[t].logprob for e, t in zip(out.outputs[0].logprobs, completion)])
        ids = jnp.array(out.prompt_token_ids + completion)
        ours = np.asarray(token_logprobs(params, ids, cfg))[len(out.prompt_token_ids) - 1 :]
        worst = max(worst, float(np.abs(reported - ours).max()))
    print(f"bf16 engine vs token_logprobs: max |diff| {worst:.3g}")
    assert worst <= BF16_ENGINE_TOL, worst
