"""`LoRAWeight`: a layer matrix with the adapters of every device slot beside it (Punica's
batched LoRA, as small matmuls over every slot, masked per token).

    y = base(x) + sum over slots s of [token's slot = s] (x a_s) b_s

A slot holds `a [in, W]` (W = blocks * R: the fused layout of lora/adapter.py) and `b` in parts
`[width, out_k]` (a block's own output columns, or one block-diagonal part); an empty slot is
zeros. Two layouts:

- packed (one CPU device with the C++ kernels): each slot's a packed into the C++ GEMM's panels
  (`kernels.gemm.pack_weight`), slot after slot, and every slot's b (parts side by side, `[width,
  out]`) stacked along K and packed. The step's rows are grouped by slot and each group multiplied
  by its own adapter's a only (csrc/lora.cc). Where the base is a bf16 GEMM on AMX's tiles
  (`fused`), `kernels.gemm.lora_shrink` lays x a out per slot and the base GEMM adds x a @ b to
  its sums, before its SwiGLU epilogue; elsewhere `kernels.gemm.lora_add` adds each group's
  (x a) b to the base's output;
- plain (elsewhere): `a [in, slots * W]`, each part `[slots * width, out_k]`, for XLA's dots:
  every slot's `x a`, masked per row, then the parts.

`token_slots [T] int32` (-1: no adapter) is bound to the step's `StepInputs.lora_slots` by `bind`
at the start of the forward. Tokens of different adapters (and of none) share a step; loading
an adapter writes one slot of every stack in place (`write_slot`), so no step ever recompiles
for it.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import linear

# The C++ GEMM's panel width (kernels/gemm.py PANEL; that module is imported where it is used, so
# that importing the decoder loads no kernels).
PANEL = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAWeight:
    base: object  # the matrix as the weight plan stores it (models/linear.py)
    a: jax.Array  # [in, slots * W], or packed: the slots' C++ panels
    b: tuple  # parts, each [slots * width, out_k]; or packed: (the slots' C++ panels,)
    token_slots: jax.Array | None = None  # [T] int32, bound per step; None: the base alone
    num_slots: int = dataclasses.field(default=1, metadata=dict(static=True))
    # Packed: each output panel's part (which `width` columns of x a it multiplies); else None.
    panel_part: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))

    def apply(self, x, *, axis=None, rows=None, swiglu=False):
        def base_alone():
            return linear.apply(self.base, x, axis=axis, rows=rows, swiglu=swiglu)

        def fused():  # the base GEMM adds (x a) b to its sums
            from jaxllm.kernels import gemm

            xa = gemm.lora_shrink(
                x.reshape(-1, x.shape[-1]), self.token_slots, self.a, self.num_slots, max(self.panel_part) + 1, rows
            )
            return self.base.apply(x, axis=axis, rows=rows, swiglu=swiglu, lora=(xa, self.b[0], self.panel_part))

        def with_adapters():  # (swiglu: the adapters' share joins before the activation)
            y = self.add_delta(linear.apply(self.base, x, axis=axis, rows=rows), x, rows)
            if not swiglu:
                return y
            gate, up = jnp.split(y, 2, axis=-1)
            return jax.nn.silu(gate) * up

        if self.token_slots is None:
            return base_alone()
        # A step without adapters skips their products (and keeps the base's fused epilogue).
        return jax.lax.cond(jnp.any(self.token_slots >= 0), fused if self.fused else with_adapters, base_alone)

    @property
    def fused(self) -> bool:
        """Whether the base GEMM adds the adapters' second product itself: bf16 panels or codes x
        bf16 rows on a CPU with AMX's tiles, every slot's b a whole number of 32-row tile depths."""
        if self.panel_part is None or self.a.dtype != jnp.bfloat16 or not linear.takes_lora(self.base):
            return False
        from jaxllm.kernels import native

        return "amx" in native.kernel_paths() and self.b[0].shape[1] % 16 == 0

    def add_delta(self, y: jax.Array, x: jax.Array, rows=None) -> jax.Array:
        """y [T, out] f32 plus each token's adapter's share of x [T, in] (none for slot -1):
        packed, the C++ kernel's per-slot products, added in place; plain, every slot's `x a`,
        masked per token (at these ranks cheaper than a gather of per-token matrices, and one
        shape whatever the mix), then b."""
        if self.panel_part is not None:
            from jaxllm.kernels import gemm

            return gemm.lora_add(y, x, self.token_slots, self.a, self.b[0], self.panel_part, self.num_slots, rows=rows)
        num_tokens, num_slots = x.shape[0], self.num_slots
        xa = _dot(x, self.a)  # [T, slots * W]
        mine = self.token_slots[:, None] == jnp.arange(num_slots)
        xa = jnp.where(mine[:, :, None], xa.reshape(num_tokens, num_slots, -1), 0.0)
        width = xa.shape[2] // len(self.b)
        outs = [
            _dot(xa[:, :, k * width : (k + 1) * width].reshape(num_tokens, -1), part) for k, part in enumerate(self.b)
        ]
        return y + (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1))

    @property
    def input_dtype(self):
        return linear.input_dtype(self.base)

    @property
    def fuses_swiglu(self) -> bool:
        return linear.fuses_swiglu(self.base)


def _dot(x, w):
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def bind(params, token_slots: jax.Array):
    """`params` with every LoRAWeight reading this step's `token_slots`."""
    return jax.tree_util.tree_map(
        lambda w: dataclasses.replace(w, token_slots=token_slots) if isinstance(w, LoRAWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, LoRAWeight),
    )


