"""One decoder for every supported family, as pure JAX functions over a params pytree.

The families differ only in data (`ModelConfig`, built from the HF config by `registry.py`):

| what                        | cfg field                   | families                               |
|-----------------------------|------------------------------|----------------------------------------|
| RMSNorm / LayerNorm + bias  | `norm`                       | LayerNorm: OPT, GPT-NeoX, Falcon       |
| gated MLP (act(gate) * up)  | `gated_mlp`, `hidden_act`    | not gated: OPT (relu), NeoX/Falcon (gelu) |
| biases                      | `qkv_bias`, `attn_out_bias`, `mlp_bias` | Qwen2 (qkv), OPT, NeoX      |
| parallel attention + MLP    | `parallel_residual`          | GPT-NeoX, Falcon                       |
| rotary on part of each head | `rotary_dim`                 | GPT-NeoX (Pythia: 1/4), Phi-3/4        |
| learned absolute positions  | `position="learned"`         | OPT                                    |
| QK-norm                     | `qk_norm`                    | Qwen3, Qwen3-MoE, Gemma 3              |
| norms after attention / MLP | `sandwich_norm`              | Gemma 3                                |
| scaled embeddings, softmax scale | `embed_scale`, `attn_scale` | Gemma 3                             |
| sliding window per layer, local RoPE base | `layer_windows`, `local_rope_theta` | Mistral, Phi-3, Gemma 3 |
| routed experts              | `num_experts`, ... (moe.py)  | Mixtral, Qwen3-MoE                     |

Multi-query and grouped-query attention need no field: `num_kv_heads` may be anything that
divides `num_heads`. Gemma's `(1 + w)` RMSNorm weights are stored as `1 + w` at load time.

Params pytree (weights stored `[in, out]` so activations multiply on the left):

    embed:      [vocab, hidden]
    pos_embed:  [max_positions, hidden]                        (learned positions only)
    layers:     list of per-layer dicts (an unrolled loop; see runner/model_runner.py)
      attn_norm (+ attn_norm_bias):  [hidden] f32
      wqkv:       [hidden, (q_heads + 2 * kv_heads) * head_dim]   (q, k, v fused)
      bqkv:       [(q_heads + 2 * kv_heads) * head_dim] f32       (qkv_bias)
      q_norm, k_norm: [head_dim] f32                              (qk_norm)
      wo (+ bo):  [q_heads * head_dim, hidden]
      post_attn_norm: [hidden] f32                                (sandwich_norm)
      mlp_norm (+ mlp_norm_bias): [hidden] f32
      w_gate_up (+ b_gate_up): [hidden, 2 * intermediate]         (gated: gate, up fused)
      w_up (+ b_up): [hidden, intermediate]                       (not gated)
      w_down (+ b_down): [intermediate, hidden]
      post_mlp_norm: [hidden] f32                                 (sandwich_norm)
      router, experts_gate_up, experts_down                       (MoE layers: moe.py)
    final_norm (+ final_norm_bias): [hidden] f32
    lm_head:    [hidden, vocab]   (absent when the embeddings are tied)

Matrix weights are float32 or bfloat16; activations stay float32 and, with bf16 weights,
are cast to bf16 only as dot operands with float32 accumulation (XLA:CPU runs that in hardware;
a bf16-output dot converts the whole weight to f32 on every call). Every linear is applied
through `linear.apply(w, x)`: what a weight is (a float array, C++ panels, quantized codes)
was decided once by the weight plan (jaxllm/weights/plan.py) and applies itself (models/linear.py).

Sharding: `layout.py` lays the params out for tensor and pipeline parallelism; each shard runs
this same code with its local cfg and `axis` set to the tensor-parallel mesh axis, over which
the row-parallel outputs and the embedding are summed (`psum`) and the logits gathered.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.lora import layers as lora_layers
from jaxllm.models import linear, moe

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shapes and math options of a model (hashable: a jit static arg). The defaults
    are Llama's."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Llama 3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    llama3_rope_scaling: tuple[float, float, float, int] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    norm: str = "rms"  # "rms" | "layer" (LayerNorm with bias)
    hidden_act: str = "silu"  # a key of ACTIVATIONS
    gated_mlp: bool = True
    mlp_bias: bool = False
    attn_out_bias: bool = False
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x))
    sandwich_norm: bool = False  # norms on the attention and MLP outputs too
    post_norm: bool = False  # BERT: x = norm(x + attn(x)), x = norm(x + mlp(x)); no final norm
    bidirectional: bool = False  # an encoder: every token attends to its whole sequence
    token_types: int = 0  # BERT: rows of its token type table (the first one is folded into pos_embed)
    position: str = "rope"  # "rope" | "learned" (pos_embed rows added to the embeddings)
    rotary_dim: int | None = None  # rotated dims of each head (None: all of head_dim)
    linear_rope_factor: float = 1.0  # positions divided by this (global layers)
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers, if theirs differs
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = global; () = all global
    embed_scale: float = 1.0
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    num_experts: int = 0  # > 0: the MLPs of `moe_layers` are routed experts (moe.py)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # which layers route (the others have a dense MLP)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_half(self) -> int:
        """Frequencies per RoPE table: half the rotated dims."""
        return (self.rotary_dim or self.head_dim) // 2

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window in tokens (a query at position p sees keys p - window
        + 1 .. p), or None for global attention."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    def rope_variant(self, layer: int) -> int:
        """Which of `inv_freq()`'s tables layer `layer` uses: 1 for windowed layers with their
        own base, else 0."""
        return int(self.local_rope_theta is not None and self.window(layer) is not None)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies `[num_variants * rope_half]` float32: the global table
        (with Llama 3 or linear scaling if set), then the local one when `local_rope_theta` is set."""
        tables = [_inv_freq(self.rope_theta, self.rope_half * 2, self.llama3_rope_scaling) / self.linear_rope_factor]
        if self.local_rope_theta is not None:
            tables.append(_inv_freq(self.local_rope_theta, self.rope_half * 2, None))
        return np.concatenate(tables).astype(np.float32)

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer in self.moe_layers


