"""What the checkpoint formats share: the one converter `build_params` from weights in HF
names and layout (`Linear` weights `[out, in]`) to the params pytree of `llama.py`, the shape
check and progress bar used while reading, and `ModelNotFoundError`.

`hf_checkpoint.py` reads an HF directory and `gguf_checkpoint.py` a GGUF file; both hand their
tensors to `build_params` under HF names, so the fused layout is written once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.llama import ModelSpec


class ModelNotFoundError(FileNotFoundError):
    """The model path, hub id or default model package could not be found."""


def build_params(get: Callable[[str, tuple], Any], has: Callable[[str], bool], spec: ModelSpec,
                 dtype: str) -> dict:
    """Fuse weights given in HF names and layout into the llama.py params pytree.

    get(name, shape) returns the tensor (numpy, or a jax array on the CPU) checked to have
    `shape`; HF `Linear` weights are `[out, in]`. has(name) says whether the checkpoint holds
    `name`. Fusing happens in numpy, and each result is put on the default device once.
    """
    h, q, kv, ff, hd = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim
    wdtype = jnp.dtype(dtype)

    def matrix(in_dim: int, *parts: tuple[str, int]) -> jax.Array:
        """`[out_i, in_dim]` weights -> fused `[in_dim, sum(out_i)]` in the weight dtype."""
        ws = [np.asarray(get(name, (out, in_dim))) for name, out in parts]
        return jnp.asarray(np.concatenate(ws).T, dtype=wdtype)

    def vector(*parts: tuple[str, int]) -> jax.Array:
        return jnp.asarray(np.concatenate([np.asarray(get(name, (size,))) for name, size in parts]), jnp.float32)

    params = {"embed": jnp.asarray(np.asarray(get("model.embed_tokens.weight", (spec.vocab_size, h))), wdtype),
              "layers": []}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": vector((p + "input_layernorm.weight", h)),
            "wqkv": matrix(h, (p + "self_attn.q_proj.weight", q), (p + "self_attn.k_proj.weight", kv),
                           (p + "self_attn.v_proj.weight", kv)),
            "wo": matrix(q, (p + "self_attn.o_proj.weight", h)),
            "mlp_norm": vector((p + "post_attention_layernorm.weight", h)),
            "w_gate_up": matrix(h, (p + "mlp.gate_proj.weight", ff), (p + "mlp.up_proj.weight", ff)),
            "w_down": matrix(ff, (p + "mlp.down_proj.weight", h)),
        }
        if spec.qkv_bias:
            layer["bqkv"] = vector((p + "self_attn.q_proj.bias", q), (p + "self_attn.k_proj.bias", kv),
                                   (p + "self_attn.v_proj.bias", kv))
        if spec.qk_norm:
            layer["q_norm"] = vector((p + "self_attn.q_norm.weight", hd))
            layer["k_norm"] = vector((p + "self_attn.k_norm.weight", hd))
        params["layers"].append(layer)
    params["final_norm"] = vector(("model.norm.weight", h))
    if not spec.tie_word_embeddings:
        if not has("lm_head.weight"):
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        params["lm_head"] = matrix(h, ("lm_head.weight", spec.vocab_size))
    return params


def check_shape(name: str, arr, shape: tuple, source: str):
    """`arr`, once checked to have `shape`; the error names the tensor and its `source` file."""
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, the config implies {tuple(shape)}")
    return arr


def progress_bar(total: int, name: str, enabled: bool):
    """A tqdm bar counting the `total` tensors read (off unless `enabled`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"Loading {name}", unit="tensor", disable=not enabled, leave=False)
