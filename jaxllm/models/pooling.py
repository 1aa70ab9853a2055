"""Pooling: a sequence's hidden states -> one embedding, as the checkpoint says.

sentence-transformers checkpoints say it in `modules.json` (a `Pooling` module's directory with
its `config.json`: `pooling_mode_mean_tokens`, `pooling_mode_cls_token`, `pooling_mode_lasttoken`;
a `Normalize` module after it) and `sentence_bert_config.json` (`max_seq_length`). A decoder used
as an embedder has no such files: its pooling is chosen by option (last token or mean).

`pool` works on a step's ragged rows (each sequence's tokens one after another, as the engine's
steps and `query_start_loc` lay them out), in fixed shapes, so it jits once per step shape.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' Pooling config keys for the modes jaxllm computes.
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How hidden states become an embedding: `mode` (mean over the sequence's tokens, its
    first token's state (CLS) or its last one's), `normalize` (to unit L2 norm), and the longest
    input the checkpoint was trained on (`max_seq_length`, None if it does not say)."""

    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, not {self.mode!r}")


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


def pool(hidden: jax.Array, query_start_loc: jax.Array, num_seqs, config: PoolingConfig) -> jax.Array:
    """hidden [T, H] f32, the rows of sequence s at [query_start_loc[s], query_start_loc[s + 1])
    -> [S, H] f32 (S = len(query_start_loc) - 1; rows of s >= num_seqs are zeros)."""
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    real = jnp.arange(starts.shape[0]) < num_seqs
    if config.mode == "cls":
        out = hidden[jnp.clip(starts, 0, hidden.shape[0] - 1)]
    elif config.mode == "last":
        out = hidden[jnp.clip(ends - 1, 0, hidden.shape[0] - 1)]
    else:
        token = jnp.arange(hidden.shape[0])
        seq = jnp.searchsorted(ends, token, side="right")  # each row's sequence (S past the last)
        sums = jax.ops.segment_sum(hidden, seq, num_segments=starts.shape[0] + 1)[:-1]
        out = sums / jnp.maximum(ends - starts, 1)[:, None].astype(hidden.dtype)
    if config.normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return jnp.where(real[:, None], out, 0.0)


__all__ = ["POOLING_MODES", "PoolingConfig", "checkpoint_pooling", "pool"]
