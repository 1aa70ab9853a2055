"""A GGUF file -> (model config, params, tokenizer).

`read_gguf` is a small reader of the header and tensor table (data stays memory-mapped);
tensors are dequantized with `gguf.quants.dequantize`, or with `keep_quantized` the matrices
stay in their blocks' codes and scales (`quantization/gguf_blocks.py`). The metadata becomes an HF-style config
(`_gguf_model_config`), the tensors are renamed to HF names, and what llama.cpp's converter changed is
changed back: the Q/K rows it permutes for its interleaved RoPE ("llama"), Gemma's norms it
stores as `1 + w`, GPT-NeoX's and Falcon's fused QKV it reorders to `[q; k; v]`, and experts it
stacks (read as one fused tensor). So `build_params` and one rotate-half RoPE serve GGUF and HF
checkpoints alike. The tokenizer is built by transformers from the metadata.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import re
import struct
from typing import Any

import numpy as np

from jaxllm.models.checkpoint import build_params, check_shape, progress_bar
from jaxllm.models.decoder import ModelConfig
from jaxllm.models.registry import UnsupportedModelError, model_config_from_hf
from jaxllm.quantization.checkpoint import dense, permute_rows
from jaxllm.quantization.gguf_blocks import gguf_rows

logger = logging.getLogger(__name__)

# A "llama" GGUF with experts is a Mixtral, with a sliding window a Mistral (`_hf_architecture`).
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gptneox": "GPTNeoXForCausalLM",
    "falcon": "FalconForCausalLM",
}

# GGUF tensor name -> HF name (`{i}` is the layer).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    # Stacked experts [E, out, in]: gate and up are read together (`_STACKED`).
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
}
# Per architecture, where its names differ from the above.
_GGUF_TO_HF_ARCH = {
    "phi3": {
        "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
        "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
    },  # [gate; up]
    "gemma3": {
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
}
# GPT-NeoX and Falcon: LayerNorms with biases, a fused QKV that llama.cpp's converter reorders
# to [q; k; v] (`_group_heads` puts back HF's per-KV-head layout).
_LAYER_NORM_NAMES = {
    "gptneox": {
        "token_embd.weight": "gpt_neox.embed_in.weight",
        "output.weight": "embed_out.weight",
        "output_norm.{w}": "gpt_neox.final_layer_norm.{w}",
        "blk.{i}.attn_norm.{w}": "gpt_neox.layers.{i}.input_layernorm.{w}",
        "blk.{i}.attn_qkv.{w}": "gpt_neox.layers.{i}.attention.query_key_value.{w}",
        "blk.{i}.attn_output.{w}": "gpt_neox.layers.{i}.attention.dense.{w}",
        "blk.{i}.ffn_norm.{w}": "gpt_neox.layers.{i}.post_attention_layernorm.{w}",
        "blk.{i}.ffn_up.{w}": "gpt_neox.layers.{i}.mlp.dense_h_to_4h.{w}",
        "blk.{i}.ffn_down.{w}": "gpt_neox.layers.{i}.mlp.dense_4h_to_h.{w}",
    },
    "falcon": {
        "token_embd.weight": "transformer.word_embeddings.weight",
        "output.weight": "lm_head.weight",
        "output_norm.{w}": "transformer.ln_f.{w}",
        "blk.{i}.attn_norm.{w}": "transformer.h.{i}.input_layernorm.{w}",
        "blk.{i}.attn_qkv.{w}": "transformer.h.{i}.self_attention.query_key_value.{w}",
        "blk.{i}.attn_output.{w}": "transformer.h.{i}.self_attention.dense.{w}",
        "blk.{i}.ffn_up.{w}": "transformer.h.{i}.mlp.dense_h_to_4h.{w}",
        "blk.{i}.ffn_down.{w}": "transformer.h.{i}.mlp.dense_4h_to_h.{w}",
    },
}
# Falcon's new architecture has two norms per layer.
_FALCON_TWO_NORMS = {
    "blk.{i}.attn_norm.{w}": "transformer.h.{i}.ln_attn.{w}",
    "blk.{i}.attn_norm_2.{w}": "transformer.h.{i}.ln_mlp.{w}",
}
_MIXTRAL_MOE = {
    "model.layers.{i}.mlp.gate.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "model.layers.{i}.mlp.experts.down_proj": "model.layers.{i}.block_sparse_moe.experts.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml's dims reversed): [out, in] for a weight
    ggml_type: int
    data: np.ndarray  # raw uint8 bytes, rows of the last dim: [..., bytes_per_row]


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Parse a GGUF file's metadata and tensor table; tensor data stays memory-mapped.

    Written here rather than using `gguf.GGUFReader`, which builds a numpy view per
    vocabulary entry and takes ~2.5 s on the default model's header (this takes ~0.1 s).
    Raises ValueError naming the file when it is truncated or not a GGUF.
    """
    from gguf.constants import GGML_QUANT_SIZES

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        reader = _GGUFHeader(buf)
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic bytes")
        version, num_tensors, num_kv = reader.unpack("<4xIQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        metadata = {}
        for _ in range(num_kv):
            key = reader.string()
            (vtype,) = reader.unpack("<I")
            metadata[key] = reader.value(vtype)
        infos = []
        for _ in range(num_tensors):
            name = reader.string()
            (ndim,) = reader.unpack("<I")
            dims = reader.unpack(f"<{ndim}Q")
            ggml_type, offset = reader.unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-reader.pos // alignment) * alignment
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, KeyError) as e:
        raise ValueError(f"{path}: not a valid GGUF file (truncated or corrupt): {e}") from e

    tensors = {}
    for name, shape, ggml_type, offset in infos:
        if ggml_type not in GGML_QUANT_SIZES:
            raise UnsupportedModelError(f"{path}: tensor {name} has unknown ggml type {ggml_type}")
        quant_elems, type_size = GGML_QUANT_SIZES[ggml_type]
        row_bytes = shape[-1] // quant_elems * type_size
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        start = data_start + offset
        if start + nbytes > len(buf):
            raise ValueError(
                f"{path}: truncated GGUF file: tensor {name} ends at byte {start + nbytes}, "
                f"the file has {len(buf)} bytes"
            )
        data = np.frombuffer(buf, np.uint8, nbytes, start).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, shape, ggml_type, data)
    return metadata, tensors