def _inv_freq(theta: float, dims: int, llama3) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    if llama3 is not None:
        factor, low, high, orig = llama3
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    centered = x - jnp.mean(x, axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps) * weight + bias


def norm(x: jax.Array, params: dict, name: str, cfg: ModelConfig) -> jax.Array:
    """The model config's norm with the weights `params[name]` (and `params[name + "_bias"]`)."""
    if cfg.norm == "layer":
        return layer_norm(x, params[name], params[name + "_bias"], cfg.norm_eps)
    return rms_norm(x, params[name], cfg.norm_eps)


def add_norm(
    x: jax.Array,
    delta: jax.Array | None,
    params: dict,
    name: str,
    cfg: ModelConfig,
    rows=None,
    dtype=jnp.float32,
    *,
    cpp: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`(x + delta, its norm in dtype)` (delta None: x and its norm). `cpp` (the platform's
    `cpp_ops`): RMSNorm as one C++ call (kernels/csrc/norm.cc, for the five ops XLA:CPU leaves
    unfused; `rows`, the real rows, lets it skip a bucket's padding). `dtype`: what the
    consuming GEMM rounds its input to (`linear.input_dtype`), so the rounding happens here,
    once, as it would there."""
    if cfg.norm == "rms" and cpp and x.ndim == 2 and x.dtype == jnp.float32:
        from jaxllm.kernels import native

        if delta is None:
            return x, native.rms_norm(x, params[name], cfg.norm_eps, None, rows, dtype)
        return native.rms_norm(x, params[name], cfg.norm_eps, delta, rows, dtype)
    x = x if delta is None else x + delta
    return x, norm(x, params, name, cfg).astype(dtype)


def rope_tables(positions, inv_freq, xp=jnp):
    """cos, sin `[T, 1, len(inv_freq)]` f32 for positions [T], with `xp` = jnp or numpy
    (`inv_freq`: `ModelConfig.inv_freq()`, one or two variants side by side).

    The runner computes them on the host (numpy) and passes them in the step inputs
    (`rope_cos`, `rope_sin`): inside the step XLA re-fused sin/cos into every layer's q and k
    (60 recomputations a step for a 30-layer model, ~2% of the run)."""
    freqs = xp.asarray(positions).astype(xp.float32)[:, None] * xp.asarray(inv_freq)[None, :]
    return xp.cos(freqs)[:, None, :], xp.sin(freqs)[:, None, :]


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """HF-style (rotate-half) RoPE on the first `2 * rope_half` dims of each head; the rest
    pass through. x: [T, heads, head_dim], rope: cos, sin `[T, 1, rope_half]`."""
    cos, sin = rope
    rotary = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rotary], 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated if rotary == x.shape[-1] else jnp.concatenate([rotated, x[..., rotary:]], axis=-1)


def _reduce(x: jax.Array, axis: str | None) -> jax.Array:
    """Sum a row-parallel partial result over the tensor-parallel axis (nothing without one)."""
    return x if axis is None else jax.lax.psum(x, axis)


def _plus_bias(x: jax.Array, layer: dict, *names: str) -> jax.Array:
    for name in names:
        if name in layer:
            x = x + layer[name]
    return x


def self_attention(layer, k_pages, v_pages, h, inputs, cfg: ModelConfig, index: int, attention, axis=None):
    """Attention of h [T, hidden] (normed) over the paged cache, after writing this step's
    keys and values. Returns (the output projection before the row-parallel sum, k_pages, v_pages)."""
    num_tokens, rows = h.shape[0], inputs.num_tokens()
    qkv = _plus_bias(linear.apply(layer["wqkv"], h, rows=rows), layer, "bqkv")
    q = qkv[:, : cfg.q_size].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
    k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, cfg.q_size + cfg.kv_size :].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.norm_eps)
    if cfg.position == "rope":
        lo = cfg.rope_variant(index) * cfg.rope_half
        rope = (inputs.rope_cos[..., lo : lo + cfg.rope_half], inputs.rope_sin[..., lo : lo + cfg.rope_half])
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
    if cfg.window(index) is not None and inputs.window_page_tables is not None:
        inputs = inputs.window_view()  # a windowed layer with its own pages (a window KV cache group)
    k_pages, v_pages = attention.write_kv(k_pages, v_pages, k, v, inputs.slot_mapping)
    o = attention.forward(
        q,
        k_pages,
        v_pages,
        inputs,
        sliding_window=cfg.window(index),
        sm_scale=cfg.attn_scale,
        causal=not cfg.bidirectional,
    )
    return linear.apply(layer["wo"], o.reshape(num_tokens, cfg.q_size), axis=axis, rows=rows), k_pages, v_pages


def dense_mlp(layer, h: jax.Array, cfg: ModelConfig, axis: str | None = None, rows=None) -> jax.Array:
    """The MLP of h [T, hidden] before the row-parallel sum (and before the output bias);
    `rows`: h's real rows (see `linear.apply`)."""
    act = ACTIVATIONS[cfg.hidden_act]
    if cfg.gated_mlp and cfg.hidden_act == "silu" and "b_gate_up" not in layer:
        a = linear.apply(layer["w_gate_up"], h, rows=rows, swiglu=True)
    elif cfg.gated_mlp:
        gate, up = jnp.split(_plus_bias(linear.apply(layer["w_gate_up"], h, rows=rows), layer, "b_gate_up"), 2, axis=-1)
        a = act(gate) * up
    else:
        a = act(_plus_bias(linear.apply(layer["w_up"], h, rows=rows), layer, "b_up"))
    return linear.apply(layer["w_down"], a, axis=axis, rows=rows)


def mlp(layer, h: jax.Array, cfg: ModelConfig, index: int, axis: str | None = None, rows=None) -> jax.Array:
    if cfg.is_moe(index):
        return moe.moe_mlp(layer, h, cfg, ACTIVATIONS[cfg.hidden_act])
    return dense_mlp(layer, h, cfg, axis, rows)


def decoder_layer(
    layer,
    k_pages,
    v_pages,
    x,
    inputs,
    cfg: ModelConfig,
    *,
    index: int,
    attention,
    axis: str | None = None,
    cpp_ops: bool = False,
):
    """Decoder layer `index` over x [T, hidden] f32 (`inputs`: the step's `StepInputs`,
    `attention`: its `AttentionBackend`, `axis`: the tensor-parallel mesh axis when run per
    shard, `cpp_ops`: norms in C++, `Platform.cpp_ops`). Returns (x, k_pages, v_pages)."""
    rows = inputs.num_tokens()
    if cfg.post_norm:  # BERT: each residual sum normed, the layer's input taken as it is
        attn, k_pages, v_pages = self_attention(layer, k_pages, v_pages, x, inputs, cfg, index, attention, axis)
        x = norm(x + _plus_bias(_reduce(attn, axis), layer, "bo"), layer, "attn_norm", cfg)
        out = _plus_bias(_reduce(mlp(layer, x, cfg, index, axis, rows), axis), layer, "b_down")
        return norm(x + out, layer, "mlp_norm", cfg), k_pages, v_pages
    mlp_dtype = jnp.float32 if cfg.is_moe(index) else linear.input_dtype(layer.get("w_gate_up", layer.get("w_up")))
    _, h = add_norm(x, None, layer, "attn_norm", cfg, rows, linear.input_dtype(layer["wqkv"]), cpp=cpp_ops)
    attn, k_pages, v_pages = self_attention(layer, k_pages, v_pages, h, inputs, cfg, index, attention, axis)
    if cfg.parallel_residual:  # one sum over the shards for both branches
        out = attn + mlp(
            layer, add_norm(x, None, layer, "mlp_norm", cfg, rows, mlp_dtype, cpp=cpp_ops)[1], cfg, index, axis, rows
        )
        return x + _plus_bias(_reduce(out, axis), layer, "bo", "b_down"), k_pages, v_pages
    attn = _plus_bias(_reduce(attn, axis), layer, "bo")
    if cfg.sandwich_norm:
        attn = norm(attn, layer, "post_attn_norm", cfg)
    x, h = add_norm(x, attn, layer, "mlp_norm", cfg, rows, mlp_dtype, cpp=cpp_ops)
    out = mlp(layer, h, cfg, index, axis, rows)
    out = _plus_bias(_reduce(out, axis), layer, "b_down")
    if cfg.sandwich_norm:
        out = norm(out, layer, "post_mlp_norm", cfg)
    return x + out, k_pages, v_pages


def embed(params, token_ids: jax.Array, positions: jax.Array, cfg: ModelConfig, axis: str | None = None) -> jax.Array:
    """The input rows [T, hidden] f32: token embeddings (scaled by `embed_scale`), plus the
    learned position rows if the model has them. With `axis`, each shard holds a slice of the
    vocabulary and contributes the rows it has (zeros elsewhere), summed over the axis."""
    x = _token_rows(params["embed"], token_ids, axis)
    if cfg.embed_scale != 1.0:
        x = x * cfg.embed_scale
    if cfg.position == "learned":
        table = params["pos_embed"]
        x = x + table[jnp.clip(positions, 0, table.shape[0] - 1)].astype(jnp.float32)
    if "embed_norm" in params:  # BERT's LayerNorm over the summed embeddings
        x = norm(x, params, "embed_norm", cfg)
    return x


def _token_rows(table, token_ids: jax.Array, axis: str | None) -> jax.Array:
    """Rows of the embedding table: a float array [vocab, hidden], or (tied, packed or
    quantized) the LM head's weight [hidden, vocab], which looks its columns up itself."""
    stored_as_head = hasattr(table, "embedding_rows")

    def lookup(ids):
        return table.embedding_rows(ids) if stored_as_head else table[ids].astype(jnp.float32)

    if axis is None:
        return lookup(token_ids)
    rows = table.shape[1] if stored_as_head else table.shape[0]
    local = token_ids - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], lookup(jnp.clip(local, 0, rows - 1)), 0.0)
    return jax.lax.psum(x, axis)


