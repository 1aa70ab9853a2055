"""Loaded arrays -> the weight plan's weights (vLLM's `process_weights_after_loading`).

    loaded, plan = load_with_plan(args, platform, mesh, one_device=...)     # jaxllm/weights/plan.py
    params, small_params = prepare_weights(loaded.params, loaded.cfg, plan, mesh=mesh, tokenizer=...)

One step after loading, before any runner exists, in this order:

1. W8A8: smooth the float weights (quantization/smoothing.py, from a calibration run), then lay
   them out for the mesh;
2. give each linear the plan's codes (`quantization.quantize_params`: on the device, or as host
   arrays split per shard), or lay the checkpoint's own codes out for their kernel; a GGUF's
   blocks the plan no longer keeps (the C++ build failed after all) are dequantized;
3. one device: pack the float matrices into C++ panels (`pack_params`), place the tree, and for
   small-step codes make the bf16 tree and the codes tree (`small_step_params`);
   a mesh: place every shard (`parallel.shard_params`).

What each linear becomes is read from the plan, never re-derived here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import parallel
from jaxllm.models import layout
from jaxllm.models.linear import PackedWeight
from jaxllm.models.gguf_checkpoint import read_gguf
from jaxllm.models.loader import LoadedModel, load_model, local_gguf
from jaxllm.platforms import Platform
from jaxllm.quantization.activations import with_bf16_activations, with_factored, with_int8_activations
from jaxllm.quantization.gguf_blocks import int8_dot_codes
from jaxllm.quantization.params import quantize_params
from jaxllm.quantization.weights import (
    LAYER_MATRICES,
    QuantizedWeight,
    dequantize,
    relayout,
)
from jaxllm.utils import release_freed_memory
from jaxllm.weights import calibration
from jaxllm.weights.pages import on_huge_pages
from jaxllm.weights.plan import WeightPlan, resolve_weight_plan

logger = logging.getLogger("jaxllm")


class PreparedModel(NamedTuple):
    """A model ready for a runner: its model config and the plan's weights (`prepare_weights`)."""

    cfg: object
    params: dict
    small_params: dict | None = None
    check_path: str | None = None  # WeightPlan.check_path


def int8_dot_checkpoint(args, platform: Platform, one_device: bool) -> bool:
    """Whether dtype "auto" may weigh int8 activations for this run (`Platform.auto_dtype`): a
    platform where that choice exists (`Platform.weighs_int8_codes`), one device, no other
    quantization asked, int8 activations not refused, and a local GGUF whose every matrix has
    codes the int8 dot kernels take (`gguf_blocks.int8_dot_codes`; its header read: 0.1-0.25 s,
    only where it can matter). Speculative runs too: the 1.5B with the 0.5B drafting (int4) on
    the Zen 4 gave 37.8 / 33.6 tok/s on code / chat so against bf16's 32.1 / 31.8 (RESULTS.md)."""
    asked = args.dtype != "auto" or args.quantization not in (None, "gguf")
    if asked or not (one_device and platform.weighs_int8_codes):
        return False
    path = None if args.int8_activations is False else local_gguf(args.model)
    return path is not None and int8_dot_codes(read_gguf(path)[1])


def load_with_plan(
    args, platform: Platform, mesh, *, one_device: bool, progress: bool, use_cache: bool = True
) -> tuple[LoadedModel, WeightPlan]:
    """Load `args.model` as the weight plan asks, then resolve the plan again with what the
    checkpoint holds and the C++ build's final word: (loaded model, its weight plan).

    Weights to quantize on a mesh come as host arrays (each shard's codes are made before they
    are placed), and W8A8 reads them unsharded (smoothing sees whole matrices); the rest come
    laid out for the mesh (and placed on it)."""
    plan = resolve_weight_plan(args, platform, one_device=one_device)
    to_quantize = plan.quantization is not None
    loaded = load_model(
        args.model,
        cache_dir=args.params_cache_dir,
        progress=progress,
        use_cache=use_cache,
        tensor_parallel_size=1 if plan.smooth else args.tensor_parallel_size,
        pipeline_parallel_size=1 if plan.smooth else args.pipeline_parallel_size,
        shardings=None if to_quantize or mesh is None else parallel.param_shardings(mesh),
        on_host=to_quantize and mesh is not None,
        tokenizer_thread=True,
        **plan.load_options(),
    )
    try:
        plan = resolve_weight_plan(
            args,
            platform.confirmed(),
            one_device=one_device,
            checkpoint=loaded.quantization,
            tied=loaded.cfg.tie_word_embeddings,
            panels_bytes=bf16_bytes(loaded.params),
        )
    except ValueError as e:
        raise ValueError(f"{loaded.source}: {e}") from None
    return loaded, plan


