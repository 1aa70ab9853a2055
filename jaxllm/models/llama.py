"""The Llama family (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3) as pure JAX functions.

One definition covers the family through `ModelSpec`, built from the HF config:
Qwen2 adds a bias to the fused QKV projection, Qwen3 RMS-normalises q and k per head,
Llama 3 rescales the RoPE frequencies. Anything else in a config that would change the
math (a sliding window, another RoPE scaling type) is rejected by `registry.py`.

Params pytree (weights stored `[in, out]` so activations multiply on the left):

    embed:      [vocab, hidden]
    layers:     list of per-layer dicts (an unrolled loop; see runner/model_runner.py)
      attn_norm:  [hidden] f32
      wqkv:       [hidden, (q_heads + 2 * kv_heads) * head_dim]   (q, k, v fused)
      bqkv:       [(q_heads + 2 * kv_heads) * head_dim] f32        (Qwen2 only)
      q_norm, k_norm: [head_dim] f32                               (Qwen3 only)
      wo:         [q_heads * head_dim, hidden]
      mlp_norm:   [hidden] f32
      w_gate_up:  [hidden, 2 * intermediate]                       (gate, up fused)
      w_down:     [intermediate, hidden]
    final_norm: [hidden] f32
    lm_head:    [hidden, vocab]   (absent when the embeddings are tied)

Matrix weights are float32 or bfloat16; activations stay float32 and, with bf16 weights,
are cast to bf16 only as dot operands with float32 accumulation (XLA:CPU runs that natively;
a bf16-output dot converts the whole weight to f32 on every call). On one CPU device with the
native kernels, float32 matrices are replaced once by `PackedWeight`s (`pack_params`), which
`matmul` multiplies with the C++ GEMM of kernels/csrc/gemm.cc.

Tensor parallelism (Megatron layout; jaxllm/parallel.py runs it under `shard_map`):
`TP_SPLIT_DIMS` says which dimension of each parameter is split over the "model" mesh axis
(column-parallel wqkv and w_gate_up, row-parallel wo and w_down, vocabulary-parallel embed and
lm_head; the rest replicated). `tp_layout` regroups the fused columns so that each shard's
slice holds its own heads' q, k, v (and its gate, up), with KV heads repeated when there are
fewer than shards. Each shard then runs this same code with `tp_local_spec`'s head counts and
`axis` set: the row-parallel outputs and the embedding are summed over the axis (`psum`), the
logits gathered.

Pipeline parallelism: `shard_layout` also stacks the layers of each of `pp` stages (layer slot
i of every stage in one `[pp, ...]` array, split over the "stage" axis); each stage's shards
run `decoder_layer` on their slots (parallel.py, `pipelined_forward`), with the vocabulary split
over stages and shards together.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np



@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Static shape and math options of a Llama-family model (hashable: a jit static arg)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Llama 3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    llama3_rope_scaling: tuple[float, float, float, int] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies `[head_dim // 2]` float32, with Llama 3 scaling if set."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.llama3_rope_scaling is not None:
            factor, low, high, orig = self.llama3_rope_scaling
            low_wavelen, high_wavelen = orig / low, orig / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (orig / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedWeight:
    """A float32 weight [in, out] packed once into 16-column panels `[out / 16, in, 16]`
    (`kernels.native.pack_weight`) for the C++ GEMM: XLA:CPU's dot repacks its weight on every
    call, most of a dot's time at decode batch sizes. A packed embedding table serves both the
    lookup (`embed`) and the tied LM head."""

    panels: jax.Array


def matmul(x: jax.Array, w) -> jax.Array:
    """`x [..., in] f32 @ w [in, out]` with f32 accumulation, in the weight's dtype."""
    if isinstance(w, PackedWeight):
        from jaxllm.kernels import native

        return native.matmul_packed(x, w.panels)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


# The layer matrices `pack_params` packs (besides the LM head, or the embedding table when tied).
PACKED = ("wqkv", "wo", "w_gate_up", "w_down")


def pack_params(params, spec: ModelSpec, device):
    """Replace, in place, each float32 matrix of `params` (no shard layout) by its
    `PackedWeight` on `device`, one matrix at a time: the extra memory is one matrix at most
    (packing the whole tree, then placing it, held each matrix up to three times). Matrices whose
    output size is not a multiple of 16 stay as they are. Returns `params`."""
    from jaxllm.kernels import native

    def pack(w, transposed=False):
        if isinstance(w, PackedWeight) or w.dtype != jnp.float32 or not native.packable(w.shape, transposed):
            return w
        return PackedWeight(jax.device_put(native.pack_weight(np.asarray(w), transposed), device))

    for layer in params["layers"]:
        for name in PACKED:
            layer[name] = pack(layer[name])
    if "lm_head" in params:
        params["lm_head"] = pack(params["lm_head"])
    if spec.tie_word_embeddings:  # the table is the LM head too
        params["embed"] = pack(params["embed"], transposed=True)
    return params