def forward(params, kv_cache, inputs, cfg: ModelConfig, *, attention, axis: str | None = None, cpp_ops: bool = False):
    """Run the transformer over a flattened ragged batch.

    kv_cache: list over layers of `(k_pages, v_pages)`, each
        `[num_kv_heads, num_pages, page_size, head_dim]` (bf16 caches stored as uint16 bits).
    inputs: the step's `StepInputs` (runner/input_batch.py: token ids, positions, slot mapping,
        RoPE tables, page tables, ...); attention: an `AttentionBackend` (jaxllm/attention/);
        cpp_ops: the platform runs norms in C++ (`Platform.cpp_ops`).
    Returns `(hidden [T, hidden] f32, new kv_cache)`. Layers run as an unrolled loop (see
    runner/model_runner.py for why not `lax.scan`) of `shared_decoder_layer` calls. With `axis`,
    this is one tensor-parallel shard's part (see the module docstring).
    """
    if inputs.lora_slots is not None:
        params = lora_layers.bind(params, inputs.lora_slots)
    x = embed(params, inputs.token_ids, inputs.positions, cfg, axis)
    new_cache = []
    for index, (layer, (k_pages, v_pages)) in enumerate(zip(params["layers"], kv_cache)):
        x, k_pages, v_pages = shared_decoder_layer(
            layer, k_pages, v_pages, x, inputs, cfg, index=index, attention=attention, axis=axis, cpp_ops=cpp_ops
        )
        new_cache.append((k_pages, v_pages))
    return x, new_cache


