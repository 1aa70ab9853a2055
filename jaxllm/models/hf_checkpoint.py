"""An HF checkpoint directory -> (model config, params, tokenizer): `config.json` (plus
`generation_config.json`'s EOS ids), safetensors weights (`model.safetensors`, a sharded
`model.safetensors.index.json`, or any `*.safetensors`), and the tokenizer files. An AWQ or
GPTQ checkpoint (`quantization_config`) gives its quantized Linears as `QuantizedRows`
(`quantization/gptq_awq.py`).
"""

from __future__ import annotations

import json
import logging
import os

import jax

from jaxllm.models.checkpoint import ModelNotFoundError, build_params, check_shape, progress_bar
from jaxllm.models.registry import model_config_from_hf
from jaxllm.quantization.gptq_awq import checkpoint_quantization, quantized_linear

logger = logging.getLogger(__name__)


def load_hf_dir(path: str, dtype: str, progress: bool):
    """-> (model config, params, tokenizer) of the HF checkpoint directory `path`."""
    config = _config_with_generation_eos(path)
    cfg = model_config_from_hf(config)
    quant = checkpoint_quantization(config)
    handles, index = _open_safetensors(path)
    bar = progress_bar(len(index), os.path.basename(path), progress)

    def key(name: str) -> str:
        # A checkpoint saved from the bare model (not *ForCausalLM) has no "model." prefix.
        return name if name in index else name.removeprefix("model.")

    def quantized(name: str) -> bool:  # a Linear stored as qweight, qzeros, scales (AWQ / GPTQ)
        return quant is not None and name.endswith(".weight") and key(name[:-7] + ".qweight") in index

    def get(name: str, shape: tuple):
        if quantized(name):
            prefix = name[:-7]
            rows = quantized_linear(
                lambda suffix: read(prefix + suffix) if key(prefix + suffix) in index else None, quant, shape
            )
            bar.update(1)
            return rows
        arr = read(name)
        bar.update(1)
        return check_shape(name, arr, shape, index[key(name)])

    def read(name: str):
        file = index.get(key(name))
        if file is None:
            raise ValueError(f"{path}: checkpoint has no tensor {key(name)!r}")
        try:
            # Read to the host (this process's CPU); fused arrays go to the device.
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                arr = handles[file].get_tensor(key(name))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{file}: cannot read tensor {key(name)!r} (truncated or corrupt): {e}") from e
        return arr

    with bar:
        params = build_params(get, lambda n: key(n) in index or quantized(n), cfg, dtype)
    return cfg, params, _hf_tokenizer(path)


def _config_with_generation_eos(path: str) -> dict:
    """config.json, its EOS ids joined by generation_config.json's (vLLM also stops on those)."""
    config = _read_config(path)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            eos = _as_list(config.get("eos_token_id")) + _as_list(gen_eos)
            config = {**config, "eos_token_id": list(dict.fromkeys(eos))}
    return config


def _open_safetensors(path: str) -> tuple[dict, dict[str, str]]:
    """(file -> open safetensors handle, tensor name -> its file) over the checkpoint's files."""
    from safetensors import safe_open

    index: dict[str, str] = {}
    handles = {}
    for file in safetensors_files(path):
        try:
            # "flax", not "np": numpy has no bfloat16.
            handles[file] = safe_open(file, framework="flax")
            index.update({k: file for k in handles[file].keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{file}: not a valid safetensors file (truncated or corrupt): {e}") from e
    return handles, index


def hf_quantization(path: str) -> str | None:
    """The quantization method ("awq", "gptq") of the HF checkpoint at `path`, or None."""
    quant = checkpoint_quantization(_read_config(path))
    return quant and quant["method"]


def _read_config(path: str) -> dict:
    """config.json, with an older AutoGPTQ checkpoint's `quantize_config.json` as its
    `quantization_config`."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    legacy = os.path.join(path, "quantize_config.json")
    if "quantization_config" not in config and os.path.isfile(legacy):
        with open(legacy) as f:
            config["quantization_config"] = {"quant_method": "gptq", **json.load(f)}
    return config


def _as_list(x) -> list:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def safetensors_files(path: str) -> list[str]:
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
