"""A trainer's forward over the engine's parameter tree: logits and token logprobs, differentiable.

For training loops that sample with the engine and update the same weights (RL, GRPO-style):
the logprobs a trainer computes here are the ones the engine reports for the same tokens,
because both run the same decoder code over the same params pytree (`checkpoint.build_params`,
or `loader.load_model(path, dtype="float32").params`):

- shared with the engine: `decoder.embed`, `decoder.decoder_layer` (every family's norms, MLPs,
  QK-norm, RoPE variants, sliding windows, MoE routing) and `decoder.compute_logits`, and the
  RoPE tables of `decoder.rope_tables`;
- different: attention is dense causal attention over each whole sequence (`DenseAttention`,
  no pages, no KV cache: `write_kv` hands this step's keys and values straight to `forward`),
  every row is computed (no bucket padding), norms run in `jnp` (no C++ kernels) and the
  weights must be plain float arrays: a `PackedWeight` (C++ panels) or `QuantizedWeight`
  (integer codes) leaf has no gradient and raises a TypeError naming its path.

The API, each a pure function of (params, token ids) with `cfg` (and `temperature`) static:
jit them with `static_argnames=("cfg", "temperature")` and `jax.grad` them with respect to params:

    forward(params, token_ids, cfg, positions=None) -> logits [..., T, vocab] f32
    token_logprobs(params, token_ids, cfg, temperature=None) -> [..., T - 1] f32
    sequence_logprobs(params, prompt_ids, completion_ids, cfg, temperature=None) -> [..., C] f32

token_ids: [T] or [B, T] int32 (a batch is vmapped, each row its own sequence). Rows of a
batch share T: right-pad the shorter ones (attention is causal, so padding after a token
changes nothing at or before it) and ignore the padded positions' logprobs. Attention holds
the [heads, T, T] scores of a sequence at once: meant for training lengths, not long contexts.

How close the engine's reported logprobs come (tests/models/test_training_forward.py, the tiny
float32 Llama): within float32 rounding (measured up to 2.7e-5, each side as far from a float64
run) with float32 KV pages. bf16 pages, which `kv_cache_dtype="auto"` gives a float32 model only
where dtype "auto" picked float32 (a CPU without bf16 dots), round every cached key and value:
up to 0.07 there, so a trainer computing importance ratios wants `kv_cache_dtype="float32"`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.reference import mask_scores
from jaxllm.models import decoder
from jaxllm.models.decoder import ModelConfig


@dataclasses.dataclass(frozen=True)
class SequenceInputs:
    """What `decoder.decoder_layer` reads of a step's inputs, for one whole sequence of T tokens.

    token_ids, positions [T] int32; rope_cos, rope_sin [T, 1, W] f32 (W = len(cfg.inv_freq()):
    the decoder slices each layer's RoPE variant out of them)."""

    token_ids: jax.Array
    positions: jax.Array
    rope_cos: jax.Array
    rope_sin: jax.Array
    slot_mapping = None  # no pages to write into
    window_page_tables = None  # windowed layers attend over the same keys, masked

    def num_tokens(self):
        """None: every row is real (`linear.apply` computes all rows)."""
        return None


class DenseAttention:
    """Dense causal attention over one whole sequence, in the shape of an `AttentionBackend`
    (jaxllm/attention/base.py) as far as `decoder.decoder_layer` calls it."""

    name = "dense"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def write_kv(self, k_pages, v_pages, k, v, slot_mapping):
        """No pages: this step's k, v [T, kv_heads, head_dim] are the whole context."""
        return k, v

    def forward(self, q, k, v, inputs, *, sliding_window=None, sm_scale=None, causal=True):
        """q [T, q_heads, head_dim] over k, v [T, kv_heads, head_dim] -> [T, q_heads, head_dim].

        Query head h reads kv head h // (q_heads // kv_heads) (HF's `repeat_kv`). Token i sees
        tokens j <= i, and with a window only j > i - sliding_window (the mask of HF's eager
        attention, by order in the sequence, as `kernels/reference.py`'s oracle masks by
        position); not `causal` (an encoder), every token. Scores and softmax in float32."""
        num_tokens, num_q_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_q_heads // num_kv_heads
        sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
        s = jnp.einsum("tkgd,ckd->kgtc", qg, k.astype(jnp.float32)) * sm_scale  # [kv, group, T, T]
        order = jnp.arange(num_tokens, dtype=jnp.int32)
        rows = order[:, None] if causal else jnp.full((num_tokens, 1), num_tokens - 1, jnp.int32)
        s, _ = mask_scores(s, rows, order[None, :], sliding_window, None)
        p = jax.nn.softmax(s, axis=-1)  # the diagonal is always visible: no empty rows
        o = jnp.einsum("kgtc,ckd->tkgd", p, v.astype(jnp.float32))
        return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


DENSE_ATTENTION = DenseAttention()


def check_float_params(params) -> None:
    """Raise TypeError unless every leaf of params is a float array (no packed panels,
    quantized codes or other weight objects: their products have no gradient here)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
    for path, leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray)) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            what = type(leaf).__name__ if not hasattr(leaf, "dtype") else f"{type(leaf).__name__} of {leaf.dtype}"
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} is a {what}; the training forward takes float arrays only "
                "(load with loader.load_model(..., dtype='float32') and no quantization or panels)"
            )


def forward(params, token_ids, cfg: ModelConfig, positions=None) -> jax.Array:
    """Logits [..., T, vocab] f32 of every position of token_ids [T] or [B, T] int32.

    positions ([T] or [B, T], default 0 .. T - 1) feed RoPE or the learned position rows only;
    the causal mask is by order in the sequence (as HF's models take `position_ids`)."""
    if cfg.bidirectional:
        raise ValueError(f"{cfg.architecture} is an encoder without an LM head: use hidden_states")
    return _batched(functools.partial(_sequence_logits, params, cfg=cfg), params, token_ids, positions)


def hidden_states(params, token_ids, cfg: ModelConfig, positions=None) -> jax.Array:
    """The last layer's output [..., T, hidden] f32 (a decoder's before its final norm; an
    encoder's, what pooling reads). An encoder's rows attend to every token of their row: a
    batch's rows must all be real tokens (no padding)."""
    return _batched(functools.partial(_sequence_hidden, params, cfg=cfg), params, token_ids, positions)


def _batched(one, params, token_ids, positions):
    check_float_params(params)
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim not in (1, 2):
        raise ValueError(f"token_ids must be [T] or [B, T], got shape {token_ids.shape}")
    if positions is None:
        positions = jnp.arange(token_ids.shape[-1], dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), token_ids.shape)
    return one(token_ids, positions) if token_ids.ndim == 1 else jax.vmap(one)(token_ids, positions)


def _sequence_hidden(params, token_ids, positions, *, cfg: ModelConfig) -> jax.Array:
    """token_ids, positions [T] -> the last layer's output [T, hidden] f32."""
    rope_cos, rope_sin = decoder.rope_tables(positions, cfg.inv_freq())
    inputs = SequenceInputs(token_ids, positions, rope_cos, rope_sin)
    x = decoder.embed(params, token_ids, positions, cfg)
    for index, layer in enumerate(params["layers"]):
        x, _, _ = decoder.decoder_layer(layer, None, None, x, inputs, cfg, index=index, attention=DENSE_ATTENTION)
    return x


def _sequence_logits(params, token_ids, positions, *, cfg: ModelConfig) -> jax.Array:
    """token_ids, positions [T] -> logits [T, vocab] f32."""
    return decoder.compute_logits(params, _sequence_hidden(params, token_ids, positions, cfg=cfg), cfg)


def token_logprobs(params, token_ids, cfg: ModelConfig, *, temperature: float | None = None) -> jax.Array:
    """[..., T - 1] f32: entry t is log p(token_ids[t + 1] | token_ids[: t + 1]).

    temperature None: the model's raw distribution, which the engine reports as a sampled
    token's logprob (runner/sampler.py `sample`); a temperature > 0: that of logits /
    temperature, the distribution the engine draws from (before top-k/p and penalties)."""
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature must be None or > 0, got {temperature!r}")
    logits = forward(params, token_ids, cfg)[..., :-1, :]
    if temperature is not None:
        logits = logits / temperature
    targets = jnp.asarray(token_ids, jnp.int32)[..., 1:]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


def sequence_logprobs(
    params, prompt_ids, completion_ids, cfg: ModelConfig, *, temperature: float | None = None
) -> jax.Array:
    """The logprobs [..., C] f32 of completion_ids [C] (or [B, C]) after prompt_ids [P]
    (or [B, P], P >= 1): `token_logprobs` of the concatenation, its last C entries."""
    prompt_ids, completion_ids = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(completion_ids, jnp.int32)
    if prompt_ids.shape[-1] < 1:
        raise ValueError("prompt_ids must hold at least one token")
    token_ids = jnp.concatenate([prompt_ids, completion_ids], axis=-1)
    return token_logprobs(params, token_ids, cfg, temperature=temperature)[..., prompt_ids.shape[-1] - 1 :]


__all__ = [
    "DenseAttention",
    "SequenceInputs",
    "check_float_params",
    "forward",
    "sequence_logprobs",
    "token_logprobs",
]
