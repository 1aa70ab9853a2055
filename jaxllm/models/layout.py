"""The params of `decoder.py` laid out for tensor and pipeline parallelism (jaxllm/parallel.py
runs them under `shard_map`).

Tensor parallelism (Megatron layout): `TP_SPLIT_DIMS` says which dimension of each parameter
is split over the "model" mesh axis (column-parallel wqkv, w_gate_up / w_up and the experts'
gate/up, row-parallel wo, w_down and the experts' down, vocabulary-parallel embed and lm_head;
the rest replicated, output biases included: they are added once, after the sum). `tp_layout`
regroups the fused columns so that each shard's slice holds its own heads' q, k, v (and its
gate, up), with KV heads repeated when there are fewer than shards. Each shard then runs the
decoder with `tp_local_config`'s head counts.

Pipeline parallelism: `shard_layout` also stacks the layers of each of `pp` stages (layer slot
i of every stage in one `[pp, ...]` array, split over the "stage" axis); each stage's shards
run `decoder_layer` on their slots (parallel.py, `pipelined_forward`), with the vocabulary split
over stages and shards together. Slot i must then be the same kind of layer in every stage
(window, RoPE base, MoE or dense), which `check_pipeline_parallel` checks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxllm.models.decoder import ModelConfig, layer_kind
from jaxllm.quantization.sharding import stack_stages
from jaxllm.quantization.weights import QuantizedWeight, permute_columns

# Which dimension of each parameter (by name, in a layer or at the top) is split over the
# tensor-parallel axis; parameters not listed are replicated.
TP_SPLIT_DIMS = {
    "embed": 0,
    "lm_head": 1,
    "wqkv": 1,
    "bqkv": 0,
    "wo": 0,
    "w_gate_up": 1,
    "b_gate_up": 0,
    "w_up": 1,
    "b_up": 0,
    "w_down": 0,
    "experts_gate_up": 2,
    "experts_down": 1,
}


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError if `cfg` cannot be split `tp` ways."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor of {tp})")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if cfg.moe_intermediate_size % tp:
        problems.append(f"expert intermediate size {cfg.moe_intermediate_size}")
    if cfg.vocab_size % tp:
        problems.append(f"vocabulary size {cfg.vocab_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide this model's " + ", ".join(problems))


def kv_heads_for(cfg: ModelConfig, tp: int) -> int:
    """KV heads stored over all shards: the model's, or `tp` when it has fewer (each shard then
    holds a copy of the one head its query heads use)."""
    return max(cfg.num_kv_heads, tp)


def tp_local_config(cfg: ModelConfig, tp: int, pp: int = 1) -> ModelConfig:
    """The model config one shard computes with (`pp` > 1: one pipeline stage's shard, with its layer
    slots and its slice of the vocabulary, which is split over stages and shards together)."""
    per_stage = cfg.num_layers // pp
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=kv_heads_for(cfg, tp) // tp,
        intermediate_size=cfg.intermediate_size // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        vocab_size=cfg.vocab_size // (tp * pp),
        num_layers=per_stage,
        layer_windows=cfg.layer_windows[:per_stage],
        moe_layers=tuple(i for i in cfg.moe_layers if i < per_stage),
    )


def tp_layout(params, cfg: ModelConfig, tp: int):
    """`params` with the fused columns regrouped per shard (see the module docstring), as host
    (numpy) arrays; any `tp` passing `check_tensor_parallel`. tp 1 returns `params` unchanged."""
    if tp == 1:
        return params
    check_tensor_parallel(cfg, tp)
    repeat = kv_heads_for(cfg, tp) // cfg.num_kv_heads
    hd = cfg.head_dim

    def qkv_columns(w):  # [..., (q + 2 kv) * hd] -> the same, grouped [q_s, k_s, v_s] per shard
        q, k, v = np.split(w, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        k, v = (
            np.repeat(t.reshape(*t.shape[:-1], cfg.num_kv_heads, hd), repeat, axis=-2).reshape(*t.shape[:-1], -1)
            for t in (k, v)
        )
        return _interleave([q, k, v], tp)

    def gate_up_columns(w):
        return _interleave(np.split(np.asarray(w), 2, axis=-1), tp)

    def regroup(w, columns):
        if isinstance(w, QuantizedWeight):  # a checkpoint's quantized matrix: the same columns
            return permute_columns(w, columns(np.arange(w.shape[1])))
        return columns(w)

    def layer_layout(layer):
        out = dict(layer)
        for name in ("wqkv", "bqkv"):
            if name in layer:
                out[name] = regroup(layer[name], qkv_columns)
        for name in ("w_gate_up", "b_gate_up", "experts_gate_up"):
            if name in layer:
                out[name] = regroup(layer[name], gate_up_columns)
        return out

    return {**params, "layers": [layer_layout(layer) for layer in params["layers"]]}


def check_pipeline_parallel(cfg: ModelConfig, tp: int, pp: int) -> None:
    """Raise ValueError if `cfg` cannot be split into `pp` stages of `tp` shards."""
    problems = []
    if cfg.num_layers % pp:
        problems.append(f"{cfg.num_layers} layers")
    elif any(layer_kind(cfg, i) != layer_kind(cfg, i % (cfg.num_layers // pp)) for i in range(cfg.num_layers)):
        problems.append(
            "layer pattern (each stage must hold the same sequence of windowed, global, dense and MoE layers)"
        )
    if cfg.vocab_size % (tp * pp):
        problems.append(f"vocabulary size {cfg.vocab_size} (split over tensor x pipeline = {tp * pp} devices)")
    if problems:
        raise ValueError(f"pipeline_parallel_size={pp} does not divide this model's " + ", ".join(problems))


def shard_layout(params, cfg: ModelConfig, tp: int = 1, pp: int = 1):
    """`params` laid out for `tp` tensor-parallel shards (`tp_layout`) and `pp` pipeline stages:
    with pp > 1, "layers" becomes a list of the `num_layers // pp` layer slots of a stage, each
    array stacked `[pp, ...]` over the stages (stage s, slot i = layer s * num_layers // pp + i),
    so that the "stage" mesh axis splits the stacked dimension. Host (numpy) arrays."""
    params = tp_layout(params, cfg, tp)
    if pp == 1:
        return params
    check_pipeline_parallel(cfg, tp, pp)
    per_stage = cfg.num_layers // pp
    layers = params["layers"]

    def stack(i, name):
        parts = [layers[s * per_stage + i][name] for s in range(pp)]
        if any(isinstance(p, QuantizedWeight) for p in parts):  # a checkpoint's quantized matrices
            return stack_stages(parts, f"{name} of layers {[s * per_stage + i for s in range(pp)]}")
        return np.stack([np.asarray(p) for p in parts])

    return {**params, "layers": [{name: stack(i, name) for name in layers[i]} for i in range(per_stage)]}


# The layer arrays `tp_layout` regroups over tensor-parallel shards.
REGROUPED = ("wqkv", "bqkv", "w_gate_up", "b_gate_up", "experts_gate_up")


def canonical_layout(params, cfg: ModelConfig, tp: int = 1, pp: int = 1, xp=jnp):
    """The inverse of `shard_layout`: decoder.py's own params from their layout for `tp`
    shards and `pp` stages (float arrays; `xp` numpy for host arrays, jnp under `jax.eval_shape`).
    Only the stacked and regrouped arrays change; tp 1 and pp 1 return `params` unchanged."""
    layers = params["layers"]
    if pp > 1:  # slot i of stage s is layer s * per_stage + i
        layers = [{name: x[s] for name, x in layers[i].items()} for s in range(pp) for i in range(len(layers))]
    if tp > 1:
        layers = [_untp_layer(layer, cfg, tp, xp) for layer in layers]
    return params if layers is params["layers"] else {**params, "layers": layers}


def _untp_layer(layer: dict, cfg: ModelConfig, tp: int, xp) -> dict:
    """One layer's fused columns back from their per-shard groups (`tp_layout`)."""
    repeat = kv_heads_for(cfg, tp) // cfg.num_kv_heads
    q_s, kv_s = cfg.q_size // tp, cfg.kv_size * repeat // tp

    def qkv_columns(w):  # per shard [q_s, k_s, v_s] -> [q, k, v], the repeated KV heads dropped
        shards = w.reshape(*w.shape[:-1], tp, q_s + 2 * kv_s)
        q = shards[..., :q_s].reshape(*w.shape[:-1], -1)
        k, v = (
            shards[..., lo : lo + kv_s]
            .reshape(*w.shape[:-1], cfg.num_kv_heads, repeat, cfg.head_dim)[..., 0, :]
            .reshape(*w.shape[:-1], -1)
            for lo in (q_s, q_s + kv_s)
        )
        return xp.concatenate([q, k, v], axis=-1)

    def gate_up_columns(w):  # per shard [gate_s, up_s] -> [gate, up]
        shards = w.reshape(*w.shape[:-1], tp, 2, -1)
        return xp.concatenate(
            [shards[..., 0, :].reshape(*w.shape[:-1], -1), shards[..., 1, :].reshape(*w.shape[:-1], -1)], axis=-1
        )

    out = dict(layer)
    for name in REGROUPED:
        if name in layer:
            out[name] = (qkv_columns if name in ("wqkv", "bqkv") else gate_up_columns)(layer[name])
    return out


def _interleave(parts, tp: int):
    """Concatenate, along the last axis, shard s's slice of every part, for s in order."""
    chunks = [np.split(np.asarray(part), tp, axis=-1) for part in parts]
    return np.concatenate([chunk[s] for s in range(tp) for chunk in chunks], axis=-1)
