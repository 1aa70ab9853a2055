"""Tensor, pipeline and data parallelism on a `jax.sharding.Mesh`: one SPMD program, shardings
on the arrays.

The mesh has axes ("data", "stage", "model"). Each slice of it along "data" is a data-parallel
replica, an `EngineCore` with its own scheduler and KV pool (engine/core.py,
`DataParallelEngineCore`). Within a replica, the decoder layers are split into pipeline stages
along "stage", and each stage's layers over "model" by tensor parallelism (Megatron layout, the
rules next to the model: `layout.TP_SPLIT_DIMS`, `layout.shard_layout`). For TP 2 x PP 2:

    mesh ("stage", "model"):    model 0              model 1
      stage 0 (layers 0..L/2)   device 0             device 1
      stage 1 (layers L/2..L)   device 2             device 3

    per device:
    wqkv, w_gate_up:   its stage's layers, columns 1/tp  (column-parallel: own heads, own MLP slice)
    wo, w_down:        its stage's layers, rows 1/tp     (row-parallel: partial sums, psum'd over "model")
    KV pages:          its stage's layers, KV heads 1/tp (a copy per shard when KV heads < tp)
    embed, lm_head:    vocab 1/(pp*tp)                   (vocab-parallel over "stage" and "model" together)
    norms:             replicated

The model's forward and logits run per device inside `shard_map` (`sharded_forward`), so the
attention kernels (the C++ FFI call on CPU, Pallas on GPU) see only their shard's heads; the
sampler runs on the gathered logits, replicated. With pipeline stages the step splits its
batch into micro-batches that flow through the stages (`pipelined_forward`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.lora import layers as lora_layers
from jaxllm.models import decoder, layout

DATA_AXIS, STAGE_AXIS, MODEL_AXIS = "data", "stage", "model"


def make_mesh(
    tensor_parallel_size: int, data_parallel_size: int = 1, pipeline_parallel_size: int = 1, devices=None
) -> Mesh:
    """A ("data", "stage", "model") mesh of shape (dp, pp, tp) over the first devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = tensor_parallel_size * data_parallel_size * pipeline_parallel_size
    if len(devices) < need:
        hint = (
            f" (on CPU, split the host into virtual devices: XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{need}, set before JAX starts)"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size="
            f"{pipeline_parallel_size} x data_parallel_size={data_parallel_size} needs {need} devices; "
            f"{len(devices)} {devices[0].platform} device(s) are visible{hint}"
        )
    grid = np.asarray(devices[:need]).reshape(data_parallel_size, pipeline_parallel_size, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, STAGE_AXIS, MODEL_AXIS))


def engine_mesh(
    mesh: Mesh | None, tensor_parallel_size: int, data_parallel_size: int, pipeline_parallel_size: int = 1
) -> Mesh | None:
    """The caller's mesh, else one built for these sizes; None for one replica on one device."""
    if mesh is None and tensor_parallel_size * data_parallel_size * pipeline_parallel_size > 1:
        mesh = make_mesh(tensor_parallel_size, data_parallel_size, pipeline_parallel_size)
    return mesh


def replica_meshes(mesh: Mesh | None) -> list[Mesh | None]:
    """One mesh per data-parallel replica: the slices of `mesh` along "data"; [None] without a mesh."""
    if mesh is None:
        return [None]
    return [Mesh(mesh.devices[row : row + 1], mesh.axis_names) for row in range(mesh.shape[DATA_AXIS])]


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL_AXIS]


def pp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else dict(mesh.shape).get(STAGE_AXIS, 1)


def _vocab_axes(mesh: Mesh):
    """The axes the vocabulary (embed rows, lm_head columns) is split over."""
    return (STAGE_AXIS, MODEL_AXIS) if STAGE_AXIS in mesh.axis_names else MODEL_AXIS


