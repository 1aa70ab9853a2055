"""Which activations a QuantizedWeight's C++ kernel rounds x to, set once on load: bf16 rows
(`with_bf16_activations`, optionally with the group scales factored out of the sums:
`with_factored`) or int8 rows (`with_int8_activations`). Each returns the weight unchanged where
its layout, shape or codes do not allow it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm.quantization.weights import QuantizedWeight


def with_int8_activations(w: QuantizedWeight, device=None, six_bit: bool = False) -> QuantizedWeight:
    """w set to multiply int8-quantized activations (`gemm.matmul_quantized(..., act8=True)`, on
    `device`) where the C++ GEMM can: 4-bit codes in panels, groups a multiple of 32 rows (the
    codes repacked in `quads`, as the int8 dot instructions read them); with `six_bit`, also
    8-bit codes that all lie in [-32, 31] (GGUF's Q6_K, Q5_0, Q5_K, Q5_1, and Q4_K parts fused
    with Q6_K ones) in groups of a multiple of 32 rows, or of 16 under two-level scales, repacked
    in 6 bits (`gemm.six_bit_quads`: three quarters of the bytes); else w as it is."""
    from jaxllm.kernels import gemm

    k, _ = w.shape
    rows = k // w.groups
    if w.layout != "panels" or w.perm is not None or k % gemm.ACT_GROUP or w.bits not in ((4, 8) if six_bit else (4,)):
        return w
    if w.activations == "int8":
        return w
    if w.activations != "float":
        raise ValueError(f"with_int8_activations: codes for {w.activations} activations, not the float panels")
    if w.bits == 4:
        if rows % gemm.ACT_GROUP:
            return w
        codes = gemm.quads_from_panels(np.asarray(w.codes))
        return dataclasses.replace(w, codes=jax.device_put(codes, device), activations="int8")
    two_level = w.super_scale is not None
    super_rows = rows * (w.groups // w.super_scale.shape[1]) if two_level else rows
    group_rows = 16 if two_level else gemm.ACT_GROUP
    grouped = rows % group_rows == 0 and super_rows % gemm.ACT_GROUP == 0
    codes = np.asarray(w.codes)
    if not grouped or codes.min() < -32 or codes.max() > 31:
        return w
    six = jax.device_put(gemm.six_bit_quads(codes), device)
    return dataclasses.replace(w, codes=six, bits=6, activations="int8")


def with_bf16_activations(w: QuantizedWeight, device=None) -> QuantizedWeight:
    """w set to multiply bf16-rounded activations (`gemm.matmul_quantized_bf16`, on `device`)
    where that GEMM can: weight-only codes in panels, K and the groups multiples of 4 rows (4-bit
    codes repacked in row pairs); else w as it is. The product is then the packed bf16 GEMM's of
    w's dequantized weights rounded to bf16, from a quarter or half of their bytes, and embedding
    rows are rounded to bf16 too (the caller checks that the CPU has AVX512_BF16 and that the
    run's dtype is bfloat16)."""
    from jaxllm.kernels import gemm

    k, _ = w.shape
    if w.layout != "panels" or w.activations != "float" or k % 4 or (k // w.groups) % 4:
        return w
    if w.bits == 8:
        return dataclasses.replace(w, activations="bf16")
    codes = gemm.pairs_from_panels(np.asarray(w.codes))
    return dataclasses.replace(w, codes=jax.device_put(codes, device), activations="bf16")


def with_factored(w, device=None):
    """w set to factor its group scales out of its GEMM's sums (`QuantizedWeight.factored`)
    where the kernel can: codes x bf16 rows (`with_bf16_activations`), 4-bit ones or 8-bit ones
    that all lie in [-64, 63] (GGUF's Q5 and Q6 types; not Q8_0's full byte, which the bf16
    trick cannot hold); 4- or 8-bit codes x float rows in the f32 GEMM's panels (AVX2), groups of
    an even number of rows; else w as it is. 8-bit codes x bf16 rows within [-32, 31] (Q6_K's,
    the Q5 types') are repacked as 6-bit ones (`gemm.six_bit_blocks`, on `device`) where the
    build reads them: the same numbers from three quarters of the bytes."""
    from jaxllm.kernels import gemm, native

    if not isinstance(w, QuantizedWeight):
        return w
    if w.activations == "float":
        k = w.shape[0]
        fits = w.layout == "panels" and w.bits in (4, 8) and (k // w.groups) % 2 == 0
        return dataclasses.replace(w, factored=True) if fits else w
    if w.activations != "bf16":
        return w
    if w.bits == 8:
        codes = np.asarray(w.codes)
        low, high = codes.min(), codes.max()
        if low < -64 or high > 63:
            return w
        if low >= -32 and high <= 31 and native.has_six_bit_codes():
            six = jax.device_put(gemm.six_bit_blocks(codes), device)
            return dataclasses.replace(w, codes=six, bits=6, factored=True)
    return dataclasses.replace(w, factored=True)


def int8_activation_weights(params) -> int:
    """How many weights of a params tree multiply int8-quantized activations."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return sum(isinstance(x, QuantizedWeight) and x.activations == "int8" for x in leaves)
