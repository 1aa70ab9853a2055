"""W8A8's activation smoothing (quantization/smoothing.py) and the calibration run that feeds
it (weights/calibration.py): the maxima against HF transformers' own activations, the smoothed
float model against HF's logits for each family (smoothing must not change the function), and
the point of it: W8A8 on an input with an outlier channel, against the exact product."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.models import decoder, training
from jaxllm.weights import calibration
from jaxllm.models.loader import load_model
from jaxllm.quantization import smoothing
from jaxllm.quantization.weights import make_weight, matmul

from tests.helpers.hf_reference import build_hf_model

torch = pytest.importorskip("torch")

IDS = [int(t) for t in np.random.default_rng(0).integers(3, 200, size=23)]


def test_factors_by_hand():
    # sqrt(4 / 1) = 2; a channel with no activation or no weight keeps 1; the clip at 1e3.
    s = smoothing.factors(np.array([4.0, 0.0, 1.0, 1e8]), np.array([1.0, 2.0, 0.0, 1e-2]), alpha=0.5)
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0, 1e3])
    # alpha 0.75: 16 ** 0.75 / 2 ** 0.25
    np.testing.assert_allclose(
        smoothing.factors(np.array([16.0]), np.array([2.0]), alpha=0.75), [8 / 2**0.25], rtol=1e-6
    )


def test_activation_maxima_match_hf_activations(tmp_path):
    model = build_hf_model("qwen2", tmp_path / "m")  # GQA, QKV bias
    seen = {}

    def hook(key):
        def record(module, args):
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).numpy()
            seen[key] = np.maximum(seen[key], m) if key in seen else m

        return record

    for i, layer in enumerate(model.model.layers):
        for module, name in (
            (layer.self_attn.q_proj, "wqkv"),
            (layer.self_attn.o_proj, "wo"),
            (layer.mlp.gate_proj, "w_gate_up"),
            (layer.mlp.down_proj, "w_down"),
        ):
            module.register_forward_pre_hook(hook((i, name)))
    windows = [IDS, IDS[:9]]
    with torch.no_grad():
        for ids in windows:
            model(torch.tensor([ids]))
    loaded = load_model(str(tmp_path / "m"), dtype="float32", cache_dir=str(tmp_path / "cache"))
    ours = calibration.activation_maxima(loaded.params, loaded.cfg, windows)
    assert set(ours) == set(seen)
    for key in seen:
        np.testing.assert_allclose(ours[key], seen[key], rtol=1e-4, atol=1e-5, err_msg=str(key))


def dense_logits(params, cfg, ids):
    """Logits [T, vocab] of one sequence through the decoder on calibration's dense attention."""
    import jax.numpy as jnp

    from jaxllm.models.step_inputs import StepInputs

    n = len(ids)
    pos = np.arange(n, dtype=np.int32)
    cos, sin = decoder.rope_tables(pos, cfg.inv_freq(), np)
    inputs = StepInputs(
        token_ids=np.asarray(ids, np.int32),
        positions=pos,
        slot_mapping=pos,
        page_tables=np.zeros((1, 1), np.int32),
        query_start_loc=np.asarray([0, n], np.int32),
        seq_lens=np.asarray([n], np.int32),
        num_seqs=np.asarray(1, np.int32),
        logits_indices=pos,
        rope_cos=cos,
        rope_sin=sin,
        attn_metadata={},
    )
    cache = [(None, None)] * cfg.num_layers
    hidden, _ = decoder.forward(params, cache, inputs, cfg, attention=training.DENSE_ATTENTION)
    return np.asarray(decoder.compute_logits(params, jnp.asarray(hidden), cfg))


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2", "gemma3", "gpt_neox", "falcon", "falcon_new", "qwen3_moe"])
def test_smoothing_leaves_the_float_model_as_it_was(kind, tmp_path):
    # Folding 1/s into norms, up columns and V columns and s into the matrices' rows is exact in
    # real arithmetic: the smoothed float model must still give HF's logits.
    model = build_hf_model(kind, tmp_path / "m")
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float().numpy()
    loaded = load_model(str(tmp_path / "m"), dtype="float32", cache_dir=str(tmp_path / "cache"))
    params, cfg = loaded.params, loaded.cfg
    maxima = calibration.activation_maxima(params, cfg, [IDS])
    before = {k: np.asarray(v).copy() for k, v in params["layers"][-1].items() if not isinstance(v, dict)}
    smoothing.smooth(params, cfg, maxima)
    changed = [k for k, v in params["layers"][-1].items() if k in before and not np.array_equal(before[k], v)]
    assert "attn_norm" in changed and "wqkv" in changed, changed  # something was folded
    np.testing.assert_allclose(dense_logits(params, cfg, IDS), want, atol=2e-4, rtol=1e-4)


def test_smoothing_recovers_w8a8_on_an_outlier_channel():
    # Normed activations with one channel 60x the others (as real models have), random weights:
    # per-token int8 codes flatten the small channels; after smoothing the error is far smaller.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[:, 7] *= 60.0
    w = (rng.standard_normal((256, 96)) * 0.05).astype(np.float32)
    exact = x.astype(np.float64) @ w

    def error(x, w):
        out = np.asarray(matmul(x, make_weight(w, "w8a8", panels=False, activations="int8")))
        return np.abs(out - exact).max() / np.abs(exact).max()

    plain = error(x, w)
    for alpha in (0.5, smoothing.ALPHA):
        s = smoothing.factors(np.abs(x).max(axis=0), np.abs(w).max(axis=1), alpha)
        smoothed = error(x / s, w * s[:, None])
        assert smoothed < plain / 2 and smoothed < 0.02, (alpha, plain, smoothed)
