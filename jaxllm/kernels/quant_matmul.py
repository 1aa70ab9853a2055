"""x @ a quantized weight as a Pallas GPU kernel (Triton backend): the weight's integer codes are
read from memory as they are (1 or 1/2 byte a weight) and dequantized in registers, tile by
tile, so a decode step streams a quarter (int8) or an eighth (int4) of the f32 weight's bytes.

    x:      [M, K] float
    codes:  int8 [K, N] (8 bits), or uint8 [K, N / 2] (4 bits: column j in the low nibble of
            byte column j, column j + N / 2 in its high nibble: `QuantizedWeight`'s plain layout)
    scale:  [G, N] f32 or f16; offset: the same, or None
    returns [M, N] f32:  x @ (code * scale[g] + offset[g]), g = k // (K / G)

Grid: (M / block_m, N / block_n); each program walks K in steps of `block_k` rows, which lie in
one scale group (block_k divides K / G), loads that group's scales and offsets once, widens the
codes to f32, scales them and accumulates one `dot` per step (TF32 on GPUs unless JAX's matmul
precision says "highest": `paged_attention.dot_precision`). A 4-bit tile of output columns
lies wholly in the low or the high half, so it reads its bytes and shifts by 0 or 4.
`supported` says whether shapes tile (powers of two dividing the dimensions); callers fall back
to dequantizing in XLA otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels.paged_attention import dot_precision

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def supported(k: int, n: int, groups: int, bits: int) -> bool:
    """Whether a [K, N] weight with `groups` scale groups tiles for the kernel."""
    cols = n // 2 if bits == 4 else n
    return k % BLOCK_K == 0 and (k // groups) % BLOCK_K == 0 and cols % BLOCK_N == 0 and k % groups == 0


def _kernel(*refs, bits: int, group_rows: int, half_cols: int, precision):
    x_ref, codes_ref, scale_ref, o_ref = refs[0], refs[1], refs[2], refs[-1]
    offset_ref = refs[3] if len(refs) == 5 else None
    n0 = pl.program_id(1) * BLOCK_N
    k = x_ref.shape[1]
    if bits == 4:
        high = n0 >= half_cols                       # this tile's columns sit in the high nibbles
        cols = pl.ds(jnp.where(high, n0 - half_cols, n0), BLOCK_N)
    else:
        cols = pl.ds(n0, BLOCK_N)

    def body(i, acc):
        rows = pl.ds(i * BLOCK_K, BLOCK_K)
        g = (i * BLOCK_K) // group_rows
        c = codes_ref[rows, cols].astype(jnp.int32)
        if bits == 4:   # (a shift by a `where` of two constants lowers to an i1 operand in Triton)
            c = jnp.where(high, c >> 4, c) & 15
        w = c.astype(jnp.float32) * scale_ref[g, pl.ds(n0, BLOCK_N)].astype(jnp.float32)[None, :]
        if offset_ref is not None:
            w = w + offset_ref[g, pl.ds(n0, BLOCK_N)].astype(jnp.float32)[None, :]
        return acc + pltriton.dot(x_ref[:, rows].astype(jnp.float32), w, precision=precision)

    acc = lax.fori_loop(0, k // BLOCK_K, body, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("bits", "interpret"))
def quantized_matmul(x, codes, scale, offset, *, bits: int, interpret: bool = False):
    """x [..., K] @ the quantized weight -> [..., N] f32 (see the module docstring)."""
    k = x.shape[-1]
    groups, n = scale.shape
    if not supported(k, n, groups, bits):
        raise ValueError(f"a [{k}, {n}] weight in {groups} groups does not tile into {BLOCK_K} x {BLOCK_N} blocks")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    m = x2.shape[0]
    x2 = jnp.pad(x2, ((0, -m % BLOCK_M), (0, 0)))
    kernel = functools.partial(_kernel, bits=bits, group_rows=k // groups, half_cols=n // 2,
                               precision=dot_precision())

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)

    operands = [x2, codes, scale] + ([] if offset is None else [offset])
    in_specs = [pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0))] + [whole(a) for a in operands[1:]]
    out = pl.pallas_call(
        kernel,
        grid=(x2.shape[0] // BLOCK_M, n // BLOCK_N),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"quantized_matmul_{bits}bit",
    )(*operands)
    return out[:m].reshape(*lead, n)
