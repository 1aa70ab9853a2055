"""A params tree's weights quantized for a run (`quantize_params`), and their bytes."""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.quantization.activations import with_bf16_activations, with_factored, with_int8_activations
from jaxllm.quantization.sharding import make_sharded_weight, shard_checkpoint_weight
from jaxllm.quantization.weights import (
    EXPERT_MATRICES,
    LAYER_MATRICES,
    METHODS,
    QuantizedWeight,
    make_weight,
    relayout,
)


def quantize_params(params: dict, cfg, plan, *, device=None, parts=None) -> dict:
    """Replace, in place, the linears to which the weight plan (jaxllm/weights/plan.py) gives
    codes by QuantizedWeights, one matrix at a time; the checkpoint's own codes are only laid
    out for their kernel. Float matrices the plan leaves float stay as they are.

    One device (`parts` None): on `device`, in the C++ GEMM's panels where the linear's kernel
    is "cpp" (and its shape allows it), else plain. Sharded (`parts`: {name: (column parts, row
    parts)} for the tree's `layout.shard_layout`, from `parallel.quantized_parts`): plain-layout
    host arrays that split so (`make_sharded_weight`, `shard_checkpoint_weight`), for
    `parallel.shard_params` to place. MoE experts' stacks: weight-only codes, plain. A linear's
    `activations` (`LinearPlan.activations`) are applied where its weight's shape and bits allow."""

    def make(w, name: str, table: bool = False):
        lp = plan.linear(name)
        if isinstance(w, QuantizedWeight):  # the checkpoint's codes
            if parts is not None:
                return shard_checkpoint_weight(w, *parts[name], what=f"{lp.codes} {name}")
            w = relayout(w, lp.kernel == "cpp", device)
        elif lp.codes not in METHODS:
            return w
        else:
            activations = "int8" if lp.codes == "w8a8" else "float"
            if parts is not None:
                return make_sharded_weight(w, lp.codes, activations, *parts[name])
            w = make_weight(
                np.asarray(w, np.float32),
                lp.codes,
                panels=lp.kernel == "cpp",
                activations=activations,
                device=device,
                group_size=plan.int4_group if lp.codes == "int4" else None,
            )
        if lp.activations in ("int8", "int8_float_factored"):  # (a table's rows are looked up from its panels)
            # (Under float32 8-bit codes that fit 6 bits too: their int8 GEMM runs on AVX2.)
            q = w if table else with_int8_activations(w, device, six_bit=plan.dtype == "float32")
            return with_factored(w, device) if q is w and lp.activations == "int8_float_factored" else q
        if lp.activations == "float_factored":
            return with_factored(w, device)
        # (A 4-bit embedding table keeps its layout: its rows are looked up from the panels.)
        if lp.activations in ("bf16", "factored") and (not table or w.bits == 8):
            w = with_bf16_activations(w, device)
            if lp.activations == "factored":
                w = with_factored(w, device)
        return w

    def make_experts(w, name: str):
        codes = plan.linear(name).codes
        if codes not in METHODS:
            return w
        q = make_sharded_weight(w, codes, "float", *(parts[name] if parts is not None else (1, 1)))
        return q if parts is not None else jax.device_put(q, device)

    for layer in params["layers"]:
        for name in LAYER_MATRICES:
            if name in layer:
                layer[name] = make(layer[name], name)
        for name in EXPERT_MATRICES:
            if name in layer:
                layer[name] = make_experts(layer[name], name)
    if "lm_head" in params:
        params["lm_head"] = make(params["lm_head"], "lm_head")
    if isinstance(params["embed"], QuantizedWeight):
        params["embed"] = make(params["embed"], "embed", table=True)
    elif cfg.tie_word_embeddings and plan.linear("embed").codes in METHODS:
        params["embed"] = make(np.ascontiguousarray(np.asarray(params["embed"], np.float32).T), "embed", table=True)
    return params


def panel_layout(params: dict) -> dict:
    """A params tree with every QuantizedWeight (a checkpoint's codes) in the C++ GEMM's panels
    where its shape allows, as host-side arrays for the params cache (`load_model(panels=True)`)."""
    return jax.tree_util.tree_map(
        lambda w: relayout(w, True) if isinstance(w, QuantizedWeight) else w,
        params,
        is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )


# Steps of at most this many rows multiply a GGUF's codes, larger ones its bf16 weights
# (`weights.prepare.small_step_params`): on Zen 4 the bf16 GEMM over 4-bit codes ran the layer GEMMs of a decode
# step at 1.13x the bf16 panels at 1 row, 1.31x at 2 and 1.44x at 4, but 0.85x at 8
# (`benchmarks/weight_stream.py`): from a few rows the conversion costs more than the bytes saved.
SMALL_STEP_ROWS = 4


def weight_bytes(*trees) -> int:
    """Bytes of every array in params trees (quantized codes, scales and offsets included; an array
    two trees share counted once; None trees skipped)."""
    leaves = {id(x): x for tree in trees if tree is not None for x in jax.tree_util.tree_leaves(tree)}
    return sum(int(x.nbytes) for x in leaves.values())
