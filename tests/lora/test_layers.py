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


@pytest.mark.parametrize(
    "dtype, rank, grouped", [("float32", RANK, False), ("bfloat16", RANK, False), ("bfloat16", 64, True)]
)
def test_every_kernel_path_and_live_rows(dtype, rank, grouped):
    """csrc/lora.cc on each path this build has (AVX2, AVX-512, AMX, portable), against the plain
    layout's XLA products, added to y; rows past `rows` keep y's values whatever their slot.
    `grouped`: each slot's rows consecutive, 16 and more of them (AMX's tiles load and store y's
    rows in place; mixed rows pass through a scratch), with a rank of several tile depths."""
    if not native.available():
        pytest.skip("no C++ kernels here")
    from jaxllm.kernels import gemm

    rng = np.random.default_rng(1)
    parts = (48, 16, 16)
    slot = MatrixSlot(3, IN, parts, np.repeat(np.arange(3), parts))
    stacks = {}
    for packed in (False, True):
        stack = jax.device_put(layers.empty_stack(slot, num_slots=SLOTS, rank=rank, dtype=dtype, packed=packed))
        r = np.random.default_rng(2)
        for s in range(SLOTS):
            a = r.normal(size=(IN, 3 * rank)).astype(np.float32) / 8
            b = tuple(r.normal(size=(rank, n)).astype(np.float32) / 8 for n in parts)
            (stack,) = layers.write_slot(
                [stack], np.int32(s), [layers.slot_values(a, b, jnp.dtype(dtype), packed)], (packed,)
            )
        stacks[packed] = stack
    num_rows = 96 if grouped else 48  # (row blocks of 8 or 16 and their tails)
    live = num_rows - 7
    x = jnp.asarray(rng.normal(size=(num_rows, IN)), jnp.float32)
    token_slots = rng.integers(-1, SLOTS, num_rows)
    token_slots = jnp.asarray(np.sort(token_slots) if grouped else token_slots, jnp.int32)
    y = rng.normal(size=(num_rows, sum(parts))).astype(np.float32)
    want = np.asarray(layers.LoRAWeight(None, *stacks[False], token_slots, SLOTS).add_delta(jnp.asarray(y), x))
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    a, (b,) = stacks[True]
    for path in ("auto", *native.kernel_paths()):
        got = gemm.lora_add(jnp.asarray(y), x, token_slots, a, b, layers.panel_part(slot), SLOTS, rows=live, path=path)
        np.testing.assert_allclose(np.asarray(got[:live]), want[:live], rtol=tol, atol=tol, err_msg=path)
        np.testing.assert_array_equal(np.asarray(got[live:]), y[live:])


@pytest.mark.parametrize("base_kind", ["bf16 panels", "4-bit codes"])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("num_rows", [1, 37])
def test_gemms_that_add_the_second_product_match_lora_add(base_kind, swiglu, num_rows):
    """The bf16 GEMMs given a `lora_shrink` result (`lora=`): on AMX's tiles (two rows and more)
    the product joins the sums before the SwiGLU epilogue; on other paths (one row, AVX-512,
    portable) it is added after the plain product. Either way the result is the base product plus
    `lora_add`'s, through the epilogue; rows past `rows` are zeros."""
    if not native.available():
        pytest.skip("no C++ kernels here")
    from jaxllm.kernels import gemm

    rng = np.random.default_rng(3)
    slots, parts = 4, (32, 32)  # (gate | up: two parts; 4 slots x rank 16: two tile depths)
    slot = MatrixSlot(2, IN, parts, np.repeat(np.arange(2), parts))
    stack = jax.device_put(layers.empty_stack(slot, num_slots=slots, rank=RANK, dtype="bfloat16", packed=True))
    for s in (0, 2, 3):  # (slot 1 stays empty)
        a = rng.normal(size=(IN, 2 * RANK)).astype(np.float32) / 8
        b = tuple(rng.normal(size=(RANK, n)).astype(np.float32) / 8 for n in parts)
        values = layers.slot_values(a, b, jnp.dtype(jnp.bfloat16), True)
        (stack,) = layers.write_slot([stack], np.int32(s), [values], (True,))
    a, (b,) = stack
    part = layers.panel_part(slot)
    weight = rng.normal(size=(IN, sum(parts))).astype(np.float32) / 8
    if base_kind == "bf16 panels":
        panels = jnp.asarray(gemm.pack_weight(weight, dtype=jnp.bfloat16))

        def base(x, **kw):
            return gemm.matmul_packed(x, panels, **kw)
    else:
        codes = rng.integers(0, 16, weight.shape)
        scale = jnp.asarray((rng.random((IN // 32, sum(parts))) * 0.05).astype(np.float16))
        offset = jnp.asarray((-rng.random((IN // 32, sum(parts))) * 0.4).astype(np.float16))
        packed_codes = jnp.asarray(gemm.pack_codes(codes, 4, pairs=True))

        def base(x, **kw):
            return gemm.matmul_quantized_bf16(
                x, packed_codes, gemm.pack_scales(scale), gemm.pack_scales(offset), 4, **kw
            )

    x = jnp.asarray(rng.normal(size=(num_rows, IN)), jnp.float32)
    token_slots = jnp.asarray(rng.integers(-1, slots, num_rows), jnp.int32)
    live = max(1, num_rows - 5)
    for path in ("auto", *native.kernel_paths()):
        plain = gemm.lora_add(base(x, rows=live, path=path), x, token_slots, a, b, part, slots, rows=live, path=path)
        want = np.asarray(plain)
        if swiglu:
            gate, up = want[:, :32], want[:, 32:]
            want = gate / (1 + np.exp(-gate)) * up
        xa = gemm.lora_shrink(x, token_slots, a, slots, len(parts), rows=live, path=path)
        got = np.asarray(base(x, rows=live, path=path, swiglu=swiglu, lora=(xa, b, part)))
        np.testing.assert_allclose(got[:live], want[:live], rtol=2e-3, atol=2e-3, err_msg=path)
        np.testing.assert_array_equal(got[live:], 0.0)
