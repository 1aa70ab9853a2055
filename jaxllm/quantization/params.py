"""A params tree's weights quantized for a run (`quantize_params`), and their bytes."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import QUANTIZATION_ALIASES
from jaxllm.quantization.weights import (CHECKPOINT_METHODS, EXPERT_MATRICES, LAYER_MATRICES, METHODS,
                                         QuantizedWeight, dequantize, make_sharded_weight, make_weight, relayout,
                                         shard_checkpoint_weight, with_bf16_activations, with_int8_activations)

logger = logging.getLogger(__name__)


def quantize_params(params: dict, spec, method: str, *, native: bool, device=None, parts=None,
                    int8_activations: bool = False, bf16_activations: bool = False, quiet: bool = False) -> dict:
    """Replace, in place, the layer matrices and the LM head (the embedding table when tied)
    of a params tree by QuantizedWeights, one matrix at a time.

    One device (`parts` None): on `device`; `native`: the C++ kernels serve this run (the packed
    weight-only layout where it applies). Sharded (`parts`: {name: (column parts, row parts)}
    for the tree's `layout.shard_layout`, from `parallel.quantized_parts`): plain-layout host
    arrays that split so (`make_sharded_weight`), for `parallel.shard_params` to place.
    With `int4` the LM head gets int8 codes (as llama.cpp keeps its output matrix at 6-8 bits).
    MoE experts get the method's codes, weight-only (int8 under `w8a8`), in the plain layout.
    Weights the checkpoint gave quantized (`CHECKPOINT_METHODS`) are only laid out for the run
    (packed on one device, split per shard when sharded); with those methods, float weights stay
    float. `int8_activations`: the 4-bit panel weights then multiply int8 activations
    (`with_int8_activations`); else `bf16_activations`: the weight-only panel weights multiply
    bf16-rounded ones (`with_bf16_activations`; a 4-bit embedding table excepted). `quiet`: no
    log line (the loader packing for its params cache; the runner then logs the run's weights).
    `method` is an EngineArgs name: "int8" is W8A8, as there (config.QUANTIZATION_ALIASES)."""
    method = QUANTIZATION_ALIASES.get(method, method)
    if method not in METHODS and method not in CHECKPOINT_METHODS:
        raise ValueError(f"unknown quantization {method!r}: choose one of {sorted(METHODS) + list(CHECKPOINT_METHODS)}")
    activations = "int8" if method == "w8a8" else "float"

    def make(w, name, head=False):
        if isinstance(w, QuantizedWeight):
            if parts is not None:
                return shard_checkpoint_weight(w, *parts[name], what=f"{method} {name}")
            w = relayout(w, native, device)
        elif method not in METHODS:
            return w
        else:
            m = "int8" if head and method == "int4" else method
            if parts is not None:
                return make_sharded_weight(w, m, activations, *parts[name])
            w = make_weight(np.asarray(w, np.float32), m, panels=native, activations=activations, device=device)
        if int8_activations:
            return with_int8_activations(w)
        # (A 4-bit embedding table keeps its layout: its rows are looked up from the panels.)
        return with_bf16_activations(w, device) if bf16_activations and (name != "embed" or w.bits == 8) else w

    def make_experts(w, name):
        if method not in METHODS:
            return w
        q = make_sharded_weight(w, method if method != "w8a8" else "int8", "float",
                                *(parts[name] if parts is not None else (1, 1)))
        return q if parts is not None else jax.device_put(q, device)

    for layer in params["layers"]:
        for name in LAYER_MATRICES:
            if name in layer:
                layer[name] = make(layer[name], name)
        for name in EXPERT_MATRICES:
            if name in layer:
                layer[name] = make_experts(layer[name], name)
    if "lm_head" in params:
        params["lm_head"] = make(params["lm_head"], "lm_head", head=True)
    if isinstance(params["embed"], QuantizedWeight):
        params["embed"] = make(params["embed"], "embed")
    elif spec.tie_word_embeddings and method in METHODS:
        params["embed"] = make(np.ascontiguousarray(np.asarray(params["embed"], np.float32).T), "embed", head=True)
    if not quiet:
        kept = method not in METHODS
        logger.info("weights: the checkpoint's %s codes, kept" if kept else "weights quantized: %s", method)
    return params


# Steps of at most this many rows multiply a GGUF's codes, larger ones its bf16 weights
# (`small_step_params`): on Zen 4 the bf16 GEMM over 4-bit codes ran the layer GEMMs of a decode
# step at 1.13x the bf16 panels at 1 row, 1.31x at 2 and 1.44x at 4, but 0.85x at 8
# (`benchmarks/weight_stream.py`): from a few rows the conversion costs more than the bytes saved.
SMALL_STEP_ROWS = 4


def small_step_params(params: dict, device, codes: bool = True) -> tuple[dict, dict | None]:
    """A GGUF's params tree (its matrices kept quantized: `load_model(quantization="gguf")`) as
    (bf16 tree, codes tree): the first with every quantized matrix dequantized to bf16 and packed
    for the C++ bf16 GEMM (`decoder.PackedWeight`: the weights a dequantizing load gives, bit for
    bit), the second sharing all of it but the layer matrices, which keep their codes for the bf16
    GEMM over codes (`with_bf16_activations`). Both compute the same numbers, the second from
    about a third of the layer weights' bytes: the steps of at most SMALL_STEP_ROWS rows take it
    (`ModelRunner`). Matrices are converted one at a time. `codes` False (the C++ build has no
    AVX512_BF16 dots after all): the bf16 tree alone, and None."""
    from jaxllm.kernels import native
    from jaxllm.models.decoder import PackedWeight

    put = functools.partial(jax.device_put, device=device)

    def both(tree_big: dict, tree_few: dict, name: str, table: bool = False):
        """tree_big[name] (codes) as bf16 panels there, and as codes for the bf16 GEMM in tree_few."""
        w = tree_big[name]
        q = with_bf16_activations(relayout(w, True, device), device)
        if codes and q.activations == "bf16":   # converted as the GEMM over codes converts them
            big = PackedWeight(put(native.codes_to_bf16_panels(q.codes, q.scale, q.offset, q.bits, q.super_scale,
                                                               q.super_offset)))
        else:       # a shape off the bf16 GEMM's panels, or no bf16 dots: the dense bf16 weight, unpacked
            dense = np.asarray(dequantize(w, np), jnp.bfloat16)     # [in, out], rounded to nearest even
            big = put(np.ascontiguousarray(dense.T) if table else dense)
        tree_big[name] = big
        # (a 4-bit embedding table's rows are looked up from its plain panels: the bf16 one serves)
        tree_few[name] = q if isinstance(big, PackedWeight) and (q.bits == 8 or not table) else big

    large, small = dict(params), dict(params)
    large["layers"], small["layers"] = [], []
    for layer in params["layers"]:
        big, few = dict(layer), dict(layer)
        for name in LAYER_MATRICES:
            if isinstance(layer.get(name), QuantizedWeight):
                both(big, few, name)
        large["layers"].append(big)
        small["layers"].append(few)
    for name in ("lm_head", "embed"):
        if isinstance(params.get(name), QuantizedWeight):   # stored as the LM head [hidden, vocab]
            both(large, small, name, table=name == "embed")
    return large, small if codes else None


def weight_bytes(*trees) -> int:
    """Bytes of every array in params trees (quantized codes, scales and offsets included; an array
    two trees share counted once; None trees skipped)."""
    leaves = {id(x): x for tree in trees if tree is not None for x in jax.tree_util.tree_leaves(tree)}
    return sum(int(x.nbytes) for x in leaves.values())
