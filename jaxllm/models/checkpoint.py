"""What the checkpoint formats share: the one converter `build_params` from weights in HF
names and layout (`Linear` weights `[out, in]`) to the params pytree of `decoder.py`, the shape
check and progress bar used while reading, and `ModelNotFoundError`.

`hf_checkpoint.py` reads an HF directory and `gguf_checkpoint.py` a GGUF file; both hand their
tensors to `build_params` under HF names, so each family's names and fused layouts are written
once, here: `_llama_layer` (Llama, Mistral, Qwen2/3, Phi-3, Gemma 3, Mixtral, Qwen3-MoE),
`_opt_layer`, `_gpt_neox_layer` and `_falcon_layer`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxllm.models.decoder import ModelConfig
from jaxllm.quantization.checkpoint import QuantizedRows, concat_rows, dense, permute_rows

# Stored `[out, in]` (experts `[E, out, in]`) by HF, `[in, out]` here, in the weight dtype.
_MATRICES = ("wqkv", "wo", "w_gate_up", "w_up", "w_down", "lm_head", "experts_gate_up", "experts_down")
_WEIGHT_DTYPE = ("embed", "pos_embed", *_MATRICES)
# The matrices a checkpoint's quantized weights stay quantized in (the others are dequantized).
_QUANTIZED_MATRICES = ("wqkv", "wo", "w_gate_up", "w_up", "w_down", "lm_head")


class ModelNotFoundError(FileNotFoundError):
    """The model path, hub id or default model package could not be found."""


def build_params(get: Callable[[str, tuple], Any], has: Callable[[str], bool], cfg: ModelConfig, dtype: str) -> dict:
    """Fuse weights given in HF names and layout into the decoder.py params pytree.

    get(name, shape) returns the tensor (numpy, or a jax array on the CPU) checked to have
    `shape`; HF `Linear` weights are `[out, in]`, or a quantized checkpoint's `QuantizedRows`,
    which stay quantized in the layer matrices, the LM head and the embedding table (stored as
    an LM head `[hidden, vocab]`, tied or not: `QuantizedWeight.embedding_rows` looks its rows
    up) and are dequantized elsewhere. has(name) says whether the checkpoint holds
    `name`. Fusing happens in numpy, and each result is put on the default device once.
    """
    read = _Reader(get, has, cfg)
    if cfg.architecture == "BertModel":
        return _bert_params(read, cfg, jnp.dtype(dtype))
    layer_fn, prefix, embed, final_norm, lm_head = _FAMILIES.get(cfg.architecture, _FAMILIES["llama"])
    h = cfg.hidden_size
    top = {"embed": read.tensor(embed + ".weight", (cfg.vocab_size, h))}
    read.norm(top, "final_norm", final_norm, bias=cfg.norm == "layer", plus_one=cfg.architecture == "Gemma3ForCausalLM")
    if cfg.position == "learned":  # OPT: 2 extra rows first (position p is row p + 2)
        pos = dense(read.tensor("model.decoder.embed_positions.weight", (cfg.max_position_embeddings + 2, h)))
        top["pos_embed"] = pos[2:]
    if not cfg.tie_word_embeddings:
        if not has(lm_head + ".weight"):
            raise ValueError(f"checkpoint has no {lm_head}.weight and tie_word_embeddings is false")
        top["lm_head"] = read.matrix((lm_head + ".weight", cfg.vocab_size))
    wdtype = jnp.dtype(dtype)
    params = {name: _finish(name, x, wdtype) for name, x in top.items()}
    params["layers"] = [
        {name: _finish(name, x, wdtype) for name, x in layer_fn(read, f"{prefix}{i}.", cfg, i).items()}
        for i in range(cfg.num_layers)
    ]
    return params


def _finish(name: str, x, wdtype):
    if isinstance(x, QuantizedRows):
        # A table stays quantized as an LM head (its lookup reads rows in their order: no act-order).
        if name in _QUANTIZED_MATRICES or (name == "embed" and x.perm is None):
            return x.to_weight()
        x = dense(x)
    if name in _MATRICES:
        return jnp.asarray(np.swapaxes(x, -1, -2), dtype=wdtype)
    if name == "router":
        return jnp.asarray(x.T, jnp.float32)
    return jnp.asarray(x, wdtype if name in _WEIGHT_DTYPE else jnp.float32)


class _Reader:
    """Reads tensors as numpy; `matrix` concatenates `[out_i, in]` parts along out."""

    def __init__(self, get, has, cfg: ModelConfig):
        self.get, self.has, self.cfg = get, has, cfg

    def tensor(self, name: str, shape: tuple):
        x = self.get(name, tuple(shape))
        return x if isinstance(x, QuantizedRows) else np.asarray(x)

    def matrix(self, *parts: tuple[str, int], in_dim: int | None = None):
        in_dim = self.cfg.hidden_size if in_dim is None else in_dim
        return concat_rows([self.tensor(name, (out, in_dim)) for name, out in parts])

    def vector(self, *parts: tuple[str, int]) -> np.ndarray:
        return np.concatenate([dense(self.tensor(name, (size,))) for name, size in parts]).astype(np.float32)

    def norm(self, out: dict, key: str, name: str, bias: bool = False, plus_one: bool = False) -> None:
        """out[key] (and out[key + "_bias"]) from the norm `name` (`.weight`, `.bias`)."""
        h = self.cfg.hidden_size
        out[key] = self.vector((name + ".weight", h)) + (1.0 if plus_one else 0.0)
        if bias:
            out[key + "_bias"] = self.vector((name + ".bias", h))


def _split_heads(w, cfg: ModelConfig):
    """Rows of a fused QKV laid out per KV head `[kv_heads, q_per_kv + 2, head_dim, ...]` (its
    q heads, then k, v: GPT-NeoX's and Falcon's layout; for multi-query that is `[q; k; v]`)
    -> `[q; k; v]`."""
    if isinstance(w, QuantizedRows):
        return permute_rows(w, lambda rows: _split_heads(rows, cfg))
    groups, q_per_group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    g = w.reshape(groups, q_per_group + 2, cfg.head_dim, *w.shape[1:])
    q = g[:, :q_per_group].reshape(cfg.q_size, *w.shape[1:])
    k = g[:, q_per_group].reshape(cfg.kv_size, *w.shape[1:])
    v = g[:, q_per_group + 1].reshape(cfg.kv_size, *w.shape[1:])
    return np.concatenate([q, k, v])


# ----------------------------------------------------------------------------- Llama-like families


def _llama_layer(read: _Reader, p: str, cfg: ModelConfig, index: int) -> dict:
    h, q, kv, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    gemma = cfg.architecture == "Gemma3ForCausalLM"
    out: dict = {}
    read.norm(out, "attn_norm", p + "input_layernorm", plus_one=gemma)
    if read.has(p + "self_attn.qkv_proj.weight"):  # Phi-3
        out["wqkv"] = read.matrix((p + "self_attn.qkv_proj.weight", q + 2 * kv))
    else:
        out["wqkv"] = read.matrix(*((p + f"self_attn.{x}_proj.weight", n) for x, n in (("q", q), ("k", kv), ("v", kv))))
    if cfg.qkv_bias:
        out["bqkv"] = read.vector(*((p + f"self_attn.{x}_proj.bias", n) for x, n in (("q", q), ("k", kv), ("v", kv))))
    if cfg.qk_norm:
        out["q_norm"] = read.vector((p + "self_attn.q_norm.weight", hd)) + (1.0 if gemma else 0.0)
        out["k_norm"] = read.vector((p + "self_attn.k_norm.weight", hd)) + (1.0 if gemma else 0.0)
    out["wo"] = read.matrix((p + "self_attn.o_proj.weight", h), in_dim=q)
    if gemma:
        read.norm(out, "post_attn_norm", p + "post_attention_layernorm", plus_one=True)
        read.norm(out, "mlp_norm", p + "pre_feedforward_layernorm", plus_one=True)
        read.norm(out, "post_mlp_norm", p + "post_feedforward_layernorm", plus_one=True)
    else:
        read.norm(out, "mlp_norm", p + "post_attention_layernorm")
    if cfg.is_moe(index):
        out.update(_experts(read, p, cfg))
        return out
    ff = cfg.intermediate_size
    if read.has(p + "mlp.gate_up_proj.weight"):  # Phi-3
        out["w_gate_up"] = read.matrix((p + "mlp.gate_up_proj.weight", 2 * ff))
    else:
        out["w_gate_up"] = read.matrix((p + "mlp.gate_proj.weight", ff), (p + "mlp.up_proj.weight", ff))
    out["w_down"] = read.matrix((p + "mlp.down_proj.weight", h), in_dim=ff)
    return out


def _experts(read: _Reader, p: str, cfg: ModelConfig) -> dict:
    """Router and stacked expert weights, from Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`,
    Qwen3-MoE's `mlp.experts.E.gate_proj/up_proj/down_proj`, or fused `mlp.experts.gate_up_proj`
    `[E, 2F, hidden]` and `down_proj` `[E, hidden, F]`."""
    h, ff, num = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    mixtral = read.has(p + "block_sparse_moe.gate.weight")
    base = p + ("block_sparse_moe." if mixtral else "mlp.")
    out = {"router": dense(read.tensor(base + "gate.weight", (num, h)))}
    if read.has(base + "experts.gate_up_proj"):
        out["experts_gate_up"] = read.tensor(base + "experts.gate_up_proj", (num, 2 * ff, h))
        out["experts_down"] = read.tensor(base + "experts.down_proj", (num, h, ff))
        return out
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    e = base + "experts.{}."
    out["experts_gate_up"] = np.stack(
        [
            dense(read.matrix((e.format(j) + gate + ".weight", ff), (e.format(j) + up + ".weight", ff)))
            for j in range(num)
        ]
    )
    out["experts_down"] = np.stack(
        [dense(read.matrix((e.format(j) + down + ".weight", h), in_dim=ff)) for j in range(num)]
    )
    return out


# ----------------------------------------------------------------------------- OPT, GPT-NeoX, Falcon


def _opt_layer(read: _Reader, p: str, cfg: ModelConfig, index: int) -> dict:
    h, q, kv, ff = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    a = p + "self_attn."
    out = {
        "wqkv": read.matrix((a + "q_proj.weight", q), (a + "k_proj.weight", kv), (a + "v_proj.weight", kv)),
        "wo": read.matrix((a + "out_proj.weight", h), in_dim=q),
        "w_up": read.matrix((p + "fc1.weight", ff)),
        "w_down": read.matrix((p + "fc2.weight", h), in_dim=ff),
    }
    if cfg.qkv_bias:
        out.update(
            bqkv=read.vector((a + "q_proj.bias", q), (a + "k_proj.bias", kv), (a + "v_proj.bias", kv)),
            bo=read.vector((a + "out_proj.bias", h)),
            b_up=read.vector((p + "fc1.bias", ff)),
            b_down=read.vector((p + "fc2.bias", h)),
        )
    read.norm(out, "attn_norm", p + "self_attn_layer_norm", bias=True)
    read.norm(out, "mlp_norm", p + "final_layer_norm", bias=True)
    return out


def _gpt_neox_layer(read: _Reader, p: str, cfg: ModelConfig, index: int) -> dict:
    h, q, ff = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    a = p + "attention."
    qkv = read.tensor(a + "query_key_value.weight", (3 * q, h))
    out = {
        "wqkv": _split_heads(qkv, cfg),
        "wo": read.matrix((a + "dense.weight", h), in_dim=q),
        "w_up": read.matrix((p + "mlp.dense_h_to_4h.weight", ff)),
        "b_up": read.vector((p + "mlp.dense_h_to_4h.bias", ff)),
        "w_down": read.matrix((p + "mlp.dense_4h_to_h.weight", h), in_dim=ff),
        "b_down": read.vector((p + "mlp.dense_4h_to_h.bias", h)),
    }
    if cfg.qkv_bias:
        out["bqkv"] = _split_heads(read.vector((a + "query_key_value.bias", 3 * q)), cfg)
        out["bo"] = read.vector((a + "dense.bias", h))
    read.norm(out, "attn_norm", p + "input_layernorm", bias=True)
    read.norm(out, "mlp_norm", p + "post_attention_layernorm", bias=True)
    return out


def _falcon_layer(read: _Reader, p: str, cfg: ModelConfig, index: int) -> dict:
    h, q, kv, ff = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    a = p + "self_attention."
    qkv = read.tensor(a + "query_key_value.weight", (q + 2 * kv, h))
    out = {
        "wqkv": _split_heads(qkv, cfg),
        "wo": read.matrix((a + "dense.weight", h), in_dim=q),
        "w_up": read.matrix((p + "mlp.dense_h_to_4h.weight", ff)),
        "w_down": read.matrix((p + "mlp.dense_4h_to_h.weight", h), in_dim=ff),
    }
    if cfg.qkv_bias:
        out.update(
            bqkv=_split_heads(read.vector((a + "query_key_value.bias", q + 2 * kv)), cfg),
            bo=read.vector((a + "dense.bias", h)),
            b_up=read.vector((p + "mlp.dense_h_to_4h.bias", ff)),
            b_down=read.vector((p + "mlp.dense_4h_to_h.bias", h)),
        )
    if read.has(p + "ln_attn.weight"):  # new architecture, two norms
        read.norm(out, "attn_norm", p + "ln_attn", bias=True)
        read.norm(out, "mlp_norm", p + "ln_mlp", bias=True)
    else:
        read.norm(out, "attn_norm", p + "input_layernorm", bias=True)
        # Parallel attention reads one norm for both branches; sequential has its own.
        read.norm(
            out,
            "mlp_norm",
            p + ("input_layernorm" if cfg.parallel_residual else "post_attention_layernorm"),
            bias=True,
        )
    return out


# ----------------------------------------------------------------------------- encoders


def _bert_params(read: _Reader, cfg: ModelConfig, wdtype) -> dict:
    """BERT's embeddings (word + position + the token type's first row, which every
    single-sentence input takes: folded into the position rows) with their LayerNorm, and its
    post-norm layers; no final norm, no LM head (the pooler is not read: sentence-transformers
    pools the hidden states). Names with or without BertForX's "bert." prefix."""
    p = "" if read.has("embeddings.word_embeddings.weight") else "bert."
    h, e = cfg.hidden_size, p + "embeddings."
    pos = dense(read.tensor(e + "position_embeddings.weight", (cfg.max_position_embeddings, h)))
    types = read.tensor(e + "token_type_embeddings.weight", (cfg.token_types, h))
    top = {
        "embed": dense(read.tensor(e + "word_embeddings.weight", (cfg.vocab_size, h))),
        "pos_embed": np.asarray(pos, np.float32) + np.asarray(dense(types)[0], np.float32),
    }
    read.norm(top, "embed_norm", e + "LayerNorm", bias=True)
    params = {name: _finish(name, x, wdtype) for name, x in top.items()}
    params["layers"] = [
        {name: _finish(name, x, wdtype) for name, x in _bert_layer(read, f"{p}encoder.layer.{i}.", cfg).items()}
        for i in range(cfg.num_layers)
    ]
    return params


def _bert_layer(read: _Reader, p: str, cfg: ModelConfig) -> dict:
    h, q, ff = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    a = p + "attention."
    parts = [(a + f"self.{name}", size) for name, size in (("query", q), ("key", q), ("value", q))]
    out = {
        "wqkv": read.matrix(*((name + ".weight", size) for name, size in parts)),
        "bqkv": read.vector(*((name + ".bias", size) for name, size in parts)),
        "wo": read.matrix((a + "output.dense.weight", h), in_dim=q),
        "bo": read.vector((a + "output.dense.bias", h)),
        "w_up": read.matrix((p + "intermediate.dense.weight", ff)),
        "b_up": read.vector((p + "intermediate.dense.bias", ff)),
        "w_down": read.matrix((p + "output.dense.weight", h), in_dim=ff),
        "b_down": read.vector((p + "output.dense.bias", h)),
    }
    read.norm(out, "attn_norm", a + "output.LayerNorm", bias=True)
    read.norm(out, "mlp_norm", p + "output.LayerNorm", bias=True)
    return out


# Per family: (layer reader, layer name prefix, embeddings, final norm, LM head), by architecture.
_FAMILIES = {
    "llama": (_llama_layer, "model.layers.", "model.embed_tokens", "model.norm", "lm_head"),
    "OPTForCausalLM": (
        _opt_layer,
        "model.decoder.layers.",
        "model.decoder.embed_tokens",
        "model.decoder.final_layer_norm",
        "lm_head",
    ),
    "GPTNeoXForCausalLM": (
        _gpt_neox_layer,
        "gpt_neox.layers.",
        "gpt_neox.embed_in",
        "gpt_neox.final_layer_norm",
        "embed_out",
    ),
    "FalconForCausalLM": (
        _falcon_layer,
        "transformer.h.",
        "transformer.word_embeddings",
        "transformer.ln_f",
        "lm_head",
    ),
}


class LinearSource(NamedTuple):
    """Where a fused matrix's output columns come from: column j is row `rows[j]` of the HF
    Linear `modules[module_of[j]]` (a name without ".weight"), whose input has `in_dim` features."""

    modules: tuple[str, ...]
    module_of: np.ndarray  # [out] int
    rows: np.ndarray  # [out] int
    in_dim: int


def linear_sources(cfg: ModelConfig, has: Callable[[str], bool] = lambda name: False) -> list[dict[str, LinearSource]]:
    """Per layer, each layer matrix's `LinearSource`: how `build_params` fuses (and permutes) the
    rows of the HF Linears of a checkpoint of `cfg`'s family, found by running the family's own
    layer reader on probes (each Linear's row r read as a one-column tensor holding its id and r),
    so a LoRA adapter's B matrices fuse as the base weights did (jaxllm/lora/adapter.py). `has`
    answers the reader's questions about which layout the checkpoint uses (Phi-3's fused
    projections). Encoders (BERT) have none: ValueError."""
    if cfg.architecture == "BertModel":
        raise ValueError("LoRA adapters are not supported on encoder (BERT) models")
    layer_fn, prefix = _FAMILIES.get(cfg.architecture, _FAMILIES["llama"])[:2]
    modules: list[str] = []
    in_dims: dict[str, int] = {}

    def probe(name: str, shape: tuple):
        if len(shape) != 2 or not name.endswith(".weight"):
            return np.zeros(shape, np.float32)
        modules.append(name[: -len(".weight")])
        in_dims[modules[-1]] = shape[1]
        return (len(modules) * 2.0**24 + np.arange(shape[0], dtype=np.float64))[:, None]

    read = _Reader(probe, has, cfg)
    sources = []
    for i in range(cfg.num_layers):
        layer, found = layer_fn(read, f"{prefix}{i}.", cfg, i), {}
        for name in LORA_MATRICES:
            if name in layer:
                code = np.asarray(layer[name], np.float64)[:, 0].astype(np.int64)
                ids, module_of = np.unique(code >> 24, return_inverse=True)
                names = tuple(modules[k - 1] for k in ids)
                found[name] = LinearSource(names, module_of, code & (2**24 - 1), in_dims[names[0]])
        sources.append(found)
    return sources


# The layer matrices a LoRA adapter may adapt (the experts' and the embedding / LM head are not).
LORA_MATRICES = ("wqkv", "wo", "w_gate_up", "w_up", "w_down")


def check_shape(name: str, arr, shape: tuple, source: str):
    """`arr`, once checked to have `shape`; the error names the tensor and its `source` file."""
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, the config implies {tuple(shape)}")
    return arr


def progress_bar(total: int, name: str, enabled: bool):
    """A tqdm bar counting the `total` tensors read (off unless `enabled`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"Loading {name}", unit="tensor", disable=None if enabled else True, leave=False)
