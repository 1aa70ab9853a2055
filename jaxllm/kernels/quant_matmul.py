"""x @ a quantized weight as a Pallas GPU kernel (Triton backend): the weight's integer codes are
read from memory as they are (1 or 1/2 byte a weight), so a decode step streams half (int8) or a
quarter (int4) of the bf16 weight's bytes, which is what bounds its time.

    x:      [M, K] float
    codes:  int8 [K, N] (8 bits), or uint8 [K, N / 2] (4 bits: column j in the low nibble of
            byte column j, column j + N / 2 in its high nibble: `QuantizedWeight`'s plain layout)
    scale:  [G, N] f32 or f16; offset: the same, or None
    returns [M, N] f32:  x @ (code * scale[g] + offset[g]), g = k // (K / G)

Each step of a program's loop over K covers `block_k` rows, in one scale group or in whole
groups (one dot per group then). The scales are applied the cheapest of three ways:
- one scale group over all of K (int8's per-channel scales): the codes go into the dots as they
  are (small integers, exact in bf16 and TF32) and the accumulator is scaled once at the end;
- groups of at least `block_m` rows (a decode's few rows): each group's dot of the raw codes is
  scaled as it is added, `dot(x, codes) * scale[g] + rowsum(x) * offset[g]`, a [block_m,
  block_n] update instead of dequantizing a [group rows, block_n] tile;
- smaller groups (a prompt's many rows): the tile is dequantized, then multiplied.
The dot is bf16 when x is bf16 (the engine's GPU dtype), otherwise float32 (TF32 on GPUs unless
JAX's matmul precision says "highest": `paged_attention.dot_precision`).

A 4-bit program loads each byte once and makes both of its columns: the low nibbles' dot writes
output columns [n0, n0 + block_n), the high nibbles' [N / 2 + n0, ...). Small batches split K
over `split_k` programs (partial sums added in XLA) so that a decode fills every SM.

`Tiles` is one configuration; `choose_tiles` picks it from the shapes (measured on an H200:
benchmarks/results/h200/RESULTS.md). `supported` says whether a weight tiles at all (power-of-two blocks dividing
the dimensions); callers fall back to dequantizing in XLA otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels.paged_attention import dot_precision

MIN_BLOCK = 16  # Triton's dots take tiles of at least 16 in each dimension


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int = 16
    block_n: int = 64  # output columns a program makes (each half's, for 4-bit codes)
    block_k: int = 32  # rows of K per step of the loop: divides a scale group or whole groups
    split_k: int = 1  # programs sharing one output tile's K (partial sums added in XLA)
    num_warps: int = 4
    num_stages: int = 3


def _cols(n: int, bits: int) -> int:
    """Byte columns of the codes: what a program's `block_n` tiles."""
    return n // 2 if bits == 4 else n


def fits(tiles: Tiles, k: int, n: int, groups: int, bits: int) -> bool:
    """Whether `tiles` tile a [K, N] weight in `groups` scale groups."""
    if k % groups:
        return False
    group_rows, sub = k // groups, min(tiles.block_k, k // groups)
    return (
        group_rows % sub == 0
        and tiles.block_k % sub == 0
        and sub % MIN_BLOCK == 0
        and k % (tiles.block_k * tiles.split_k) == 0
        and _cols(n, bits) % tiles.block_n == 0
    )


def supported(k: int, n: int, groups: int, bits: int) -> bool:
    """Whether a [K, N] weight with `groups` scale groups tiles for the kernel."""
    return fits(Tiles(block_k=MIN_BLOCK, block_n=MIN_BLOCK), k, n, groups, bits)


