"""`LoRAWeight`: a layer matrix with the adapters of every device slot beside it (Punica's
batched LoRA, as gathers and small matmuls XLA fuses).

    y = base(x) + sum over slots s of [token's slot = s] (x a_s) b_s

with `a [in, slots, blocks * R]` and `b [slots, blocks * R, out]` (the fused layout of
lora/adapter.py; an empty slot is zeros) and `token_slots [T] int32` (-1: no adapter), bound to
the step's `StepInputs.lora_slots` by `bind` at the start of the forward. Tokens of different
adapters (and of none) share a step; loading an adapter writes one slot of every stack (`write_slot`),
so no step ever recompiles for it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllm.models import linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAWeight:
    base: object  # the matrix as the weight plan stores it (models/linear.py)
    a: jax.Array  # [in, slots, blocks * R]
    b: jax.Array  # [slots, blocks * R, out]
    token_slots: jax.Array | None = None  # [T] int32, bound per step; None: the base alone

    def apply(self, x, *, axis=None, rows=None, swiglu=False):
        y = linear.apply(self.base, x, axis=axis, rows=rows)
        if self.token_slots is None:
            return y
        return y + lora_delta(x, self.a, self.b, self.token_slots)

    @property
    def input_dtype(self):
        return linear.input_dtype(self.base)

    fuses_swiglu = False  # the adapter's share joins before the activation


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array) -> jax.Array:
    """x [T, in] -> [T, out] f32: each token's adapter's share (zeros for slot -1). Every slot's
    `x a` is computed and the others masked: at these ranks that is cheaper than a gather of
    per-token matrices, and it has one shape whatever the mix."""
    num_tokens, (num_slots, width, _) = x.shape[0], b.shape
    xa = jnp.dot(x.astype(a.dtype), a.reshape(a.shape[0], -1), preferred_element_type=jnp.float32)
    mine = token_slots[:, None] == jnp.arange(num_slots)
    xa = jnp.where(mine[:, :, None], xa.reshape(num_tokens, num_slots, width), 0.0)
    xa = xa.reshape(num_tokens, -1).astype(b.dtype)
    return jnp.dot(xa, b.reshape(num_slots * width, -1), preferred_element_type=jnp.float32)


def bind(params, token_slots: jax.Array):
    """`params` with every LoRAWeight reading this step's `token_slots`."""
    return jax.tree_util.tree_map(
        lambda w: dataclasses.replace(w, token_slots=token_slots) if isinstance(w, LoRAWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, LoRAWeight),
    )


def empty_stacks(geometry, *, num_slots: int, max_rank: int, dtype, device) -> dict[tuple[int, str], tuple]:
    """{(layer, matrix): (a, b)} of zeros (every slot empty) for each adaptable matrix."""
    stacks = {}
    for i, layer_geometry in enumerate(geometry.layers):
        for name, (blocks, in_dim, out_dim) in layer_geometry.items():
            a = jax.device_put(jnp.zeros((in_dim, num_slots, blocks * max_rank), dtype), device)
            b = jax.device_put(jnp.zeros((num_slots, blocks * max_rank, out_dim), dtype), device)
            stacks[i, name] = a, b
    return stacks


def wrap(tree: dict | None, stacks: dict[tuple[int, str], tuple]) -> dict | None:
    """A copy of the params `tree` (its arrays shared) with each adaptable matrix a LoRAWeight
    over `stacks`."""
    if tree is None:
        return None
    tree = {**tree, "layers": [dict(layer) for layer in tree["layers"]]}
    for (i, name), (a, b) in stacks.items():
        w = tree["layers"][i][name]
        tree["layers"][i][name] = LoRAWeight(w.base if isinstance(w, LoRAWeight) else w, a, b)
    return tree


@functools.partial(jax.jit, donate_argnums=(0,))
def write_slot(stacks, slot, values):
    """stacks [(a, b)] with slot `slot` set to values [(a_s [in, w], b_s [w, out])] (donated:
    in place)."""
    return [
        (a.at[:, slot].set(va.astype(a.dtype)), b.at[slot].set(vb.astype(b.dtype)))
        for (a, b), (va, vb) in zip(stacks, values)
    ]