def spec_for(path, mesh: Mesh) -> P:
    """The PartitionSpec of the parameter at tree `path` on `mesh`, from `layout.TP_SPLIT_DIMS`
    (by its name); with pipeline stages, a layer's arrays are stacked over "stage" first.
    A QuantizedWeight's codes, scales and offsets split as its matrix does (a tied embedding
    table is quantized as the LM head [hidden, vocab]: its dimension 1). A LoRAWeight's base
    splits as the matrix alone, its slots as `lora_spec` says."""
    fields = [getattr(key, "name", None) for key in path]
    if "base" in fields:  # a LoRAWeight's base matrix
        at = fields.index("base")
        path = (*path[:at], *path[at + 1 :])
    elif "a" in fields or "b" in fields:  # its slots
        at = fields.index("a") if "a" in fields else fields.index("b")
        return lora_spec(path[at - 1].key, fields[at], stages=pp_size(mesh) > 1)
    field = getattr(path[-1], "name", None)  # a QuantizedWeight's field
    if field is not None:
        path = path[:-1]
    name = getattr(path[-1], "key", None)
    dim = None if field == "perm" else layout.TP_SPLIT_DIMS.get(name)  # (act-order: every shard's x columns)
    if field is not None and name == "embed":
        dim = 1
    split = _vocab_axes(mesh) if name in ("embed", "lm_head") else MODEL_AXIS
    spec = [] if dim is None else [None] * dim + [split]
    if pp_size(mesh) > 1 and getattr(path[0], "key", None) == "layers":
        spec = [STAGE_AXIS, *spec]
    return P(*spec)


def lora_spec(name: str, field: str, stages: bool = False) -> P:
    """A LoRA slot stack's split (lora/layers.py, the plain layout: a [in, slots * W], b's one part
    [slots * W, out]): a column-parallel matrix's b splits by output column as the matrix does,
    a row-parallel one's a by input row; the rest is replicated (the products are then the
    shard's share of the matrix's, summed with it). `stages`: stacked [pp, ...] over "stage"."""
    row_parallel = layout.TP_SPLIT_DIMS.get(name) == 0
    if field == "a":
        spec = [MODEL_AXIS, None] if row_parallel else [None, None]
    else:
        spec = [None, None] if row_parallel else [None, MODEL_AXIS]
    return P(STAGE_AXIS, *spec) if stages else P(*spec)


def quantized_parts(mesh: Mesh) -> dict:
    """{name: (column parts, row parts)} for `quantization.quantize_params` on `mesh`: each
    matrix's codes and scales split as `spec_for` splits them."""
    tp = tp_size(mesh)
    vocab = (tp * pp_size(mesh), 1)
    return {
        "wqkv": (tp, 1),
        "w_gate_up": (tp, 1),
        "w_up": (tp, 1),
        "wo": (1, tp),
        "w_down": (1, tp),
        "experts_gate_up": (tp, 1),
        "experts_down": (1, tp),
        "lm_head": vocab,
        "embed": vocab,
    }


def param_specs(params, mesh: Mesh):
    """A PartitionSpec per parameter."""
    return jax.tree_util.tree_map_with_path(lambda path, _: spec_for(path, mesh), params)


def param_shardings(mesh: Mesh):
    """key path -> the NamedSharding `spec_for` gives it on `mesh` (`load_model(shardings=...)`)."""
    return lambda path: NamedSharding(mesh, spec_for(path, mesh))


def shard_params(params, mesh: Mesh):
    """Place `params` (in `layout.shard_layout` for the mesh's sizes) on the mesh: each device
    gets its shard (replicated over "data"). Arrays already placed so are left as they are."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, spec_for(path, mesh))), params
    )


def replica_params(params, row: Mesh):
    """The shards of `params` (placed on the whole mesh) that live on one replica's row, as
    arrays of that row's mesh; nothing is copied. Arrays not placed on a mesh (weights still to
    be quantized) stay as they are, in a tree of the replica's own (its runner replaces leaves in
    place)."""
    devices = set(row.devices.flat)

    def take(path, x):
        if not isinstance(getattr(x, "sharding", None), NamedSharding):
            return x
        shards = [s.data for s in x.addressable_shards if s.device in devices]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(row, spec_for(path, row)), shards)

    return jax.tree_util.tree_map_with_path(take, params)


def kv_spec(mesh: Mesh) -> P:
    """KV pages `[kv_heads, pages, page, head_dim]` split by KV head; with pipeline stages,
    `[pp, kv_heads, ...]` for a stage's layer slot, split by stage too."""
    return P(STAGE_AXIS, MODEL_AXIS) if pp_size(mesh) > 1 else P(MODEL_AXIS)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, kv_spec(mesh))