def shared_decoder_layer(
    layer,
    k_pages,
    v_pages,
    x,
    inputs,
    cfg: ModelConfig,
    *,
    index: int,
    attention,
    axis: str | None = None,
    cpp_ops: bool = False,
):
    """`decoder_layer`, as one nested jit per kind of layer (window, RoPE table, MoE or dense):
    JAX traces and lowers each kind once per step shape instead of every layer (30 for the
    default model), and XLA inlines the calls, so the compiled step is the same."""
    return _decoder_layer_jit(
        layer,
        k_pages,
        v_pages,
        x,
        inputs,
        cfg,
        index=first_of_kind(cfg, index),
        attention=attention,
        axis=axis,
        cpp_ops=cpp_ops,
    )


def layer_kind(cfg: ModelConfig, index: int) -> tuple:
    """What a layer's step depends on besides its weights: (window, RoPE table, MoE or dense)."""
    return cfg.window(index), cfg.rope_variant(index), cfg.is_moe(index)


def first_of_kind(cfg: ModelConfig, index: int) -> int:
    """The first layer of layer `index`'s kind, which stands for it in traced code."""
    kind = layer_kind(cfg, index)
    return next(i for i in range(index + 1) if layer_kind(cfg, i) == kind)


_decoder_layer_jit = jax.jit(decoder_layer, static_argnames=("cfg", "index", "attention", "axis", "cpp_ops"))


