"""Tensor and data parallelism on a `jax.sharding.Mesh`: one SPMD program, shardings on the arrays.

The mesh has axes ("data", "model"). Each row of it ("data") is a data-parallel replica, an
`EngineCore` with its own scheduler and KV pool (engine/core.py, `DataParallelEngineCore`).
Within a row, tensor parallelism splits over "model" (Megatron layout, the rules next to the
model: `llama.TP_SPLIT_DIMS`, `llama.tp_layout`):

    device:            0            1          ...   tp-1
    wqkv, w_gate_up:   columns 0/tp  columns 1/tp     (column-parallel: own heads, own MLP slice)
    wo, w_down:        rows 0/tp     rows 1/tp        (row-parallel: partial sums, psum'd)
    embed, lm_head:    vocab 0/tp    vocab 1/tp       (vocab-parallel; logits all-gathered)
    norms:             replicated
    KV pages:          KV heads 0/tp KV heads 1/tp    (a copy per shard when KV heads < tp)

The model's forward and logits run per shard inside `shard_map` (`sharded_forward`), so the
attention kernels (the C++ FFI call on CPU, Pallas on GPU) see only their shard's heads; the
sampler runs on the gathered logits, replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.models import llama

DATA_AXIS, MODEL_AXIS = "data", "model"


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh of shape (data_parallel_size, tensor_parallel_size) over the first devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = tensor_parallel_size * data_parallel_size
    if len(devices) < need:
        hint = (f" (on CPU, split the host into virtual devices: XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{need}, set before JAX starts)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
                         f"needs {need} devices; {len(devices)} {devices[0].platform} device(s) are visible{hint}")
    grid = np.asarray(devices[:need]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def engine_mesh(mesh: Mesh | None, tensor_parallel_size: int, data_parallel_size: int) -> Mesh | None:
    """The caller's mesh, else one built for these sizes; None for one replica on one device."""
    if mesh is None and tensor_parallel_size * data_parallel_size > 1:
        mesh = make_mesh(tensor_parallel_size, data_parallel_size)
    return mesh


def replica_meshes(mesh: Mesh | None) -> list[Mesh | None]:
    """One (1, tp) mesh per data-parallel replica: the rows of `mesh`; [None] without a mesh."""
    if mesh is None:
        return [None]
    return [Mesh(mesh.devices[row:row + 1], mesh.axis_names) for row in range(mesh.shape[DATA_AXIS])]


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL_AXIS]


def spec_for(path) -> P:
    """The PartitionSpec of the parameter at tree `path`, from `llama.TP_SPLIT_DIMS` (by its name)."""
    dim = llama.TP_SPLIT_DIMS.get(getattr(path[-1], "key", None))
    return P() if dim is None else P(*([None] * dim + [MODEL_AXIS]))


def param_specs(params):
    """A PartitionSpec per parameter."""
    return jax.tree_util.tree_map_with_path(lambda path, _: spec_for(path), params)


def shard_params(params, mesh: Mesh):
    """Place `params` (already in `llama.tp_layout`) on the mesh: each device gets its shard
    (replicated over the "data" axis). Arrays already placed so are left as they are."""
    return jax.tree_util.tree_map_with_path(lambda path, x: jax.device_put(x, NamedSharding(mesh, spec_for(path))),
                                            params)


def replica_params(params, row: Mesh):
    """The shards of `params` (placed on the whole mesh) that live on one replica's row, as
    arrays of that row's mesh; nothing is copied."""
    devices = set(row.devices.flat)

    def take(path, x):
        shards = [s.data for s in x.addressable_shards if s.device in devices]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(row, spec_for(path)), shards)

    return jax.tree_util.tree_map_with_path(take, params)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages `[kv_heads, pages, page, head_dim]` split by KV head."""
    return NamedSharding(mesh, P(MODEL_AXIS))


def sharded_forward(params, kv_cache, inputs, spec: llama.ModelSpec, *, attention, mesh: Mesh):
    """`llama.forward` + `compute_logits` on the rows to sample, one shard per device.
    Returns (logits [N, vocab] replicated, kv_cache sharded by KV head)."""
    tp = tp_size(mesh)
    local = llama.tp_local_spec(spec, tp)

    def shard(params, kv_cache, inputs):
        hidden, kv_cache = llama.forward(params, kv_cache, inputs, local, attention=attention, axis=MODEL_AXIS)
        logits = llama.compute_logits(params, hidden[inputs.logits_indices], local, axis=MODEL_AXIS)
        return logits, kv_cache

    # check_vma off: the gathered logits are the same on every shard, which the type system
    # of shard_map cannot see through all_gather.
    return jax.shard_map(shard, mesh=mesh, in_specs=(param_specs(params), P(MODEL_AXIS), P()),
                         out_specs=(P(), P(MODEL_AXIS)), check_vma=False)(params, kv_cache, inputs)


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
    HEADER = 4    # op, bucket index (-1: no model step), page copies, has penalty tokens

    def __init__(self):
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.is_leader = jax.process_index() == 0

    def send_header(self, op: int, bucket: int = -1, num_copies: int = 0, penalties: bool = False) -> None:
        self._broadcast(np.asarray([op, bucket, num_copies, int(penalties)], np.int32))

    def receive_header(self) -> tuple[int, int, int, bool]:
        op, bucket, copies, penalties = (int(x) for x in self._broadcast(np.zeros(self.HEADER, np.int32)))
        return op, bucket, copies, bool(penalties)

    def arrays(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Send (leader) or receive into arrays of these shapes and dtypes (followers)."""
        return [np.asarray(x) for x in self._broadcast(tuple(np.asarray(a) for a in arrays))]
