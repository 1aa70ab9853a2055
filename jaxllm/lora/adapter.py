"""A LoRA adapter in PEFT's format, read into the engine's fused layout (host arrays).

PEFT's `adapter_model.safetensors` holds, per adapted HF Linear `m` (weight `[out, in]`),
`base_model.model.<m>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]: the Linear computes
`x W^T + scale (x A^T) B^T`, with scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). The
engine's layer matrices fuse several Linears (wqkv = q, k, v), so an adapted matrix has one rank
block of R (max_lora_rank rounded up to 16) per Linear fused into it (`LoRAGeometry`): `a [in,
blocks * R]` holds block k's A^T (zero-padded to R), `b [blocks * R, out]` block k's scale B^T
at the columns where that Linear's rows were fused (`models.checkpoint.linear_sources`, the base
weights' own fusing).

    geometry = LoRAGeometry.of(cfg)
    cache = AdapterCache(geometry, max_rank=16, block_rank=16, capacity=4)
    adapter = cache.get(LoRARequest("sql", 1, "/path/to/adapter"))     # LoRAAdapter, or LoRAError
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import threading
from typing import NamedTuple

import numpy as np

from jaxllm.lora.request import LoRAError, LoRARequest
from jaxllm.models.checkpoint import LinearSource, linear_sources

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class MatrixSlot(NamedTuple):
    """What one adaptable matrix's device slot holds: `a [in, blocks * R]`, and `b` in parts of
    `parts[k]` output columns each: one `[R, out_k]` per block where each block's columns are
    contiguous (q | k | v: a third of the products a block-diagonal b would take), else one
    block-diagonal `[blocks * R, out]`."""

    blocks: int
    in_dim: int
    parts: tuple[int, ...]
    block_of: np.ndarray  # [out] int: each output column's block

    @classmethod
    def of(cls, source: LinearSource) -> MatrixSlot:
        contiguous = bool(np.all(np.diff(source.module_of) >= 0))
        parts = np.bincount(source.module_of) if contiguous else [len(source.rows)]
        return cls(len(source.modules), source.in_dim, tuple(int(n) for n in parts), source.module_of)

    def split(self, b: np.ndarray, rank: int) -> tuple[np.ndarray, ...]:
        """A block-diagonal b [blocks * rank, out] in this slot's parts."""
        if len(self.parts) == 1:
            return (b,)
        ends = np.cumsum(self.parts)
        return tuple(b[k * rank : (k + 1) * rank, end - n : end] for k, (n, end) in enumerate(zip(self.parts, ends)))


@dataclasses.dataclass(frozen=True)
class LoRAGeometry:
    """Per layer, each adaptable matrix's `MatrixSlot`: what a device slot holds."""

    cfg: object
    layers: tuple[dict[str, MatrixSlot], ...]

    @classmethod
    def of(cls, cfg) -> LoRAGeometry:
        layers = linear_sources(cfg)
        return cls(cfg, tuple({name: MatrixSlot.of(source) for name, source in layer.items()} for layer in layers))