def rope_tables(positions, inv_freq, xp=jnp):
    """cos, sin `[T, 1, head_dim // 2]` f32 for positions [T], with `xp` = jnp or numpy.

    The runner computes them on the host (numpy) and passes them in the step inputs
    (`rope_cos`, `rope_sin`): inside the step XLA re-fused sin/cos into every layer's q and k
    (60 recomputations a step for a 30-layer model, ~2% of the run)."""
    freqs = xp.asarray(positions).astype(xp.float32)[:, None] * xp.asarray(inv_freq)[None, :]
    return xp.cos(freqs)[:, None, :], xp.sin(freqs)[:, None, :]


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """HF-style (rotate-half) RoPE. x: [T, heads, head_dim], rope: `rope_tables(...)`."""
    cos, sin = rope
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _reduce(x: jax.Array, axis: str | None) -> jax.Array:
    """Sum a row-parallel partial result over the tensor-parallel axis (nothing without one)."""
    return x if axis is None else jax.lax.psum(x, axis)


def decoder_layer(layer, k_pages, v_pages, x, inputs, spec: ModelSpec, *, attention, axis: str | None = None):
    """One decoder layer over x [T, hidden] f32 (`inputs`: the step's `StepInputs`,
    `attention`: its `AttentionBackend`, `axis`: the tensor-parallel mesh axis when run per
    shard). Returns (x, k_pages, v_pages)."""
    num_tokens = x.shape[0]
    h = rms_norm(x, layer["attn_norm"], spec.rms_norm_eps)
    qkv = matmul(h, layer["wqkv"])
    if spec.qkv_bias:
        qkv = qkv + layer["bqkv"]
    q = qkv[:, : spec.q_size].reshape(num_tokens, spec.num_heads, spec.head_dim)
    k = qkv[:, spec.q_size : spec.q_size + spec.kv_size].reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
    v = qkv[:, spec.q_size + spec.kv_size :].reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = rms_norm(q, layer["q_norm"], spec.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], spec.rms_norm_eps)
    rope = (inputs.rope_cos, inputs.rope_sin)
    q = apply_rope(q, rope)
    k = apply_rope(k, rope)
    k_pages, v_pages = attention.write_kv(k_pages, v_pages, k, v, inputs.slot_mapping)
    o = attention.forward(q, k_pages, v_pages, inputs)
    x = x + _reduce(matmul(o.reshape(num_tokens, spec.q_size), layer["wo"]), axis)
    h = rms_norm(x, layer["mlp_norm"], spec.rms_norm_eps)
    gate, up = jnp.split(matmul(h, layer["w_gate_up"]), 2, axis=-1)
    x = x + _reduce(matmul(jax.nn.silu(gate) * up, layer["w_down"]), axis)
    return x, k_pages, v_pages


def embed(params, token_ids: jax.Array, axis: str | None = None) -> jax.Array:
    """Embedding rows [T, hidden] f32; with `axis`, each shard holds a slice of the vocabulary
    and contributes the rows it has (zeros elsewhere), summed over the axis."""
    table = params["embed"]
    if isinstance(table, PackedWeight):  # [vocab / 16, hidden, 16]: token t is column t % 16 of panel t // 16
        return table.panels[token_ids // 16, :, token_ids % 16]
    if axis is None:
        return table[token_ids].astype(jnp.float32)
    rows = table.shape[0]
    local = token_ids - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)].astype(jnp.float32), 0.0)
    return jax.lax.psum(x, axis)


def forward(params, kv_cache, inputs, spec: ModelSpec, *, attention, axis: str | None = None):
    """Run the transformer over a flattened ragged batch.

    kv_cache: list over layers of `(k_pages, v_pages)`, each
        `[num_kv_heads, num_pages, page_size, head_dim]` (bf16 caches stored as uint16 bits).
    inputs: the step's `StepInputs` (runner/input_batch.py: token ids, positions, slot mapping,
        RoPE tables, block tables, ...); attention: an `AttentionBackend` (jaxllm/attention.py).
    Returns `(hidden [T, hidden] f32, new kv_cache)`. Layers run as an unrolled loop; see
    runner/model_runner.py for why not `lax.scan`. With `axis`, this is one tensor-parallel
    shard's part (see the module docstring).
    """
    x = embed(params, inputs.token_ids, axis)
    new_cache = []
    for layer, (k_pages, v_pages) in zip(params["layers"], kv_cache):
        x, k_pages, v_pages = decoder_layer(layer, k_pages, v_pages, x, inputs, spec, attention=attention, axis=axis)
        new_cache.append((k_pages, v_pages))
    return x, new_cache


def compute_logits(params, hidden: jax.Array, spec: ModelSpec, axis: str | None = None) -> jax.Array:
    """hidden: [N, hidden] f32 -> logits [N, vocab] f32 (final norm + LM head). With `axis`,
    each shard computes its slice of the vocabulary and the slices are gathered."""
    h = rms_norm(hidden, params["final_norm"], spec.rms_norm_eps)
    if spec.tie_word_embeddings:
        # Contract against embed [vocab, hidden] directly: `jnp.dot(h, embed.T)` materialised
        # the transpose on every call on XLA:CPU (4-20x slower).
        w = params["embed"]
        if isinstance(w, PackedWeight):  # packed as the LM head: [vocab / 16, hidden, 16]
            logits = matmul(h, w)
        else:
            logits = jnp.einsum("sh,vh->sv", h.astype(w.dtype), w, preferred_element_type=jnp.float32)
    else:
        logits = matmul(h, params["lm_head"])
    return logits if axis is None else jax.lax.all_gather(logits, axis, axis=1, tiled=True)


