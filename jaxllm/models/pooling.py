"""Pooling: a sequence's hidden states -> one embedding, as the checkpoint says.

sentence-transformers checkpoints say it in `modules.json` (a `Pooling` module's directory with
its `config.json`: `pooling_mode_mean_tokens`, `pooling_mode_cls_token`, `pooling_mode_lasttoken`;
a `Normalize` module after it) and `sentence_bert_config.json` (`max_seq_length`). A decoder used
as an embedder has no such files: its pooling is chosen by option (last token or mean).

A pooling engine's step computes each sequence's share on the device (`chunk_parts`, over the
step's ragged rows as `query_start_loc` lays them out); the scheduler merges the shares of a
prompt computed in chunks (`PoolingConfig.merge`, `finish`), and each request's embedding is
cut and normalized as it asks (`embedding`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' Pooling config keys for the modes jaxllm computes.
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How hidden states become an embedding: `mode` (mean over the sequence's tokens, its
    first token's state (CLS) or its last one's), `normalize` (to unit L2 norm), the longest
    input the checkpoint was trained on (`max_seq_length`, None if it does not say), and the
    embedding sizes it was trained to be cut to (`matryoshka`: None where it was not, () for
    any size, else the sizes)."""

    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None
    matryoshka: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, not {self.mode!r}")

    def merge(self, pooled: np.ndarray | None, part: np.ndarray) -> np.ndarray:
        """A sequence's pooled state so far (None before its first chunk) with the `chunk_parts`
        row of its next chunk."""
        if pooled is None or self.mode == "last":
            return part
        return pooled + part if self.mode == "mean" else pooled

    def finish(self, pooled: np.ndarray, num_tokens: int) -> np.ndarray:
        """The merged state of a sequence of `num_tokens` tokens -> its pooled state [H] (the
        mean divides the sum; normalizing is per request: `embedding`)."""
        return pooled / num_tokens if self.mode == "mean" else pooled


def checkpoint_pooling(model_dir: str) -> PoolingConfig | None:
    """The pooling a sentence-transformers directory declares, or None where it declares none.
    Raises ValueError for a pooling jaxllm does not compute (max, mean-sqrt-len, several at once)."""
    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in kinds:
        return None
    with open(os.path.join(model_dir, kinds["Pooling"].get("path", ""), "config.json")) as f:
        config = json.load(f)
    unsupported = [key for key in _ST_UNSUPPORTED if config.get(key)]
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    if unsupported or len(modes) != 1:
        raise ValueError(
            f"{model_dir}: pooling {sorted(k for k in (*_ST_MODES, *_ST_UNSUPPORTED) if config.get(k))} "
            f"is not supported (one of {', '.join(_ST_MODES)})"
        )
    max_len = None
    st_config = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(st_config):
        with open(st_config) as f:
            max_len = json.load(f).get("max_seq_length")
    return PoolingConfig(modes[0], normalize="Normalize" in kinds, max_seq_length=max_len)


def resolve_pooling(source: str, cfg, pooler_config: dict | str | None = None) -> PoolingConfig:
    """A pooling engine's pooling: what the checkpoint directory `source` declares
    (`checkpoint_pooling`), else CLS for an encoder and the last token for a decoder, normalized;
    then `pooler_config` (EngineArgs, vLLM's keys: "pooling_type", "normalize") over it."""
    model_dir = source if os.path.isdir(source) else None
    config = (checkpoint_pooling(model_dir) if model_dir else None) or PoolingConfig(
        "cls" if cfg.bidirectional else "last"
    )
    matryoshka = _checkpoint_matryoshka(model_dir) if model_dir else None
    overrides = json.loads(pooler_config) if isinstance(pooler_config, str) else dict(pooler_config or {})
    unknown = set(overrides) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {sorted(unknown)} (known: pooling_type, normalize)")
    mode = str(overrides.get("pooling_type", config.mode)).lower()
    normalize = overrides.get("normalize", config.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    if mode not in POOLING_MODES:
        raise ValueError(
            f"pooler_config: pooling_type must be one of MEAN, CLS, LAST, got {overrides['pooling_type']!r}"
        )
    return dataclasses.replace(config, mode=mode, normalize=normalize, matryoshka=matryoshka)


def _checkpoint_matryoshka(model_dir: str) -> tuple[int, ...] | None:
    """The embedding sizes config.json says the model was trained for (vLLM's keys
    `matryoshka_dimensions`, `is_matryoshka`), as `PoolingConfig.matryoshka`."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    if config.get("matryoshka_dimensions"):
        return tuple(int(d) for d in config["matryoshka_dimensions"])
    return () if config.get("is_matryoshka") else None


def chunk_parts(hidden: jax.Array, query_start_loc: jax.Array, mode: str) -> jax.Array:
    """The device's share of pooling, for one step: hidden [T, H] f32, the rows of the step's
    sequence s at [query_start_loc[s], query_start_loc[s + 1]) -> [S, H] f32, per sequence the
    sum of its rows (mode "mean"), its first row ("cls") or its last ("last"); S =
    len(query_start_loc) - 1, and an empty (padding) sequence gets zeros. A prompt computed
    over several steps (chunked) has a part from each, which `PoolingConfig.merge` combines."""
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    empty = (ends <= starts)[:, None]
    if mode == "cls":
        out = hidden[jnp.clip(starts, 0, hidden.shape[0] - 1)]
    elif mode == "last":
        out = hidden[jnp.clip(ends - 1, 0, hidden.shape[0] - 1)]
    else:
        token = jnp.arange(hidden.shape[0])
        seq = jnp.searchsorted(ends, token, side="right")  # each row's sequence (S past the last)
        out = jax.ops.segment_sum(hidden, seq, num_segments=starts.shape[0] + 1)[:-1]
    return jnp.where(empty, 0.0, out)


def embedding(pooled: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """A sequence's pooled state [H] -> the embedding a caller gets: its first `dimensions`
    entries (Matryoshka truncation), then scaled to unit L2 norm with `normalize`."""
    out = np.asarray(pooled, np.float32)[:dimensions]
    if normalize:
        out = out / max(float(np.linalg.norm(out)), 1e-12)
    return out


__all__ = ["POOLING_MODES", "PoolingConfig", "checkpoint_pooling", "chunk_parts", "embedding", "resolve_pooling"]
