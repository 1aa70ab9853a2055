"""`LoRAWeight` (jaxllm/lora/layers.py) against a plain per-token reference: each token's output
is the base product plus its own slot's `x a_s b_s`, for the packed layout (the C++ kernel of
csrc/lora.cc, float32 and bf16 panels, every kernel path) and the plain one (XLA's dots),
block-diagonal or per-block `b`, with slots written in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import native
from jaxllm.lora import layers
from jaxllm.lora.adapter import MatrixSlot

SLOTS, RANK, IN = 3, 16, 64


def _reference(x, base, adapters, token_slots):
    """x [T, in] @ base + per token its adapter's a @ b (block-diagonal b)."""
    out = x @ base
    for t, s in enumerate(token_slots):
        if s in adapters:  # (slot 1 is empty: zeros)
            a, b = adapters[s]
            out[t] += x[t] @ a @ b
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("parts", [(32, 16, 16), (64,)])
def test_delta_matches_per_token_products(packed, dtype, parts):
    if packed and not native.available():
        pytest.skip("no C++ kernels here")
    rng = np.random.default_rng(0)
    out = sum(parts)
    blocks = len(parts) if len(parts) > 1 else 2  # one part: a block-diagonal b over two blocks
    block_of = np.repeat(np.arange(blocks), parts if len(parts) > 1 else out // blocks)
    slot = MatrixSlot(blocks, IN, parts, block_of)
    assert layers.can_pack(slot, RANK, dtype)
    stack = jax.device_put(layers.empty_stack(slot, num_slots=SLOTS, rank=RANK, dtype=dtype, packed=packed))
    adapters = {}
    for s in (0, 2):  # slot 1 stays empty
        a = rng.normal(size=(IN, blocks * RANK)).astype(np.float32) / 8
        b = np.zeros((blocks * RANK, out), np.float32)
        for k in range(blocks):  # each block's rows feed its own columns
            cols = np.flatnonzero(slot.block_of == k)
            b[k * RANK : (k + 1) * RANK, cols] = rng.normal(size=(RANK, len(cols))) / 8
        if dtype == "bfloat16":  # the reference multiplies what the slot holds
            a, b = (np.asarray(jnp.asarray(m, jnp.bfloat16), np.float32) for m in (a, b))
        adapters[s] = a, b
        values = layers.slot_values(a, slot.split(b, RANK), jnp.dtype(dtype), packed)
        (stack,) = layers.write_slot([stack], np.int32(s), [values], (packed,))
    base = rng.normal(size=(IN, out)).astype(np.float32)
    x = rng.normal(size=(7, IN)).astype(np.float32)
    if dtype == "bfloat16":
        x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    token_slots = np.array([0, -1, 2, 1, 2, 0, -1], np.int32)

    part_of = layers.panel_part(slot) if packed else None

    def weight(token_slots):
        return layers.LoRAWeight(jnp.asarray(base), *stack, jnp.asarray(token_slots), SLOTS, part_of)

    got = np.asarray(jax.jit(lambda w, x: w.apply(x))(weight(token_slots), jnp.asarray(x)))
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(got, _reference(x, base, adapters, token_slots), rtol=tol, atol=tol)
    # A step with no adapter gives the base product alone.
    alone = weight(np.full(7, -1, np.int32)).apply(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(alone), x @ base, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_kernel_path_and_live_rows(dtype):
    """csrc/lora.cc on each path this build has (AVX2, AVX-512, AMX, portable), against the plain
    layout's XLA products, added to y; rows past `rows` keep y's values whatever their slot."""
    if not native.available():
        pytest.skip("no C++ kernels here")
    from jaxllm.kernels import gemm

    rng = np.random.default_rng(1)
    parts = (48, 16, 16)
    slot = MatrixSlot(3, IN, parts, np.repeat(np.arange(3), parts))
    stacks = {}
    for packed in (False, True):
        stack = jax.device_put(layers.empty_stack(slot, num_slots=SLOTS, rank=RANK, dtype=dtype, packed=packed))
        r = np.random.default_rng(2)
        for s in range(SLOTS):
            a = r.normal(size=(IN, 3 * RANK)).astype(np.float32) / 8
            b = tuple(r.normal(size=(RANK, n)).astype(np.float32) / 8 for n in parts)
            (stack,) = layers.write_slot(
                [stack], np.int32(s), [layers.slot_values(a, b, jnp.dtype(dtype), packed)], (packed,)
            )
        stacks[packed] = stack
    x = jnp.asarray(rng.normal(size=(48, IN)), jnp.float32)  # (8-row blocks and their tails)
    token_slots = jnp.asarray(rng.integers(-1, SLOTS, 48), jnp.int32)
    y = rng.normal(size=(48, sum(parts))).astype(np.float32)
    want = np.asarray(layers.LoRAWeight(None, *stacks[False], token_slots, SLOTS).add_delta(jnp.asarray(y), x))
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    a, (b,) = stacks[True]
    for path in ("auto", *native.kernel_paths()):
        got = gemm.lora_add(jnp.asarray(y), x, token_slots, a, b, layers.panel_part(slot), SLOTS, rows=41, path=path)
        np.testing.assert_allclose(np.asarray(got[:41]), want[:41], rtol=tol, atol=tol, err_msg=path)
        np.testing.assert_array_equal(np.asarray(got[41:]), y[41:])