def sharded_forward(
    params, kv_cache, inputs, cfg: decoder.ModelConfig, *, attention, mesh: Mesh, cpp_ops: bool = False
):
    """`decoder.forward` + `compute_logits` on the rows to sample, one shard per device.
    Returns (logits [N, vocab] replicated, kv_cache sharded by KV head)."""
    tp = tp_size(mesh)
    local = layout.tp_local_config(cfg, tp)

    def shard(params, kv_cache, inputs):
        hidden, kv_cache = decoder.forward(
            params, kv_cache, inputs, local, attention=attention, axis=MODEL_AXIS, cpp_ops=cpp_ops
        )
        logits = decoder.compute_logits(params, hidden[inputs.logits_indices], local, axis=MODEL_AXIS)
        return logits, kv_cache

    # check_vma off: the gathered logits are the same on every shard, which the type system
    # of shard_map cannot see through all_gather.
    return jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(param_specs(params, mesh), P(MODEL_AXIS), P()),
        out_specs=(P(), P(MODEL_AXIS)),
        check_vma=False,
    )(params, kv_cache, inputs)


def _micro_batch_inputs(unpack, ints, floats, m):
    """Micro-batch `m`'s `StepInputs` (a traced index: a stage's micro-batch at one tick); where
    `m` is out of range (a fill or drain tick) the stage computes on micro-batch 0 or M - 1
    with its KV writes dropped (slot -1)."""
    num_micro = ints.shape[0]
    busy = (m >= 0) & (m < num_micro)
    mine = jnp.clip(m, 0, num_micro - 1)
    inputs = unpack(ints[mine], floats[mine])
    inputs.slot_mapping = jnp.where(busy, inputs.slot_mapping, -1)
    if inputs.window_slot_mapping is not None:
        inputs.window_slot_mapping = jnp.where(busy, inputs.window_slot_mapping, -1)
    return inputs