def bf16_bytes(params: dict) -> int:
    """What the quantized matrices of `params` would take in bf16."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return sum(2 * int(np.prod(x.shape)) for x in leaves if isinstance(x, QuantizedWeight))


def prepare_weights(
    params: dict,
    cfg,
    plan: WeightPlan,
    *,
    mesh=None,
    tokenizer=None,
    device=None,
    log: bool = True,
    collapse_pages: bool = True,
) -> tuple[dict, dict | None]:
    """The plan's weights from loaded `params` (in `layout.shard_layout` for `mesh`'s sizes,
    except under W8A8 smoothing, which reads them whole): `(params, small_params)`, the second
    the codes tree of small-step codes or None. One device (`mesh` None): on `device` (default:
    JAX's first), advised onto 2 MiB pages and, with `collapse_pages`, moved there on a thread
    (`pages.on_huge_pages`; a weight update leaves that to the kernel's own pace). `params` is
    consumed (its matrices are replaced one at a time)."""
    untied = not cfg.tie_word_embeddings
    if untied and isinstance(params["embed"], QuantizedWeight) and plan.linear("embed").codes is None:
        params["embed"] = _dense(params["embed"], plan.dtype, table=True)  # a GGUF's table, kept as floats
    if plan.smooth:
        calibration.smooth_for_w8a8(params, cfg, tokenizer)
        if mesh is not None:
            params = layout.shard_layout(params, cfg, parallel.tp_size(mesh), parallel.pp_size(mesh))
    if mesh is not None:
        if plan.quantization:
            params = quantize_params(params, cfg, plan, parts=parallel.quantized_parts(mesh))
        if log:
            logger.info("weights: %s", plan.describe())
        return parallel.shard_params(params, mesh), None
    device = device or jax.devices()[0]
    if plan.quantization:
        params = quantize_params(params, cfg, plan, device=device)
    elif not plan.small_step_codes:
        params = _dequantized(params, cfg, plan.dtype)
    if plan.pack_floats:
        params = pack_params(params, cfg, device, bf16=plan.dtype == "bfloat16")
    params = jax.device_put(params, device)
    small_params = None
    if plan.small_step_codes:
        kinds = {name: lp.small_step_activations for name, lp in plan.linears.items()}
        int8, factored = ({name for name, kind in kinds.items() if kind == want} for want in ("int8", "factored"))
        params, small_params = small_step_params(params, device, int8=int8, factored=factored)
    if plan.gemm_path != "auto":
        params = with_gemm_path(params, plan.gemm_path)
        small_params = None if small_params is None else with_gemm_path(small_params, plan.gemm_path)
    if log:
        logger.info("weights: %s", plan.describe())
    release_freed_memory()  # (the loaded and converted copies: the heap keeps their pages otherwise)
    on_huge_pages((params, small_params), collapse=collapse_pages)
    return params, small_params


def pack_params(params: dict, cfg, device, *, bf16: bool = False) -> dict:
    """Replace, in place, each float matrix of `params` (no shard layout; float32, or bf16 with
    `bf16`: the C++ bf16 GEMM has AVX512_BF16 dots) by its `PackedWeight` on `device`, one
    matrix at a time: the extra memory is one matrix at most (packing the whole tree, then
    placing it, held each matrix up to three times). The tied embedding table is packed as the
    LM head it also is. Matrices that do not split into panels stay as they are."""
    from jaxllm.kernels import gemm

    dtypes = (jnp.float32, jnp.bfloat16) if bf16 else (jnp.float32,)

    def pack(w, transposed=False):
        if (
            isinstance(w, (PackedWeight, QuantizedWeight))
            or w.dtype not in dtypes
            or not gemm.packable(w.shape, transposed, w.dtype)
        ):
            return w
        w = w if isinstance(w, jax.Array) else np.asarray(w)
        return PackedWeight(jax.device_put(gemm.pack_weight(w, transposed, w.dtype), device))

    for layer in params["layers"]:
        for name in LAYER_MATRICES:
            if name in layer:
                layer[name] = pack(layer[name])
    if "lm_head" in params:
        params["lm_head"] = pack(params["lm_head"])
    if cfg.tie_word_embeddings:  # the table is the LM head too
        params["embed"] = pack(params["embed"], transposed=True)
    return params


def small_step_params(params: dict, device, codes: bool = True, int8=(), factored=()) -> tuple[dict, dict | None]:
    """A GGUF's params tree (its matrices kept quantized: `load_model(quantization="gguf")`) as
    (bf16 tree, codes tree): the first with every quantized matrix dequantized to bf16 and packed
    for the C++ bf16 GEMM (`models.linear.PackedWeight`: the weights a dequantizing load gives, bit for
    bit), the second sharing all of it but the layer matrices, which keep their codes for the bf16
    GEMM over codes (`with_bf16_activations`). Both compute the same numbers, the second from
    about a third of the layer weights' bytes: the steps of at most SMALL_STEP_ROWS rows take it
    (`ModelRunner`). Matrices are converted one at a time. `codes` False (the C++ build has no
    AVX512_BF16 dots after all): the bf16 tree alone, and None. `int8`: names of layer matrices
    whose 4-bit codes multiply int8 rows in the small steps instead (`with_int8_activations`:
    llama.cpp's numbers, not the bf16 panels'). `factored`: names of layer matrices whose 4-bit
    codes factor their group scales out of the small steps' sums (`QuantizedWeight.factored`)."""
    from jaxllm.kernels import gemm

    put = functools.partial(jax.device_put, device=device)

    def both(tree_big: dict, tree_few: dict, name: str, table: bool = False):
        """tree_big[name] (codes) as bf16 panels there, and as codes for the bf16 GEMM in tree_few."""
        w = tree_big[name]
        q = with_bf16_activations(relayout(w, True, device), device)
        if codes and q.activations == "bf16":  # converted as the GEMM over codes converts them
            big = PackedWeight(
                put(gemm.codes_to_bf16_panels(q.codes, q.scale, q.offset, q.bits, q.super_scale, q.super_offset))
            )
        else:  # a shape off the bf16 GEMM's panels, or no bf16 dots: the dense bf16 weight, unpacked
            dense = np.asarray(dequantize(w, np), jnp.bfloat16)  # [in, out], rounded to nearest even
            big = put(np.ascontiguousarray(dense.T) if table else dense)
        tree_big[name] = big
        if name in int8 and w.bits == 4:
            q = with_int8_activations(relayout(w, True, device), device)
        elif name in factored:
            q = with_factored(q, device)
        # (a 4-bit embedding table's rows are looked up from its plain panels: the bf16 one serves)
        tree_few[name] = q if isinstance(big, PackedWeight) and (q.bits != 4 or not table) else big

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
        if isinstance(params.get(name), QuantizedWeight):  # stored as the LM head [hidden, vocab]
            both(large, small, name, table=name == "embed")
    return large, small if codes else None


def with_gemm_path(params, path: str):
    """`params` with every C++ GEMM weight (packed panels, codes in panels) on kernel `path`."""

    def set_path(w):
        if isinstance(w, PackedWeight) or (isinstance(w, QuantizedWeight) and w.layout == "panels"):
            return dataclasses.replace(w, path=path)
        return w

    return jax.tree.map(set_path, params, is_leaf=lambda x: isinstance(x, (PackedWeight, QuantizedWeight)))


def _dequantized(params: dict, cfg, dtype: str) -> dict:
    """`params` with a checkpoint's codes the plan does not keep turned back into float
    matrices in `dtype` (a tied table stored as the LM head back to [vocab, hidden])."""

    dense = functools.partial(_dense, dtype=dtype)

    for layer in params["layers"]:
        for name in LAYER_MATRICES:
            if name in layer:
                layer[name] = dense(layer[name])
    if "lm_head" in params:
        params["lm_head"] = dense(params["lm_head"])
    params["embed"] = dense(params["embed"], table=True)
    return params


def _dense(w, dtype: str, table: bool = False):
    """A checkpoint's codes `w` as a float matrix in `dtype` (`table`: an embedding table stored
    as its LM head, back to [vocab, hidden]); anything else as it is."""
    if not isinstance(w, QuantizedWeight):
        return w
    out = np.asarray(dequantize(w, np), jnp.dtype(dtype))
    return np.ascontiguousarray(out.T) if table else out


__all__ = ["PreparedModel", "load_with_plan", "pack_params", "prepare_weights"]