class _GGUFHeader:
    """Cursor over a GGUF header (little-endian)."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"string of {n} bytes at offset {self.pos} runs past the end")
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return s.decode("utf-8")

    def value(self, vtype: int):
        if vtype in self._SCALARS:
            return self.unpack(self._SCALARS[vtype])[0]
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.unpack("<IQ")
            if etype in self._SCALARS:  # numbers: one frombuffer, not `count` unpacks
                dt = np.dtype(self._SCALARS[etype].replace("?", "b1"))
                out = np.frombuffer(self.buf, dt, count, self.pos).tolist()
                self.pos += count * dt.itemsize
                return out
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


def _dequantize(t: GGUFTensor) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, t.ggml_type).reshape(t.shape)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"tensor {t.name}: {e}") from e


def _group_heads(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`[q; k; v]` rows (llama.cpp's fused QKV) -> HF's per-KV-head groups `[kv_heads, q_per_kv
    + 2, head_dim, ...]` (its q heads, then k, v), the layout `checkpoint._split_heads` reads."""
    rest = w.shape[1:]
    q, k, v = np.split(w, [cfg.q_size, cfg.q_size + cfg.kv_size])
    q = q.reshape(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, *rest)
    k, v = (t.reshape(cfg.num_kv_heads, 1, cfg.head_dim, *rest) for t in (k, v))
    return np.concatenate([q, k, v], axis=1).reshape(w.shape)


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved RoPE pairs -> rotate-half halves).

    llama.cpp stores head rows as `reshape(n_heads, 2, d/2).swapaxes(1, 2)`; this is its
    inverse, as in transformers' GGUF loader.
    """
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_model_config(path: str, metadata: dict, tensors: dict[str, GGUFTensor]) -> ModelConfig:
    """GGUF metadata -> an HF-style config dict -> the model config, built (and checked) by `registry.py`."""
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )

    def md(key, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    num_heads = int(md("attention.head_count"))
    num_kv_heads = md("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise UnsupportedModelError(f"{path}: per-layer KV head counts {sorted(set(num_kv_heads))}")
        num_kv_heads = num_kv_heads[0]
    hidden = int(md("embedding_length"))
    head_dim = int(md("attention.key_length", hidden // num_heads))
    rotary = int(md("rope.dimension_count", head_dim))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{path}: GGUF has no token_embd.weight")
    layer_norm = arch in _LAYER_NORM_NAMES
    eps_key = "attention.layer_norm_epsilon" if layer_norm else "attention.layer_norm_rms_epsilon"
    tok = "tokenizer.ggml."
    eos = [metadata[tok + k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if tok + k in metadata]
    experts = metadata.get(f"{arch}.expert_count")
    config = {
        "architectures": [_hf_architecture(arch, experts, metadata.get(f"{arch}.attention.sliding_window"))],
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(md("feed_forward_length")),
        "num_hidden_layers": int(md("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        # GGUF stores eps as float32: 1e-5 reads back as 9.99999974e-06.
        "rms_norm_eps": float(str(np.float32(md(eps_key)))),
        "rope_theta": float(md("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(md("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get(tok + "bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)),
        "partial_rotary_factor": rotary / head_dim,
    }
    _family_config(config, arch, md, metadata, tensors, experts)
    cfg = model_config_from_hf(config)
    if "rope_freqs.weight" in tensors:  # Llama 3.x: scaled frequencies stored as a tensor
        orig_ctx = metadata.get(f"{arch}.rope.scaling.original_context_length")
        config["rope_scaling"] = _llama3_scaling_from_freqs(
            path, cfg, _dequantize(tensors["rope_freqs.weight"]), orig_ctx
        )
        cfg = model_config_from_hf(config)
    return cfg


def _family_config(config: dict, arch: str, md, metadata: dict, tensors: dict, experts) -> None:
    """What each family adds to the HF-style config (`_gguf_model_config`), in place: experts, GPT-NeoX's
    and Falcon's layouts, Phi-3's long RoPE, sliding windows, Gemma 3's fixed choices, RoPE scaling."""
    hidden, num_heads, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    if experts:
        config.update(
            num_local_experts=int(experts),
            num_experts_per_tok=int(md("expert_used_count")),
            moe_intermediate_size=int(md("expert_feed_forward_length", config["intermediate_size"])),
            norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", True)),
        )  # llama.cpp's default
    if arch == "gptneox":
        config.update(
            layer_norm_eps=config["rms_norm_eps"],
            rotary_pct=config["partial_rotary_factor"],
            attention_bias=True,
            use_parallel_residual=bool(metadata.get("gptneox.use_parallel_residual", True)),
        )
    if arch == "falcon":  # llama.cpp runs attention and MLP in parallel, as every Falcon does
        config.update(
            layer_norm_epsilon=config["rms_norm_eps"],
            num_kv_heads=config["num_key_value_heads"],
            new_decoder_architecture="blk.0.attn_norm_2.weight" in tensors,
            parallel_attn=True,
            multi_query=config["num_key_value_heads"] == 1,
            bias="blk.0.attn_qkv.bias" in tensors,
            ffn_hidden_size=config["intermediate_size"],
        )
    if arch == "phi3" and "rope_factors_long.weight" in tensors:
        config["rope_scaling"] = {"rope_type": "longrope"}  # registry.py rejects it by name
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    if arch == "gemma3":
        # What llama.cpp fixes for every Gemma 3 rather than storing: 5 sliding-window layers
        # to 1 global, a local RoPE base of 10k, and the query scale (27B: hidden / heads).
        config.update(
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=hidden // num_heads if config["num_hidden_layers"] == 62 else head_dim,
        )
        end_of_turn = _token_id(metadata, "<end_of_turn>")  # llama.cpp ends chat turns on it too
        if end_of_turn is not None:
            config["eos_token_id"] = list(dict.fromkeys([*config["eos_token_id"], end_of_turn]))
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(md("rope.scaling.factor"))}
    elif scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling}  # registry.py rejects it by name