@dataclasses.dataclass(eq=False)
class LoRAAdapter:
    """An adapter read for one engine: per layer, {matrix: (a [in, blocks * R], b [blocks * R,
    out]) float32} for the matrices it adapts (see the module doc)."""

    request: LoRARequest
    rank: int
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]
    config: dict = dataclasses.field(default_factory=dict)  # its adapter_config.json
    version: int = 0  # how many times its weights were replaced in memory (`AdapterCache.update`)
    # Its slot's values as the device's stacks take them (`LoRASlots.prepare`), made when it is
    # read, off the engine's thread where the caller is (AsyncLLM, the server's load route).
    slot_values: list | None = None

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def read_adapter(request: LoRARequest, geometry: LoRAGeometry, max_rank: int, block_rank: int) -> LoRAAdapter:
    """The adapter at `request.lora_path`, checked against the base model (ranks up to
    `max_rank`), in blocks of `block_rank`; or LoRAError."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config, tensors = _read_config(request.lora_path, where), _read_tensors(request.lora_path, where)
    return adapter_from_tensors(request, tensors, config, geometry, max_rank, block_rank)


def adapter_from_tensors(
    request: LoRARequest, tensors, config: dict, geometry: LoRAGeometry, max_rank: int, block_rank: int, version=0
) -> LoRAAdapter:
    """An adapter from its tensors in PEFT's names (`...q_proj.lora_A.weight` [r, in], with or
    without the `base_model.model.` prefix; numpy or JAX arrays) and its adapter_config.json's
    fields, checked as `read_adapter` checks a directory's; or LoRAError."""
    where = f"LoRA adapter {request.lora_name!r}" + (f" ({request.lora_path})" if request.lora_path else "")
    _check_config(config, where)
    scale_of = _scaling(config)
    pairs = _pairs(tensors, where)
    too_big = sorted(m for m, (a, _) in pairs.items() if a.shape[0] > max_rank)
    if too_big:
        rank = pairs[too_big[0]][0].shape[0]
        raise LoRAError(f"{where}: rank {rank} exceeds max_lora_rank={max_rank} ({too_big[0]})")
    sources = linear_sources(geometry.cfg, has=lambda name: name.removesuffix(".weight") in pairs)
    layers, used = [], set()
    for layer_sources, layer_geometry in zip(sources, geometry.layers):
        layer = {}
        for matrix, source in layer_sources.items():
            if any(m in pairs for m in source.modules):
                layer[matrix] = _fuse(layer_geometry[matrix], source, pairs, scale_of, block_rank, where)
                used.update(m for m in source.modules if m in pairs)
        layers.append(layer)
    unknown = sorted(set(pairs) - used)
    if unknown:
        raise LoRAError(
            f"{where}: adapts modules this model has no adaptable Linear for (only the layers' attention and "
            f"MLP projections are supported; not embeddings, the LM head or routed experts): {', '.join(unknown[:4])}"
        )
    return LoRAAdapter(request, max(a.shape[0] for a, _ in pairs.values()), layers, dict(config), version)


def _read_config(path: str, where: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{where}: no {CONFIG_FILE} (a PEFT adapter directory is expected)") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{where}: cannot read {CONFIG_FILE}: {e}") from None
    return config


def _check_config(config, where: str) -> None:
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    refusals = [
        (peft_type != "LORA", f"only LoRA adapters are served, not {peft_type}"),
        (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r}) are not supported"),
        (bool(config.get("modules_to_save")), "adapters that save whole modules (modules_to_save) are not supported"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D) adapters are not supported"),
    ]
    for bad, reason in refusals:
        if bad:
            raise LoRAError(f"{where}: {reason}")


def _scaling(config: dict):
    """module name -> PEFT's scale for it: lora_alpha (or its alpha_pattern entry) over r (rsLoRA: sqrt r)."""
    alpha, patterns = config.get("lora_alpha", 8), config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))

    def scale(module: str, rank: int) -> float:
        a = next((v for k, v in patterns.items() if re.fullmatch(rf"(.*\.)?({k})", module)), alpha)
        return a / math.sqrt(rank) if rslora else a / rank

    return scale


