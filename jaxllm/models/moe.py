"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, then each token's experts.

Layer params (E experts, F = the expert intermediate size, split over the tensor-parallel
axis like a dense MLP's):

    router:           [hidden, E] f32
    experts_gate_up:  [E, hidden, 2 * F]   (gate, up fused per expert)
    experts_down:     [E, F, hidden]

(with `quantization=`, the two expert stacks are QuantizedWeights: `expert_weights`.)

Routing follows HF: softmax over the router logits in float32, the top k, renormalised to
sum to 1 when `cfg.norm_topk_prob` (Mixtral always; Qwen3-MoE per its config).

Three ways to run the experts, all exact; `expert_impl` picks one per step shape:

- `gather`: each (token, expert) pair's weights gathered and multiplied on their own: reads
  only the chosen experts, T * k of them, so it wins while T * k <= E (decode at small batch);
- `dense`: every expert on every token, weighted by a [T, E] matrix that is zero outside
  each token's top k (E / k times the FLOPs, but plain batched matmuls): the CPU's choice
  beyond that;
- `grouped`: the T * k pairs sorted by expert (`dispatch`), multiplied with
  `jax.lax.ragged_dot` (one group of rows per expert), then weighted and summed back per
  token: a grouped GEMM on GPU; XLA:CPU's ragged_dot was 1.3-4x slower than `dense` at every
  size `benchmarks/models.py` measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.quantization import weights as quant


def expert_impl(num_tokens: int, cfg) -> str:
    """The expert computation for a step of `num_tokens` tokens (static: shapes are)."""
    if jax.default_backend() != "cpu":
        return "grouped"
    return "gather" if num_tokens * cfg.num_experts_per_tok <= cfg.num_experts else "dense"


def route(h: jax.Array, router: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """h [T, hidden] -> (weights [T, k] f32, experts [T, k] int32)."""
    probs = jax.nn.softmax(jnp.dot(h, router, preferred_element_type=jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def dispatch(h: jax.Array, router: jax.Array, cfg):
    """Routing and the sort by expert: -> (rows [T * k, hidden], the token of each row [T * k],
    each row's routing weight [T * k], rows per expert [E] int32). Row p holds one (token,
    expert) pair; the pairs of expert e are rows sum(sizes[:e]) .. sum(sizes[:e + 1]) - 1."""
    weights, experts = route(h, router, cfg)
    flat = experts.reshape(-1)  # [T * k]: pair p is token p // k's choice p % k
    order = jnp.argsort(flat, stable=True)
    token_of = order // cfg.num_experts_per_tok
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    return h[token_of], token_of, weights.reshape(-1)[order], group_sizes


def expert_weights(w, experts: jax.Array | None = None) -> jax.Array:
    """A layer's expert stack [E, K, N] as an array, or the chosen experts' [T, k, K, N]; a
    quantized stack (`quantization=`) is dequantized in the step, only the chosen experts when
    they are given."""
    if isinstance(w, quant.QuantizedWeight):
        if experts is not None:
            w = jax.tree_util.tree_map(lambda a: a[experts], w)
        return quant.dequantize(w)
    return w if experts is None else w[experts]


def moe_mlp(layer, h: jax.Array, cfg, act, impl: str | None = None) -> jax.Array:
    """The experts' weighted sum for h [T, hidden] (normed), before the row-parallel sum;
    `act` is the activation of the gate."""
    impl = impl or expert_impl(h.shape[0], cfg)
    if impl == "gather":
        weights, experts = route(h, layer["router"], cfg)
        gate_up, down = (expert_weights(layer[name], experts) for name in ("experts_gate_up", "experts_down"))
        gate, up = jnp.split(
            jnp.einsum("th,tkhf->tkf", h.astype(gate_up.dtype), gate_up, preferred_element_type=jnp.float32), 2, axis=-1
        )
        y = jnp.einsum("tkf,tkfh->tkh", (act(gate) * up).astype(down.dtype), down, preferred_element_type=jnp.float32)
        return jnp.einsum("tkh,tk->th", y, weights)
    gate_up, down = expert_weights(layer["experts_gate_up"]), expert_weights(layer["experts_down"])
    if impl == "dense":
        weights, experts = route(h, layer["router"], cfg)
        dense_weights = jnp.zeros((h.shape[0], cfg.num_experts), jnp.float32)
        dense_weights = dense_weights.at[jnp.arange(h.shape[0])[:, None], experts].set(weights)
        gate, up = jnp.split(
            jnp.einsum("th,ehf->etf", h.astype(gate_up.dtype), gate_up, preferred_element_type=jnp.float32), 2, axis=-1
        )
        y = jnp.einsum("etf,efh->eth", (act(gate) * up).astype(down.dtype), down, preferred_element_type=jnp.float32)
        return jnp.einsum("eth,te->th", y, dense_weights)
    rows, token_of, row_weights, group_sizes = dispatch(h, layer["router"], cfg)
    gate, up = jnp.split(
        jax.lax.ragged_dot(rows.astype(gate_up.dtype), gate_up, group_sizes, preferred_element_type=jnp.float32),
        2,
        axis=-1,
    )
    y = jax.lax.ragged_dot((act(gate) * up).astype(down.dtype), down, group_sizes, preferred_element_type=jnp.float32)
    return jnp.zeros(h.shape, jnp.float32).at[token_of].add(y * row_weights[:, None])