def _hf_architecture(arch: str, experts, window) -> str:
    """llama.cpp writes Mistral (a sliding window) and Mixtral (experts) as "llama"."""
    if arch == "llama" and experts:
        return "MixtralForCausalLM"
    if arch == "llama" and window:
        return "MistralForCausalLM"
    return _GGUF_ARCHITECTURES[arch]


def _token_id(metadata: dict, text: str) -> int | None:
    try:
        return (metadata.get("tokenizer.ggml.tokens") or []).index(text)
    except ValueError:
        return None


def _llama3_scaling_from_freqs(path: str, cfg: ModelConfig, freq_factors: np.ndarray, orig_ctx) -> dict:
    """llama.cpp stores Llama 3 RoPE scaling as per-frequency divisors; recover the parameters
    (factor is the largest divisor; low/high 1 and 4 as in every Llama 3.x) and check them."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(freq_factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(orig_ctx or 8192),
    }
    fitted = dataclasses.replace(
        cfg,
        llama3_rope_scaling=tuple(
            scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        ),
    )
    if not np.allclose(fitted.inv_freq(), cfg.inv_freq() / freq_factors, rtol=1e-4):
        raise UnsupportedModelError(f"{path}: rope_freqs.weight is not a Llama 3 RoPE scaling")
    return scaling


def load_gguf(path: str, dtype: str, progress: bool, keep_quantized: bool = False):
    """-> (model config, params, tokenizer); with `keep_quantized` the quantized matrices of the types
    `gguf_blocks` maps stay quantized (`QuantizedWeight`s in params)."""
    metadata, tensors = read_gguf(path)
    cfg = _gguf_model_config(path, metadata, tensors)

    arch = metadata["general.architecture"]
    if arch in _LAYER_NORM_NAMES:
        two_norms = _FALCON_TWO_NORMS if "blk.0.attn_norm_2.weight" in tensors else {}
        names = {
            g.format(i="{i}", w=w): h.format(i="{i}", w=w)
            for g, h in {**_LAYER_NORM_NAMES[arch], **two_norms}.items()
            for w in ("weight", "bias")
        }
    else:
        names = {**_GGUF_TO_HF, **_GGUF_TO_HF_ARCH.get(arch, {})}
    if cfg.architecture == "MixtralForCausalLM":
        names = {g: _MIXTRAL_MOE.get(h, h) for g, h in names.items()}
    hf_to_gguf = {}
    for gguf_name in tensors:
        m = _BLOCK_NAME.fullmatch(gguf_name)
        pattern, layer = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (gguf_name, None)
        if pattern in names:
            hf_to_gguf[names[pattern].format(i=layer)] = gguf_name
        elif pattern == "blk.{i}.ffn_gate_exps.weight":  # with ffn_up_exps: the experts' fused gate/up
            hf_name = names["blk.{i}.ffn_down_exps.weight"].replace("down_proj", "gate_up_proj").format(i=layer)
            hf_to_gguf[hf_name] = (gguf_name, f"blk.{layer}.ffn_up_exps.weight")
    permuted = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
    unpermute = arch == "llama"  # the others use NEOX RoPE: unpermuted

    bar = progress_bar(len(hf_to_gguf), os.path.basename(path), progress)

    def get(name: str, shape: tuple):
        if name not in hf_to_gguf:
            raise ValueError(f"{path}: GGUF has no tensor for {name}")
        source = hf_to_gguf[name]
        if isinstance(source, tuple):
            w = np.concatenate([_dequantize(tensors[s]) for s in source], axis=1)
        else:
            t = tensors[source]
            w = gguf_rows(t.data, t.ggml_type, t.shape) if keep_quantized else None
            w = _dequantize(t) if w is None else w
        heads = next((n for k, n in permuted.items() if k in name), None)
        if unpermute and heads is not None:
            w = permute_rows(w, lambda rows: _unpermute_rope(rows, heads))
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = dense(w) - 1.0  # llama.cpp stores Gemma's (1 + w); build_params adds the 1
        if "query_key_value" in name:
            w = permute_rows(w, lambda rows: _group_heads(rows, cfg))
        bar.update(1)
        return check_shape(str(source), w, shape, path)

    with bar:
        params = build_params(get, lambda n: n in hf_to_gguf, cfg, dtype)
    return cfg, params, _gguf_tokenizer(path, metadata)


def _gguf_tokenizer(path: str, metadata: dict):
    """The tokenizer a GGUF describes, built by transformers from the metadata we already parsed.

    This is what `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds, without its second
    and third passes over the file and its torch import (~4 s on the default model).
    """
    if "tokenizer.ggml.tokens" not in metadata:
        logger.warning("%s has no tokenizer metadata; the model takes token ids only", path)
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # another transformers layout: the public (slower) route
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    groups = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to SPM vocabularies
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for token, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[token] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