def _read_tensors(path: str, where: str) -> dict[str, np.ndarray]:
    """The tensors of a directory's adapter_model.safetensors, float32."""
    from safetensors import safe_open

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = (
            " (only safetensors adapters are read, not adapter_model.bin)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise LoRAError(f"{where}: no {WEIGHTS_FILE}{other}")
    try:
        with safe_open(file, framework="flax") as f:
            return {key: np.asarray(f.get_tensor(key), np.float32) for key in f.keys()}
    except Exception as e:  # noqa: BLE001  (safetensors' errors for a truncated or corrupt file)
        raise LoRAError(f"{where}: cannot read {WEIGHTS_FILE} (truncated or corrupt): {e}") from None


def _pairs(tensors, where: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module name -> (A [r, in], B [out, r]) float32, from tensors in PEFT's names."""
    parts: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, value in tensors.items():
        name = key.removeprefix(_PREFIX)
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", name)
        if match is None:
            kind = "embedding LoRA" if "lora_embedding" in name else "DoRA" if "magnitude" in name else "tensor"
            raise LoRAError(f"{where}: unsupported {kind} {key!r}")
        parts[match.group(1)][match.group(2)] = np.asarray(value, np.float32)
    if not parts:
        raise LoRAError(f"{where}: holds no LoRA tensors")
    pairs = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: {module} has lora_{'A' if 'B' in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{where}: {module}: lora_A {a.shape} and lora_B {b.shape} are not a rank-r pair")
        pairs[module] = (a, b)
    return pairs


def _fuse(slot: MatrixSlot, source: LinearSource, pairs, scale_of, block_rank: int, where: str):
    """(a [in, blocks * R], b [blocks * R, out]) of one fused matrix (see the module doc). The
    slot's blocks are the base checkpoint's Linears; the adapter's may fuse several of them
    (Phi-3's qkv_proj): its A then serves each of their blocks."""
    R, out = block_rank, len(source.rows)
    a = np.zeros((source.in_dim, slot.blocks * R), np.float32)
    b = np.zeros((slot.blocks * R, out), np.float32)
    for k in range(slot.blocks):
        columns = np.flatnonzero(slot.block_of == k)
        ids = np.unique(source.module_of[columns])
        if not any(source.modules[m] in pairs for m in ids):
            continue
        if len(ids) > 1:
            names = ", ".join(source.modules[m] for m in ids)
            raise LoRAError(f"{where}: {names} each cover part of one of the base model's Linears: not supported")
        module = source.modules[ids[0]]
        A, B = pairs[module]
        r, rows = A.shape[0], int(np.sum(source.module_of == ids[0]))
        if A.shape[1] != source.in_dim or B.shape[0] != rows:
            raise LoRAError(
                f"{where}: {module} is [{B.shape[0]}, {A.shape[1]}] in the adapter, [{rows}, {source.in_dim}] in "
                "the base model: the adapter was trained for another model"
            )
        a[:, k * R : k * R + r] = A.T
        b[k * R : k * R + r, columns] = scale_of(module, r) * B[source.rows[columns]].T
    return a, b


class AdapterCache:
    """Adapters read for one engine, the `capacity` most recently used kept in host memory
    (`max_cpu_loras`); a request holds its adapter while it runs, whatever the cache drops.
    Adapters whose weights were given in memory (`update`) are always kept: no file has them."""

    def __init__(self, geometry: LoRAGeometry, max_rank: int, block_rank: int, capacity: int, prepare=None):
        """`max_rank`: the highest rank accepted; `block_rank`: a slot's block width (>= max_rank);
        `prepare(adapter)`: run on each adapter once read (`LoRASlots.prepare`)."""
        self.geometry, self.max_rank, self.block_rank, self.capacity = geometry, max_rank, block_rank, capacity
        self.prepare = prepare or (lambda adapter: None)
        self._adapters: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._requests: dict[int, LoRARequest] = {}  # every adapter added, by id (read again if dropped)
        self._in_memory: dict[int, LoRAAdapter] = {}  # those given by `update`, never dropped
        self._lock = threading.Lock()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request`, read (and checked) unless cached. LoRAError if it cannot be
        served or its id belongs to another adapter."""
        with self._lock:
            self._check_id(request)
            if request.lora_int_id in self._in_memory:
                return self._in_memory[request.lora_int_id]
            adapter = self._adapters.get(request.lora_int_id)
            if adapter is not None:
                self._adapters.move_to_end(request.lora_int_id)
                return adapter
        adapter = read_adapter(request, self.geometry, self.max_rank, self.block_rank)  # off the lock: disk reads
        self.prepare(adapter)
        with self._lock:
            self._requests[request.lora_int_id] = request
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        return adapter

    def update(self, request: LoRARequest, tensors, config: dict | None = None) -> LoRAAdapter:
        """Replace an adapter's weights by `tensors` (PEFT's names: `adapter_from_tensors`), with
        its config unless `config` is given (a new adapter needs one); kept in memory from now
        on. The new LoRAAdapter has the next version. LoRAError (nothing changed) if they do not fit."""
        with self._lock:
            self._check_id(request)
            old = self._in_memory.get(request.lora_int_id) or self._adapters.get(request.lora_int_id)
        if config is None:
            if old is None and not request.lora_path:
                raise LoRAError(f"LoRA adapter {request.lora_name!r} is new: give its config (lora_alpha, r, ...)")
            config = old.config if old is not None else _read_config(request.lora_path, repr(request.lora_name))
        version = 0 if old is None else old.version + 1
        adapter = adapter_from_tensors(
            request, tensors, config, self.geometry, self.max_rank, self.block_rank, version=version
        )
        self.prepare(adapter)
        with self._lock:
            self._requests[request.lora_int_id] = request
            self._adapters.pop(request.lora_int_id, None)
            self._in_memory[request.lora_int_id] = adapter
        return adapter

    def _check_id(self, request: LoRARequest) -> None:
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self._requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise LoRAError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}), "
                f"not {request.lora_name!r} ({request.lora_path})"
            )

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running under it finish with it). False if unknown."""
        with self._lock:
            self._adapters.pop(lora_int_id, None)
            self._in_memory.pop(lora_int_id, None)
            return self._requests.pop(lora_int_id, None) is not None

    def requests(self) -> list[LoRARequest]:
        """Every adapter added and not removed, in the order they were added."""
        with self._lock:
            return list(self._requests.values())