def compute_logits(
    params, hidden: jax.Array, cfg: ModelConfig, axis: str | None = None, rows=None, cpp_ops: bool = False
) -> jax.Array:
    """hidden: [N, hidden] f32 -> logits [N, vocab] f32 (final norm + LM head). With `axis`,
    each shard computes its slice of the vocabulary and the slices are gathered. `rows`: the
    real rows of hidden, the first ones (see `linear.apply`). `cpp_ops`: the final RMSNorm in
    C++ as the layers' (row by row: XLA's reduction over a row may group its sums by how many
    rows there are, which `batch_invariant` cannot have), rounded for the head's GEMM."""
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    dtype = linear.input_dtype(head) if hasattr(head, "apply") else jnp.float32
    _, h = add_norm(hidden, None, params, "final_norm", cfg, rows, dtype, cpp=cpp_ops)
    if cfg.tie_word_embeddings and not hasattr(params["embed"], "apply"):
        # A float table [vocab, hidden]: contracted as it is (`jnp.dot(h, embed.T)` materialised
        # the transpose on every call on XLA:CPU, 4-20x slower). Packed or quantized, it is
        # stored as the LM head [hidden, vocab] and applies itself.
        w = params["embed"]
        logits = jnp.einsum("sh,vh->sv", h.astype(w.dtype), w, preferred_element_type=jnp.float32)
    else:
        logits = linear.apply(params["embed" if cfg.tie_word_embeddings else "lm_head"], h, rows=rows)
    return logits if axis is None else jax.lax.all_gather(logits, axis, axis=1, tiled=True)
