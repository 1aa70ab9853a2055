"""HF config -> `ModelSpec`, rejecting by name whatever the Llama definition does not implement."""

from __future__ import annotations

from typing import Any

from jaxllm.models.llama import ModelSpec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class UnsupportedModelError(ValueError):
    """The model's architecture or a config option is not implemented."""


def _as_eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def spec_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Build the static model spec from an HF `config.json` dict."""
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("config.json names no 'architectures'; cannot pick a model")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    sliding = config.get("sliding_window")
    use_sliding = config.get("use_sliding_window", arch == "MistralForCausalLM")
    max_pos = int(config.get("max_position_embeddings", 2048))
    if sliding is not None and use_sliding and int(sliding) < max_pos:
        raise UnsupportedModelError(
            f"{arch}: sliding_window={sliding} (< max_position_embeddings={max_pos}) is not implemented")
    layer_types = config.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(f"{arch}: layer_types {sorted(set(layer_types))} not implemented")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch}: hidden_act={act!r} is not implemented (only 'silu')")
    if config.get("attention_bias") and arch != "Qwen2ForCausalLM":
        raise UnsupportedModelError(f"{arch}: attention_bias=True is not implemented")
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{arch}: mlp_bias=True is not implemented")

    rope_theta = config.get("rope_theta")
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    llama3 = None
    if scaling:
        rope_theta = scaling.get("rope_theta", rope_theta)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "llama3":
            llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                      float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
        elif kind != "default":
            raise UnsupportedModelError(f"{arch}: rope scaling type {kind!r} is not implemented")
    if rope_theta is None:
        rope_theta = 10000.0

    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // num_heads
    return ModelSpec(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        llama3_rope_scaling=llama3,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_as_eos_tuple(config.get("eos_token_id")),
    )
