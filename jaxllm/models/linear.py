"""Linear layers: a weight applies itself.

A linear's weight `w` (`[in, out]`: activations multiply on the left) is either a float array,
multiplied by an XLA dot, or an object that knows its own product:

    w.apply(x, *, axis=None, rows=None, swiglu=False) -> [..., out] f32
    w.input_dtype          the dtype its kernel rounds x to (a norm before it rounds there, once)
    w.fuses_swiglu         whether `apply(..., swiglu=True)` runs in its kernel's epilogue
    w.takes_lora           (optional) whether `apply(..., lora=(xa, b, panel_part))` adds multi-LoRA's
                           second product in its kernel (lora/layers.py)
    w.first_columns(n)     (optional) the weight of its first n outputs, n a multiple of 16 (a
                           draft's LM head cut to the first token ids: `first_columns` below)

The classes: `PackedWeight` (below: a float matrix in the C++ GEMM's panels),
`quantization.QuantizedWeight` (integer codes with scales, in panels or plain) and, while a
model is calibrated, `weights.calibration.Observed`. Which one each linear gets is the weight
plan's decision (jaxllm/weights/plan.py), made once; the decoder only calls `apply` here. A new
storage format, or an adapter wrapped around a weight, is one more class with these three.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def apply(
    w, x: jax.Array, *, axis: str | None = None, rows: jax.Array | None = None, swiglu: bool = False
) -> jax.Array:
    """`x [..., in] f32 @ w [in, out]` with f32 accumulation.

    axis: the tensor-parallel mesh axis when w is a row-parallel shard (W8A8 scales activations
        over every shard). rows (an int32 scalar, traced): only x's first `rows` rows are real,
        the rest a bucket's padding; the C++ GEMMs skip the padding and give zeros there, the
        other paths compute every row. swiglu: w is a gated MLP's [gate | up] and the result is
        `silu(x @ gate) * (x @ up)` [..., out / 2], in the GEMM's epilogue where it has one."""
    if swiglu and not fuses_swiglu(w):
        gate, up = jnp.split(apply(w, x, axis=axis, rows=rows), 2, axis=-1)
        return jax.nn.silu(gate) * up
    if hasattr(w, "apply"):
        return w.apply(x, axis=axis, rows=rows, swiglu=swiglu)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def input_dtype(w) -> jnp.dtype:
    """The dtype `apply` rounds its input to for w: bf16 for bf16 weights (and the weights whose
    kernel says so), float32 (the input as it is) for the rest."""
    if hasattr(w, "input_dtype"):
        return w.input_dtype
    return jnp.bfloat16 if w.dtype == jnp.bfloat16 else jnp.float32


def fuses_swiglu(w) -> bool:
    return getattr(w, "fuses_swiglu", False)


def takes_lora(w) -> bool:
    return getattr(w, "takes_lora", False)


def first_columns(w, n: int):
    """The weight [in, n] of w's first n outputs (n a multiple of 16: whole panels)."""
    if n % 16:
        raise ValueError(f"first_columns takes whole panels of 16 columns, not {n}")
    if hasattr(w, "first_columns"):
        return w.first_columns(n)
    if hasattr(w, "apply"):
        raise ValueError(f"a {type(w).__name__} weight cannot be cut to its first columns")
    return w[:, :n]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedWeight:
    """A float32 weight [in, out] packed once into 16-column panels `[out / 16, in, 16]`, or a
    bf16 one into panels of row pairs `[out / 16, in / 2, 16, 2]` (`kernels.gemm.pack_weight`),
    for the C++ GEMMs: XLA:CPU's dot repacks its weight on every call, most of a dot's time at
    decode batch sizes. A packed embedding table serves both the lookup (`embedding_rows`) and
    the tied LM head."""

    panels: jax.Array
    # The kernel path ("auto": the widest for the call's row count; `WeightPlan.gemm_path`).
    path: str = dataclasses.field(default="auto", metadata=dict(static=True))

    def apply(self, x, *, axis=None, rows=None, swiglu=False, lora=None):
        from jaxllm.kernels import gemm

        return gemm.matmul_packed(x, self.panels, path=self.path, rows=rows, swiglu=swiglu, lora=lora)

    @property
    def input_dtype(self):
        return self.panels.dtype

    @property
    def fuses_swiglu(self) -> bool:
        """Gate and up are each whole panels."""
        return self.panels.shape[0] % 2 == 0

    @property
    def takes_lora(self) -> bool:
        return self.panels.dtype == jnp.bfloat16

    def first_columns(self, n: int) -> PackedWeight:
        return dataclasses.replace(self, panels=self.panels[: n // 16])

    def embedding_rows(self, token_ids: jax.Array) -> jax.Array:
        """Rows [T, in] f32 of a tied embedding table stored as its LM head: token t is column
        t % 16 of panel t // 16."""
        if self.panels.ndim == 4:  # bf16 [vocab / 16, hidden / 2, 16, 2]
            rows = self.panels[token_ids // 16, :, token_ids % 16, :]
            return rows.reshape(*token_ids.shape, -1).astype(jnp.float32)
        return self.panels[token_ids // 16, :, token_ids % 16]


__all__ = ["PackedWeight", "apply", "first_columns", "fuses_swiglu", "input_dtype", "takes_lora"]
