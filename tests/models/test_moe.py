"""jaxllm/models/moe.py: each way of running the experts (gather, dense, grouped) against a
NumPy loop over tokens and their top-k experts, and the choice the engine makes per shape.
(Whole MoE models against HF transformers: tests/models/test_models.py, tests/models/test_model_families.py.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxllm.models import moe


@dataclasses.dataclass(frozen=True)
class Config:
    num_experts: int = 6
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True


def silu(x):
    return x / (1 + np.exp(-x))


def numpy_moe(layer, h, cfg):
    """Per token: softmax over the router logits, the k largest, renormalised if asked, and
    the weighted sum of those experts' SiLU-gated MLPs."""
    out = np.zeros_like(h)
    for t, x in enumerate(h):
        logits = x @ layer["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[: cfg.num_experts_per_tok]
        weights = probs[top] / (probs[top].sum() if cfg.norm_topk_prob else 1.0)
        for e, w in zip(top, weights):
            gate, up = np.split(x @ layer["experts_gate_up"][e], 2)
            out[t] += w * ((silu(gate) * up) @ layer["experts_down"][e])
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("impl", ["gather", "dense", "grouped"])
def test_each_expert_impl_matches_a_loop_over_tokens(impl, num_tokens, norm_topk_prob):
    cfg = Config(norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(num_tokens)
    hidden, ff = 16, 8
    layer = {
        "router": rng.standard_normal((hidden, cfg.num_experts)).astype(np.float32),
        "experts_gate_up": rng.standard_normal((cfg.num_experts, hidden, 2 * ff)).astype(np.float32) / 4,
        "experts_down": rng.standard_normal((cfg.num_experts, ff, hidden)).astype(np.float32) / 3,
    }
    h = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    got = jax.jit(lambda layer, h: moe.moe_mlp(layer, h, cfg, jax.nn.silu, impl))(layer, h)
    np.testing.assert_allclose(np.asarray(got), numpy_moe(layer, h, cfg), rtol=1e-4, atol=1e-5)


def test_cpu_gathers_the_chosen_experts_only_while_they_are_fewer_than_all():
    cfg = Config(num_experts=16, num_experts_per_tok=4)
    assert jax.default_backend() == "cpu"
    assert [moe.expert_impl(t, cfg) for t in (1, 4, 5, 256)] == ["gather", "gather", "dense", "dense"]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("impl", ["gather", "dense", "grouped"])
def test_quantized_experts_compute_with_their_quantized_values(impl, method):
    # `quantization=` stores the expert stacks as codes and scales (each expert's matrix
    # quantized on its own); every impl then gives the NumPy loop over the experts' quantized values.
    from jaxllm.quantization import METHODS
    from jaxllm.quantization.sharding import make_sharded_weight
    from tests.helpers.quantized_checkpoints import reference_weight

    cfg = Config()
    rng = np.random.default_rng(7)
    hidden, ff = 64, 32  # 4-bit groups of 32 rows
    layer = {
        "router": rng.standard_normal((hidden, cfg.num_experts)).astype(np.float32),
        "experts_gate_up": rng.standard_normal((cfg.num_experts, hidden, 2 * ff)).astype(np.float32) / 8,
        "experts_down": rng.standard_normal((cfg.num_experts, ff, hidden)).astype(np.float32) / 6,
    }
    h = rng.standard_normal((5, hidden)).astype(np.float32)
    bits, group = METHODS[method]
    names = ("experts_gate_up", "experts_down")
    quantized = {**layer, **{n: make_sharded_weight(layer[n], method, "float") for n in names}}
    values = {**layer, **{n: np.stack([reference_weight(w, bits, group) for w in layer[n]]) for n in names}}
    got = np.asarray(jax.jit(lambda layer, h: moe.moe_mlp(layer, h, cfg, jax.nn.silu, impl))(quantized, h))
    np.testing.assert_allclose(got, numpy_moe(values, h, cfg), rtol=1e-4, atol=1e-5)
    assert np.abs(got - numpy_moe(layer, h, cfg)).max() > 1e-4  # the codes, not the float weights
