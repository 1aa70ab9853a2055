"""Weights in and out of a running engine (`LLMEngine.get_weights` / `update_weights`).

Two trees matter here:

- the *model tree*: decoder.py's params as `models.checkpoint.build_params` makes them, float
  arrays, fused (`wqkv`, `w_gate_up`), matrices `[in, out]`, a dict per layer. A trainer holds
  and differentiates this one (models/training.py runs the same decoder code over it);
- the *engine tree*: what the runner steps with, the weight plan's form of the model tree
  (C++ panels, integer codes, the mesh's shard layout: weights/prepare.py).

`model_weights` goes from the second to the first (`get_weights`); `UpdatePlan.engine_weights`
from the first, or from a flat dict in HF checkpoint names, to the second, through the same
code the loader uses (`build_params` to fuse, `layout.shard_layout` to regroup and stack for a
mesh, `prepare_weights` to quantize and pack). A leaf the engine keeps exactly as given (its
dtype, shape and sharding, no packing) is taken as it is: the engine then steps with the
caller's buffers. The result must match the engine's tree leaf for leaf (shapes, dtypes,
shardings), so no compiled step changes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm import parallel
from jaxllm.models import layout
from jaxllm.models.checkpoint import build_params
from jaxllm.models.linear import PackedWeight
from jaxllm.quantization.weights import CHECKPOINT_METHODS, QuantizedWeight
from jaxllm.weights.plan import WeightPlan
from jaxllm.weights.prepare import prepare_weights

# What happens to requests in flight when the weights change (LLMEngine.update_weights).
IN_FLIGHT = ("keep", "wait", "abort")
# Buffers some HF state dicts carry beside the weights: not weights, skipped.
_NOT_WEIGHTS = ("rotary_emb.inv_freq", "attn.masked_bias", "attn.bias")


class WeightUpdateError(ValueError):
    """Weights the engine cannot take (names, shapes, dtypes, or a plan that cannot take float
    weights). The engine keeps its old weights."""


def _is_stored(x) -> bool:
    return isinstance(x, (PackedWeight, QuantizedWeight))


def _name(path) -> str:
    return jax.tree_util.keystr(path)


def unpack(panels: jax.Array, table: bool = False) -> jax.Array:
    """The float matrix `[in, out]` packed into panels (`kernels.gemm.pack_weight`): f32
    `[out / 16, in, 16]` or bf16 row pairs `[out / 16, in / 2, 16, 2]`; `table`: the tied
    embedding table packed as the LM head, returned as the table `[vocab, hidden]`."""
    if panels.ndim == 3:
        w = panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)
    else:
        w = panels.transpose(1, 3, 0, 2).reshape(2 * panels.shape[1], -1)
    return w.T if table else w


def model_weights(params, cfg, mesh=None, *, dtype: str | None = None, abstract: bool = False):
    """The model tree of the engine tree `params` (on `mesh`'s shard layout if given). Packed
    panels are unpacked (a copy); integer codes have no float form here: with `abstract` (under
    `jax.eval_shape`, for the tree's shapes) they stand as zeros in `dtype`, else they raise."""

    def leaf(path, x):
        table = getattr(path[0], "key", None) == "embed"
        if isinstance(x, PackedWeight):
            return unpack(x.panels, table)
        if isinstance(x, QuantizedWeight):
            if not abstract:
                raise WeightUpdateError(
                    f"{_name(path)} is stored as {x.bits}-bit codes: this engine has no float weights "
                    "to return (start it with quantization='none' to train beside it)"
                )
            k, n = x.shape
            lead = x.codes.shape[:-2] if x.layout == "plain" else ()  # (stacked pipeline stages)
            return jnp.zeros((*lead, *((n, k) if table else (k, n))), dtype)
        return x

    tree = jax.tree_util.tree_map_with_path(leaf, params, is_leaf=_is_stored)
    tp, pp = parallel.tp_size(mesh), parallel.pp_size(mesh)
    if tp == 1 and pp == 1:
        return tree
    if abstract:
        return layout.canonical_layout(tree, cfg, tp, pp)
    # The stacked and regrouped arrays on the host (slicing a sharded array along its mesh axis
    # is not XLA's business); the rest stay the engine's own.
    moved = {
        **tree,
        "layers": [
            {name: np.asarray(x) if pp > 1 or name in layout.REGROUPED else x for name, x in layer.items()}
            for layer in tree["layers"]
        ],
    }
    return layout.canonical_layout(moved, cfg, tp, pp, xp=np)


def model_sharding(path, mesh) -> NamedSharding:
    """The sharding of a model-tree leaf on `mesh`: split over "model" as the engine splits it
    (`parallel.spec_for`), replicated over pipeline stages and data replicas."""
    spec = list(parallel.spec_for(path, mesh))
    if parallel.pp_size(mesh) > 1 and getattr(path[0], "key", None) == "layers":
        spec = spec[1:]  # (the engine's layer arrays are stacked over stages first)
    return NamedSharding(mesh, PartitionSpec(*spec))


def is_hf_names(weights) -> bool:
    """Whether `weights` is a flat dict in HF checkpoint names ("model.layers.0.mlp.up_proj.weight")
    rather than a model tree."""
    return isinstance(weights, Mapping) and "layers" not in weights and all(isinstance(k, str) for k in weights)


def from_hf_names(weights: Mapping, cfg, dtype: str) -> dict:
    """The model tree of a flat dict of HF-named tensors (`[out, in]` linears, as a checkpoint or
    a PyTorch/Flax state dict holds them), fused by the loader's own `build_params`. Every
    weight the model reads must be there, and nothing else."""
    used = set()

    def get(name, shape):
        if name not in weights:
            raise WeightUpdateError(f"{name} is missing from the update (the model reads it)")
        x = np.asarray(jax.device_get(weights[name]))
        if x.shape != tuple(shape):
            raise WeightUpdateError(f"{name} has shape {x.shape}, the model's is {tuple(shape)}")
        if not np.issubdtype(x.dtype, np.floating) and x.dtype != jnp.bfloat16:
            raise WeightUpdateError(f"{name} has dtype {x.dtype}, not a float dtype")
        used.add(name)
        return x

    params = build_params(get, lambda name: name in weights, cfg, dtype)
    unknown = sorted(k for k in weights if k not in used and not k.endswith(_NOT_WEIGHTS))
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise WeightUpdateError(f"not weights of this model: {', '.join(unknown[:5])}{more}")
    return params


def checkpoint_weights(path: str, dtype: str) -> dict:
    """The model tree of the checkpoint at `path` (an HF directory or a GGUF file, dequantized),
    read by the loader afresh (not from the params cache: a trainer rewrites the same path)."""
    from jaxllm.models.loader import load_model

    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return load_model(path, dtype=dtype, use_cache=False, progress=False).params


def check_model_tree(tree, spec):
    """`tree` checked against the model tree's `spec` (ShapeDtypeStructs): the same leaves, the
    same shapes, float dtypes (cast to the spec's where they differ). Returns a new tree (new
    containers: `prepare_weights` replaces leaves in place), the caller's arrays as its leaves."""
    given = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    want, treedef = jax.tree_util.tree_flatten_with_path(spec)
    names = {_name(p) for p in given}
    expected = {_name(p) for p, _ in want}
    if names != expected:
        missing, extra = sorted(expected - names), sorted(names - expected)
        raise WeightUpdateError(
            "the update's tree is not the engine's: "
            + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing[:5])}" if missing else "",
                    f"unexpected {', '.join(extra[:5])}" if extra else "",
                )
                if part
            )
        )
    by_name = {_name(p): x for p, x in given.items()}
    leaves = []
    for path, s in want:
        x = by_name[_name(path)]
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise WeightUpdateError(f"{_name(path)} is a {type(x).__name__}, not an array")
        if tuple(x.shape) != tuple(s.shape):
            raise WeightUpdateError(f"{_name(path)} has shape {tuple(x.shape)}, the engine's is {tuple(s.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise WeightUpdateError(f"{_name(path)} has dtype {x.dtype}, not a float dtype")
        if x.dtype != s.dtype:
            x = x.astype(s.dtype) if isinstance(x, jax.Array) else np.asarray(x, s.dtype)
        leaves.append(x)
    return jax.tree_util.tree_unflatten(treedef, leaves)


@dataclasses.dataclass
class UpdatePlan:
    """How an engine takes new weights: its model config, weight plan, mesh (or one `device`),
    and the model tree's shapes and dtypes (`spec`), taken from its weights at start-up."""

    cfg: object
    plan: WeightPlan
    mesh: object
    device: object
    spec: object

    @classmethod
    def for_engine(cls, cfg, plan: WeightPlan, mesh, params) -> UpdatePlan:
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)  # (no shardings)
        spec = jax.eval_shape(lambda p: model_weights(p, cfg, mesh, dtype=plan.dtype, abstract=True), shapes)
        return cls(cfg, plan, mesh, None if mesh is not None else jax.devices()[0], spec)

    def refusal(self) -> str | None:
        """Why this engine cannot take float weights at all, or None."""
        plan = self.plan
        if plan.quantization in CHECKPOINT_METHODS or plan.small_step_codes:
            return (
                f"this engine serves the checkpoint's own {plan.quantization or 'GGUF'} codes, which float "
                "weights cannot replace: start it with quantization='none' (or int8_weight_only, int4, w8a8, "
                "which quantize each update) to update its weights"
            )
        return None

    def engine_weights(self, weights, *, tokenizer=None) -> tuple[dict, dict | None]:
        """(params, small_params) for the engine from `weights` (a model tree or HF names)."""
        refusal = self.refusal()
        if refusal is not None:
            raise WeightUpdateError(refusal)
        cfg, plan, mesh = self.cfg, self.plan, self.mesh
        if is_hf_names(weights):
            weights = from_hf_names(weights, cfg, plan.dtype)
        tree = check_model_tree(weights, self.spec)
        if mesh is None:  # (from a trainer's mesh, or the host; arrays already there stay as they are)
            tree = jax.device_put(tree, self.device)
            return prepare_weights(
                tree, cfg, plan, tokenizer=tokenizer, device=self.device, log=False, collapse_pages=False
            )
        tp, pp = parallel.tp_size(mesh), parallel.pp_size(mesh)
        if plan.quantization:  # as loaded: host arrays, each shard's codes made before it is placed
            tree = jax.tree.map(np.asarray, tree)
            if plan.smooth:  # (W8A8 smooths the whole matrices, then lays them out itself)
                return prepare_weights(tree, cfg, plan, mesh=mesh, tokenizer=tokenizer, log=False)
        if tp > 1 or pp > 1:  # regrouped / stacked on the host, as the loader lays them out
            tree = layout.shard_layout(tree, cfg, tp, pp)
        return prepare_weights(tree, cfg, plan, mesh=mesh, log=False)


def check_same_form(new, old) -> None:
    """Raise unless `new` is `old`'s tree with leaves of the same shapes, dtypes and shardings
    (what the compiled steps were compiled for)."""
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
    if new_def != old_def:
        raise WeightUpdateError(f"the prepared weights' tree is not the engine's ({new_def} vs {old_def})")
    for (path, x), (_, y) in zip(new_leaves, old_leaves):
        if x.shape != y.shape or x.dtype != y.dtype or x.sharding != y.sharding:
            raise WeightUpdateError(
                f"{_name(path)}: prepared as {x.dtype}{list(x.shape)} on {x.sharding}, "
                f"the engine steps with {y.dtype}{list(y.shape)} on {y.sharding}"
            )


__all__ = [
    "IN_FLIGHT",
    "UpdatePlan",
    "WeightUpdateError",
    "check_same_form",
    "from_hf_names",
    "is_hf_names",
    "model_sharding",
    "model_weights",
    "unpack",
]
