"""HF config -> `ModelConfig`: each supported family's config keys read into the one decoder's
data, and anything that would change the math in a way `decoder.py` does not implement
rejected by name.

Configs are read in both spellings found in the wild: what transformers 5 writes
(`rope_parameters`, `num_local_experts`, `layer_types`) and the older keys most published
checkpoints carry (`rope_theta`, `rope_scaling`, `num_experts`, `rotary_pct`,
`sliding_window_pattern`, Falcon's `n_head` / `n_layer`).
"""

from __future__ import annotations

from typing import Any

from jaxllm.models.decoder import ModelConfig

LLAMA_LIKE = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Encoders (bidirectional attention; pooled, not sampled).
ENCODERS = ("BertModel",)
SUPPORTED_ARCHITECTURES = (*LLAMA_LIKE, "OPTForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM", *ENCODERS)

# HF activation names -> decoder.ACTIVATIONS (the only names a cfg gets)
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


class UnsupportedModelError(ValueError):
    """The model's architecture or a config option is not implemented."""


def _as_eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """Build the static model config from an HF `config.json` dict."""
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("config.json names no 'architectures'; cannot pick a model")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    c = _Config(arch, config)
    num_heads = c.int("num_attention_heads", "n_head")
    hidden = c.int("hidden_size", "d_model")
    fields = dict(
        architecture=arch,
        vocab_size=c.int("vocab_size"),
        hidden_size=hidden,
        num_heads=num_heads,
        num_layers=c.int("num_hidden_layers", "n_layer"),
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_as_eos_tuple(config.get("eos_token_id")),
    )
    families = {
        "OPTForCausalLM": _opt,
        "GPTNeoXForCausalLM": _gpt_neox,
        "FalconForCausalLM": _falcon,
        "BertModel": _bert,
    }
    family = families.get(arch, _llama)
    fields.update(family(c, fields))
    cfg = ModelConfig(**fields)
    if cfg.num_heads % cfg.num_kv_heads:
        raise UnsupportedModelError(f"{arch}: {cfg.num_heads} heads are not a multiple of {cfg.num_kv_heads} KV heads")
    return cfg


class _Config:
    """Typed reads of a config dict, with errors that name the architecture."""

    def __init__(self, arch: str, config: dict):
        self.arch, self.d = arch, config

    def get(self, *keys, default=None):
        return next((self.d[k] for k in keys if self.d.get(k) is not None), default)

    def int(self, *keys, default=None) -> int:
        value = self.get(*keys, default=default)
        if value is None:
            raise UnsupportedModelError(f"{self.arch}: config.json has no {keys[0]!r}")
        return int(value)

    def activation(self, *keys, default="silu") -> str:
        name = self.get(*keys, default=default)
        if name not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"{self.arch}: activation {name!r} is not implemented (supported: {', '.join(_ACTIVATIONS)})"
            )
        return _ACTIVATIONS[name]

    def refuse(self, key: str, why: str, ok=(None, False, 0)) -> None:
        if self.d.get(key) not in ok:
            raise UnsupportedModelError(f"{self.arch}: {key}={self.d[key]!r} is not implemented ({why})")