# ----------------------------------------------------------------------------- tensor parallelism

# Which dimension of each parameter (by name, in a layer or at the top) is split over the
# tensor-parallel axis; parameters not listed are replicated.
TP_SPLIT_DIMS = {"embed": 0, "lm_head": 1, "wqkv": 1, "bqkv": 0, "wo": 0, "w_gate_up": 1, "w_down": 0}


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError if `spec` cannot be split `tp` ways."""
    problems = []
    if spec.num_heads % tp:
        problems.append(f"{spec.num_heads} attention heads")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        problems.append(f"{spec.num_kv_heads} KV heads (neither a multiple nor a divisor of {tp})")
    if spec.intermediate_size % tp:
        problems.append(f"intermediate size {spec.intermediate_size}")
    if spec.vocab_size % tp:
        problems.append(f"vocabulary size {spec.vocab_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide this model's " + ", ".join(problems))


def kv_heads_for(spec: ModelSpec, tp: int) -> int:
    """KV heads stored over all shards: the model's, or `tp` when it has fewer (each shard then
    holds a copy of the one head its query heads use)."""
    return max(spec.num_kv_heads, tp)


def tp_local_spec(spec: ModelSpec, tp: int, pp: int = 1) -> ModelSpec:
    """The spec one shard computes with (`pp` > 1: one pipeline stage's shard, with its layers
    and its slice of the vocabulary, which is split over stages and shards together)."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=kv_heads_for(spec, tp) // tp,
                               intermediate_size=spec.intermediate_size // tp, vocab_size=spec.vocab_size // (tp * pp),
                               num_layers=spec.num_layers // pp)


def tp_layout(params, spec: ModelSpec, tp: int):
    """`params` with the fused columns regrouped per shard (see the module docstring), as host
    (numpy) arrays; any `tp` passing `check_tensor_parallel`. tp 1 returns `params` unchanged."""
    if tp == 1:
        return params
    check_tensor_parallel(spec, tp)
    repeat = kv_heads_for(spec, tp) // spec.num_kv_heads
    hd = spec.head_dim

    def qkv_columns(w):            # [..., (q + 2 kv) * hd] -> the same, grouped [q_s, k_s, v_s] per shard
        q, k, v = np.split(w, [spec.q_size, spec.q_size + spec.kv_size], axis=-1)
        k, v = (np.repeat(t.reshape(*t.shape[:-1], spec.num_kv_heads, hd), repeat, axis=-2)
                .reshape(*t.shape[:-1], -1) for t in (k, v))
        return _interleave([q, k, v], tp)

    def layer_layout(layer):
        out = dict(layer)
        out["wqkv"] = qkv_columns(layer["wqkv"])
        if "bqkv" in layer:
            out["bqkv"] = qkv_columns(layer["bqkv"])
        out["w_gate_up"] = _interleave(np.split(layer["w_gate_up"], 2, axis=-1), tp)
        return out

    return {**params, "layers": [layer_layout(layer) for layer in params["layers"]]}


# ----------------------------------------------------------------------------- pipeline parallelism


def check_pipeline_parallel(spec: ModelSpec, tp: int, pp: int) -> None:
    """Raise ValueError if `spec` cannot be split into `pp` stages of `tp` shards."""
    problems = []
    if spec.num_layers % pp:
        problems.append(f"{spec.num_layers} layers")
    if spec.vocab_size % (tp * pp):
        problems.append(f"vocabulary size {spec.vocab_size} (split over tensor x pipeline = {tp * pp} devices)")
    if problems:
        raise ValueError(f"pipeline_parallel_size={pp} does not divide this model's " + ", ".join(problems))


def shard_layout(params, spec: ModelSpec, tp: int = 1, pp: int = 1):
    """`params` laid out for `tp` tensor-parallel shards (`tp_layout`) and `pp` pipeline stages:
    with pp > 1, "layers" becomes a list of the `num_layers // pp` layer slots of a stage, each
    array stacked `[pp, ...]` over the stages (stage s, slot i = layer s * num_layers // pp + i),
    so that the "stage" mesh axis splits the stacked dimension. Host (numpy) arrays."""
    params = tp_layout(params, spec, tp)
    if pp == 1:
        return params
    check_pipeline_parallel(spec, tp, pp)
    per_stage = spec.num_layers // pp
    layers = params["layers"]
    return {**params, "layers": [{name: np.stack([np.asarray(layers[s * per_stage + i][name]) for s in range(pp)])
                                  for name in layers[i]} for i in range(per_stage)]}


def _interleave(parts, tp: int):
    """Concatenate, along the last axis, shard s's slice of every part, for s in order."""
    chunks = [np.split(part, tp, axis=-1) for part in parts]
    return np.concatenate([chunk[s] for s in range(tp) for chunk in chunks], axis=-1)