def can_pack(slot, rank: int, dtype) -> bool:
    """Whether a matrix's stacks fit the C++ GEMM's panels (16 columns; bf16: rows in pairs)."""
    width = slot.blocks * rank // len(slot.parts)
    return (
        slot.blocks * rank % PANEL == 0
        and all(n % PANEL == 0 for n in slot.parts)
        and (jnp.dtype(dtype) != jnp.bfloat16 or (slot.in_dim % 2 == 0 and width % 2 == 0))
    )


def panel_part(slot) -> tuple[int, ...]:
    """A packed stack's `LoRAWeight.panel_part`: each output panel's part."""
    return tuple(int(k) for k, n in enumerate(slot.parts) for _ in range(n // PANEL))


def empty_stack(slot, *, num_slots: int, rank: int, dtype, packed: bool) -> tuple:
    """(a, b) of zeros (every slot empty) for one adaptable matrix (`MatrixSlot`), in the layout
    of the module doc (host arrays)."""
    from jaxllm.kernels import gemm

    W = slot.blocks * rank
    width = W // len(slot.parts)
    if packed:
        a = gemm.pack_weight(np.zeros((slot.in_dim, num_slots * W), np.float32), dtype=dtype)
        b = (gemm.pack_weight(np.zeros((num_slots * width, sum(slot.parts)), np.float32), dtype=dtype),)
    else:
        a = np.zeros((slot.in_dim, num_slots * W), dtype)
        b = tuple(np.zeros((num_slots * width, n), dtype) for n in slot.parts)
    return a, b


def wrap(tree: dict | None, stacks: dict, num_slots: int, panel_parts: dict) -> dict | None:
    """A copy of the params `tree` (its arrays shared) with each adaptable matrix a LoRAWeight
    over `stacks` {(layer, matrix): (a, b)}; `panel_parts`: each packed one's `panel_part` (None:
    plain)."""
    if tree is None:
        return None
    tree = {**tree, "layers": [dict(layer) for layer in tree["layers"]]}
    for (i, name), (a, b) in stacks.items():
        w = tree["layers"][i][name]
        base = w.base if isinstance(w, LoRAWeight) else w
        tree["layers"][i][name] = LoRAWeight(base, a, b, num_slots=num_slots, panel_part=panel_parts[i, name])
    return tree


def slot_values(a: np.ndarray, parts: tuple, dtype, packed: bool) -> tuple:
    """One slot's a [in, W] and b parts [width, out_k] as `write_slot` takes them."""
    if not packed:
        return a, parts
    from jaxllm.kernels import gemm

    return gemm.pack_weight(a, dtype=dtype), (gemm.pack_weight(np.concatenate(parts, axis=1), dtype=dtype),)


def write_slot_values(stacks, slot, values, packed: tuple[bool, ...], lead: int = 0):
    """stacks [(a, b)] with slot `slot` set to `values` (`slot_values`), in place (donated). Slot
    s holds a's columns [s W, (s + 1) W) (packed: its panels, axis 0) and b's rows [s width,
    (s + 1) width) (packed: those rows of every panel, axis 1). `lead` 1: stacks and values have
    a leading axis of pipeline stages."""

    def put(stack, value, axis):
        axis += lead
        others = [(n, m) for i, (n, m) in enumerate(zip(stack.shape, value.shape)) if i != axis]
        if stack.ndim != value.ndim or any(n != m for n, m in others):
            raise ValueError(f"a LoRA slot's value {value.shape} does not fit its stack {stack.shape}")
        start = [0] * stack.ndim
        start[axis] = slot * value.shape[axis]
        return jax.lax.dynamic_update_slice(stack, value.astype(stack.dtype), start)

    return [
        (put(a, va, 0 if p else 1), tuple(put(part, vp, 1 if p else 0) for part, vp in zip(b, vb)))
        for (a, b), (va, vb), p in zip(stacks, values, packed)
    ]


# One device: the stacks stay where they are. (A mesh's runner jits it with its out_shardings.)
write_slot = jax.jit(write_slot_values, donate_argnums=(0,), static_argnums=(3, 4))