def _rope(c: _Config, rope: dict | None = None, theta_keys=("rope_theta",)) -> dict:
    """RoPE fields from `rope_parameters` / `rope_scaling` (or the given dict) and the top level."""
    rope = rope if rope is not None else (c.get("rope_scaling") or c.get("rope_parameters") or {})
    theta = rope.get("rope_theta", c.get(*theta_keys, default=10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "llama3":
        out["llama3_rope_scaling"] = (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    elif kind == "linear":
        out["linear_rope_factor"] = float(rope["factor"])
    elif kind != "default":
        raise UnsupportedModelError(f"{c.arch}: rope scaling type {kind!r} is not implemented")
    return out


def _partial_rotary(c: _Config, head_dim: int, *keys) -> int | None:
    rope = c.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", c.get(*keys, default=1.0)))
    return None if factor == 1.0 else int(head_dim * factor)


def _windows(c: _Config, num_layers: int, default_use: bool) -> tuple[int, ...]:
    """Per layer: the sliding window, 0 for global attention (() when every layer is global).
    A window as long as the context masks nothing but still marks the layer's kind (Gemma 3's
    sliding layers take the local RoPE base whatever their window)."""
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is None:
        pattern = c.get("sliding_window_pattern", "_sliding_window_pattern")
        if pattern:  # Gemma 3: every pattern-th layer is global
            types = [
                "full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(num_layers)
            ]
        elif window and c.get("use_sliding_window", default=default_use):
            first = int(c.get("max_window_layers", default=0)) if c.arch.startswith("Qwen") else 0
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            return ()
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"{c.arch}: layer_types {sorted(unknown)} not implemented")
    if not window:
        return ()
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _llama(c: _Config, f: dict) -> dict:
    arch = c.arch
    out = dict(
        intermediate_size=c.int("intermediate_size"),
        norm_eps=float(c.get("rms_norm_eps", default=1e-6)),
        hidden_act=c.activation("hidden_act", "hidden_activation"),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
    )
    if arch != "Qwen2ForCausalLM":
        c.refuse("attention_bias", "biases on the attention projections")
    c.refuse("mlp_bias", "biases on the MLP")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if arch == "Gemma3ForCausalLM":
        c.refuse("final_logit_softcapping", "Gemma 2's logit soft-capping")
        c.refuse("attn_logit_softcapping", "Gemma 2's attention soft-capping")
        out.update(
            sandwich_norm=True,
            embed_scale=f["hidden_size"] ** 0.5,
            attn_scale=float(c.get("query_pre_attn_scalar", default=f["head_dim"])) ** -0.5,
        )
        if "full_attention" in rope:  # transformers 5: one RoPE per layer type
            out.update(_rope(c, rope["full_attention"]))
            out["local_rope_theta"] = float(rope.get("sliding_attention", {}).get("rope_theta", 10000.0))
        else:
            out.update(_rope(c, rope or {}))
            out["local_rope_theta"] = float(c.get("rope_local_base_freq", default=10000.0))
    else:
        out.update(_rope(c))
    out["rotary_dim"] = _partial_rotary(c, f["head_dim"], "partial_rotary_factor")
    out["layer_windows"] = _windows(
        c,
        f["num_layers"],
        default_use=arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM"),
    )
    experts = c.get("num_local_experts", "num_experts")
    if arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM") and experts:
        sparse_step = int(c.get("decoder_sparse_step", default=1))
        dense_layers = set(c.get("mlp_only_layers", default=[]))
        out.update(
            num_experts=int(experts),
            num_experts_per_tok=c.int("num_experts_per_tok"),
            moe_intermediate_size=int(c.get("moe_intermediate_size", default=out["intermediate_size"])),
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(c.get("norm_topk_prob", default=False)),
            moe_layers=tuple(i for i in range(f["num_layers"]) if i not in dense_layers and (i + 1) % sparse_step == 0),
        )
    return out


def _opt(c: _Config, f: dict) -> dict:
    if c.get("do_layer_norm_before", default=True) is not True:
        raise UnsupportedModelError(
            f"{c.arch}: do_layer_norm_before=False (opt-350m's post-norm layers) is not implemented"
        )
    if int(c.get("word_embed_proj_dim", default=f["hidden_size"])) != f["hidden_size"]:
        raise UnsupportedModelError(f"{c.arch}: word_embed_proj_dim != hidden_size (project_in/out) is not implemented")
    c.refuse("_remove_final_layer_norm", "a decoder without its final LayerNorm")
    c.refuse("layer_norm_elementwise_affine", "LayerNorm without weights", ok=(None, True))
    bias = bool(c.get("enable_bias", default=True))
    return dict(
        intermediate_size=c.int("ffn_dim"),
        norm_eps=1e-5,
        norm="layer",
        position="learned",
        hidden_act=c.activation("activation_function", default="relu"),
        gated_mlp=False,
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=bias,
        rope_theta=10000.0,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", default=True)),
    )


def _bert(c: _Config, f: dict) -> dict:
    """BERT (sentence-transformers' encoders): post-layer LayerNorms, learned positions plus the
    token type's row, GELU, biases everywhere, bidirectional attention, no LM head."""
    c.refuse("position_embedding_type", "relative position embeddings", ok=(None, "absolute"))
    c.refuse("is_decoder", "a BERT decoder")
    return dict(
        intermediate_size=c.int("intermediate_size"),
        norm_eps=float(c.get("layer_norm_eps", default=1e-12)),
        norm="layer",
        position="learned",
        hidden_act=c.activation("hidden_act", default="gelu"),
        gated_mlp=False,
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        post_norm=True,
        bidirectional=True,
        token_types=c.int("type_vocab_size", default=2),
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


def _gpt_neox(c: _Config, f: dict) -> dict:
    bias = bool(c.get("attention_bias", default=True))
    return dict(
        intermediate_size=c.int("intermediate_size", default=4 * f["hidden_size"]),
        norm_eps=float(c.get("layer_norm_eps", default=1e-5)),
        norm="layer",
        gated_mlp=False,
        hidden_act=c.activation("hidden_act", default="gelu"),
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=True,
        parallel_residual=bool(c.get("use_parallel_residual", default=True)),
        rotary_dim=_partial_rotary(c, f["head_dim"], "rotary_pct"),
        **_rope(c, c.get("rope_parameters") or {}, theta_keys=("rope_theta", "rotary_emb_base")),
    )


def _falcon(c: _Config, f: dict) -> dict:
    c.refuse("alibi", "ALiBi positions")
    new_arch = bool(c.get("new_decoder_architecture", default=False))
    if new_arch:
        kv_heads = c.int("num_kv_heads", default=f["num_heads"])
    elif c.get("multi_query", default=True):
        kv_heads = 1
    else:
        kv_heads = f["num_heads"]
    bias = bool(c.get("bias", default=False))
    return dict(
        num_kv_heads=kv_heads,
        intermediate_size=int(c.get("ffn_hidden_size", default=4 * f["hidden_size"])),
        norm_eps=float(c.get("layer_norm_epsilon", default=1e-5)),
        norm="layer",
        gated_mlp=False,
        hidden_act=c.activation("activation", default="gelu"),
        qkv_bias=bias,
        attn_out_bias=bias,
        mlp_bias=bias,
        parallel_residual=new_arch or bool(c.get("parallel_attn", default=True)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", default=True)),
        **_rope(c, c.get("rope_parameters") or {}),
    )