def split_for(tiles: Tiles, m: int, k: int, n: int, groups: int, bits: int, sms: int) -> Tiles:
    """`tiles` with K split in two until there are at least `sms` programs (or 16 splits)."""
    programs = -(-m // tiles.block_m) * (_cols(n, bits) // tiles.block_n)
    while programs * tiles.split_k < sms and tiles.split_k < 16:
        wider = dataclasses.replace(tiles, split_k=2 * tiles.split_k)
        if not fits(wider, k, n, groups, bits):
            break
        tiles = wider
    return tiles


def choose_tiles(m: int, k: int, n: int, groups: int, bits: int, sms: int = 132) -> Tiles:
    """The tiles for x [m, K] @ a [K, N] weight: K steps of up to 128 rows (long loads keep the
    memory busy), 128 output columns (64 bytes of 4-bit codes make 128), 8 warps, a row block as
    tall as the batch needs up to 128, and, when there are fewer output tiles than `sms`
    streaming multiprocessors, K split until every one has work. Picked from a search over
    tilings on an H200 (`benchmarks/gpu_quant.py --sweep`)."""
    group_rows = k // groups
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = next(b for b in ((64, 32, 16) if bits == 4 else (128, 64, 32, 16)) if _cols(n, bits) % b == 0)
    block_k = next(
        (b for b in (128, 64, 32, 16) if k % b == 0 and (group_rows % b == 0 or b % group_rows == 0)), MIN_BLOCK
    )
    tiles = Tiles(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=8, num_stages=4 if block_m <= 32 else 3)
    tiles = split_for(tiles, m, k, n, groups, bits, sms)
    return tiles if fits(tiles, k, n, groups, bits) else Tiles(block_k=MIN_BLOCK, block_n=MIN_BLOCK)


def _kernel(*refs, bits: int, group_rows: int, half_cols: int, steps: int, tiles: Tiles, dtype, precision):
    x_ref, codes_ref, scale_ref, o_ref = refs[0], refs[1], refs[2], refs[-1]
    offset_ref = refs[3] if len(refs) == 5 else None
    bn, bk = tiles.block_n, tiles.block_k
    n0 = pl.program_id(1) * bn
    k0 = pl.program_id(2) * (steps * bk)
    halves = (0, half_cols) if bits == 4 else (0,)  # output column offsets of the byte tile's columns

    sub = min(bk, group_rows)  # a step's rows in one scale group: its dots and scalings
    whole_k = group_rows == x_ref.shape[1]  # one scale per column: applied once, at the end
    dequantize_first = not whole_k and tiles.block_m > sub  # scaling the tile costs less than the rows
    scales = functools.partial(_scales, scale_ref, offset_ref, n0, bn)

    def body(i, carry):
        accs, x_sum = carry
        for j in range(bk // sub):
            r0 = k0 + i * bk + j * sub
            g = r0 // group_rows
            xt = x_ref[:, pl.ds(r0, sub)]
            x_rows = jnp.sum(xt.astype(jnp.float32), axis=1)[:, None] if offset_ref is not None else None
            if whole_k and x_rows is not None:
                x_sum = x_sum + x_rows
            x_dot = xt.astype(dtype)
            c = codes_ref[pl.ds(r0, sub), pl.ds(n0, bn)].astype(jnp.int32)
            out = []
            for h, acc in zip(halves, accs):
                code = ((c >> 4) & 15 if h else c & 15) if bits == 4 else c
                if whole_k:
                    out.append(acc + pltriton.dot(x_dot, code.astype(dtype), precision=precision))
                else:
                    out.append(_add_scaled_dot(acc, x_dot, code, x_rows, *scales(h, g), dequantize_first, precision))
            accs = tuple(out)
        return accs, x_sum

    zeros = tuple(jnp.zeros((tiles.block_m, bn), jnp.float32) for _ in halves)
    accs, x_sum = lax.fori_loop(0, steps, body, (zeros, jnp.zeros((tiles.block_m, 1), jnp.float32)))
    if whole_k:
        accs = [_scale_once(acc, x_sum, *scales(h, 0)) for h, acc in zip(halves, accs)]
    if bits == 4:
        o_ref[:, 0, :] = accs[0]
        o_ref[:, 1, :] = accs[1]
    else:
        o_ref[...] = accs[0]


def _scales(scale_ref, offset_ref, n0, bn: int, h: int, g):
    """Group g's scales and offsets (or None) of output columns h + n0 ..., as [1, block_n]."""
    return [
        None if ref is None else ref[g, pl.ds(h + n0, bn)].astype(jnp.float32)[None, :]
        for ref in (scale_ref, offset_ref)
    ]


def _add_scaled_dot(acc, x_dot, code, x_rows, scale, offset, dequantize_first: bool, precision):
    """acc + x_dot @ (code * scale + offset) for a step's rows in one scale group: the tile is
    dequantized first, or the dot of the raw codes is scaled as it is added (the module
    docstring's third and second ways); x_rows: x's row sums (the offset's term)."""
    if dequantize_first:
        w = code.astype(jnp.float32) * scale + (0.0 if offset is None else offset)
        return acc + pltriton.dot(x_dot, w.astype(x_dot.dtype), precision=precision)
    acc = acc + pltriton.dot(x_dot, code.astype(x_dot.dtype), precision=precision) * scale
    if offset is not None:
        acc = acc + x_rows * offset
    return acc


def _scale_once(acc, x_sum, scale, offset):
    """The accumulated dot of the raw codes over all of K, scaled (one scale group: the module
    docstring's first way); x_sum: x's row sums (the offset's term)."""
    return acc * scale + (0.0 if offset is None else x_sum * offset)


@functools.partial(jax.jit, static_argnames=("bits", "tiles", "interpret"))
def quantized_matmul(x, codes, scale, offset, *, bits: int, tiles: Tiles | None = None, interpret: bool = False):
    """x [..., K] @ the quantized weight -> [..., N] f32 (see the module docstring); `tiles`
    default to `choose_tiles`' for these shapes on this device."""
    k = x.shape[-1]
    groups, n = scale.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != jnp.bfloat16:
        x2 = x2.astype(jnp.float32)
    m = x2.shape[0]
    if tiles is None:
        tiles = choose_tiles(m, k, n, groups, bits, getattr(jax.devices()[0], "core_count", None) or 132)
    if not fits(tiles, k, n, groups, bits):
        raise ValueError(f"a [{k}, {n}] weight in {groups} groups does not tile as {tiles}")
    x2 = jnp.pad(x2, ((0, -m % tiles.block_m), (0, 0)))
    rows = x2.shape[0]
    half = n // 2
    cols = _cols(n, bits)
    kernel = functools.partial(
        _kernel,
        bits=bits,
        group_rows=k // groups,
        half_cols=half,
        steps=k // (tiles.block_k * tiles.split_k),
        tiles=tiles,
        dtype=x2.dtype,
        precision=None if x2.dtype == jnp.bfloat16 else dot_precision(),
    )

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)

    operands = [x2, codes, scale] + ([] if offset is None else [offset])
    in_specs = [pl.BlockSpec((tiles.block_m, k), lambda i, j, s: (i, 0))] + [whole(a) for a in operands[1:]]
    if bits == 4:  # [split, rows, 2, N / 2]: half h of byte column j is output column h * N / 2 + j
        out_shape = (tiles.split_k, rows, 2, half)
        out_spec = pl.BlockSpec((None, tiles.block_m, 2, tiles.block_n), lambda i, j, s: (s, i, 0, j))
    else:
        out_shape = (tiles.split_k, rows, n)
        out_spec = pl.BlockSpec((None, tiles.block_m, tiles.block_n), lambda i, j, s: (s, i, j))
    out = pl.pallas_call(
        kernel,
        grid=(rows // tiles.block_m, cols // tiles.block_n, tiles.split_k),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"quantized_matmul_{bits}bit",
    )(*operands)
    out = out.reshape(tiles.split_k, rows, n)
    out = out[0] if tiles.split_k == 1 else jnp.sum(out, axis=0)
    return out[:m].reshape(*lead, n)