def pipelined_forward(
    params, kv_cache, ints, floats, *, unpack, cfg: decoder.ModelConfig, attention, mesh: Mesh, cpp_ops: bool = False
):
    """The forward of M micro-batches through the pipeline stages, as one program.

    `ints`, `floats` `[M, ...]`: each micro-batch's packed step inputs; `unpack(ints[m],
    floats[m])` gives its `StepInputs` (all M share one bucket). Tick t of M + pp - 1: stage s
    runs its layers on micro-batch t - s (stage 0 on the embeddings, the others on what the
    stage before sent at the end of tick t - 1, by `ppermute`), so after the first pp - 1
    ticks every stage is busy on a different micro-batch; a stage with none (the fill and
    drain ticks, (pp - 1) / (M + pp - 1) of its time) computes on padding that writes no KV.
    The last stage's rows to sample go to every device, whose vocabulary slices of the logits
    are gathered. Returns (logits [M * S, vocab] replicated, kv_cache).
    """
    tp, pp = tp_size(mesh), pp_size(mesh)
    num_micro = ints.shape[0]
    local = layout.tp_local_config(cfg, tp, pp)
    vocab = (STAGE_AXIS, MODEL_AXIS)

    def shard(params, kv_cache, ints, floats):
        stage = jax.lax.axis_index(STAGE_AXIS)
        layers = [jax.tree_util.tree_map(lambda x: x[0], layer) for layer in params["layers"]]
        cache = [(k[0], v[0]) for k, v in kv_cache]
        micro = [unpack(ints[m], floats[m]) for m in range(num_micro)]
        tokens = micro[0].token_ids.shape[0]
        embedded = decoder.embed(
            params,
            jnp.concatenate([x.token_ids for x in micro]),
            jnp.concatenate([x.positions for x in micro]),
            local,
            vocab,
        )
        embedded = embedded.reshape(num_micro, tokens, -1)
        carry, last = None, []
        for t in range(num_micro + pp - 1):
            inputs = _micro_batch_inputs(unpack, ints, floats, t - stage)
            x = embedded[min(t, num_micro - 1)]
            if carry is not None:
                x = jnp.where(stage == 0, x, carry)
            for i, layer in enumerate(layers):
                if inputs.lora_slots is not None:
                    layer = lora_layers.bind(layer, inputs.lora_slots)
                x, k, v = decoder.shared_decoder_layer(
                    layer, *cache[i], x, inputs, local, index=i, attention=attention, axis=MODEL_AXIS, cpp_ops=cpp_ops
                )
                cache[i] = (k, v)
            if t >= pp - 1:  # the last stage just finished micro-batch t - (pp - 1)
                last.append(x[micro[t - pp + 1].logits_indices])
            carry = jax.lax.ppermute(x, STAGE_AXIS, [(s, s + 1) for s in range(pp - 1)])
        hidden = jnp.concatenate(last)
        hidden = jax.lax.psum(jnp.where(stage == pp - 1, hidden, 0.0), STAGE_AXIS)
        logits = decoder.compute_logits(params, hidden, local, axis=vocab)
        return logits, [(k[None], v[None]) for k, v in cache]

    return jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(param_specs(params, mesh), kv_spec(mesh), P(), P()),
        out_specs=(P(), kv_spec(mesh)),
        check_vma=False,
    )(params, kv_cache, ints, floats)


# ----------------------------------------------------------------------------- several processes


def initialize_distributed(coordinator: str | None, num_processes: int, process_id: int) -> None:
    """Join a jax.distributed run (once per process, before JAX computes anything); no-op for one
    process. On CPU the cross-process collectives use gloo."""
    if coordinator is None and num_processes == 1:
        return
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


class StepChannel:
    """Process 0 (the leader: scheduler, server) tells the other processes what each engine step
    runs, so that every process issues the same programs, with the same inputs, in the same
    order. A message is a fixed int32 header, then the arrays it announces, all broadcast with
    `multihost_utils.broadcast_one_to_all`."""

    STOP, STEP = 0, 1
    HEADER = 4  # op, bucket index (-1: no model step), page copies, side inputs sent (a bit each)

    def __init__(self):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.is_leader = jax.process_index() == 0

    def send_header(self, op: int, bucket: int = -1, num_copies: int = 0, side: int = 0) -> None:
        self._broadcast(np.asarray([op, bucket, num_copies, side], np.int32))

    def receive_header(self) -> tuple[int, int, int, int]:
        op, bucket, copies, side = (int(x) for x in self._broadcast(np.zeros(self.HEADER, np.int32)))
        return op, bucket, copies, side

    def arrays(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Send (leader) or receive into arrays of these shapes and dtypes (followers)."""
        return [np.asarray(x) for x in self._broadcast(tuple(np.asarray(a) for a in arrays))]


def split_micro_batches(q_lens: np.ndarray, parts: int) -> list[np.ndarray]:
    """Indices of `q_lens` dealt into `parts` groups of about equal tokens (largest first, each
    to the group with the fewest tokens, then the fewest sequences), each in ascending order."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [[0, 0] for _ in range(parts)]
    for i in np.argsort(-q_lens, kind="stable"):
        g = min(range(parts), key=lambda j: load[j])
        groups[g].append(int(i))
        load[g][0] += int(q_lens[i])
        load[g][1] += 1
    return [np.asarray(sorted(g), np.int64) for g in groups]
