"""The GPU kernels' tests without a GPU (lowering for `cuda`, on every JAX line we support) and
with one (`INTERPRET`: the same numerics tests run the kernels compiled, not interpreted).

jax 0.10 lowers a Pallas GPU kernel for `cuda` as it is; from jax 0.11 the Triton lowering asks
which GPU it is for, given as an abstract device of an abstract mesh (an H100 here), and
`shard_map` checks its specs against the arguments' shardings, so sharded arguments carry them.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

try:  # jax >= 0.11
    from jax.sharding import AbstractDevice, AxisType, use_abstract_mesh
except ImportError:  # jax 0.10
    AbstractDevice = None


# Where JAX's default backend is a GPU, the kernels' numerics tests run them compiled for it;
# elsewhere in Pallas interpret mode on the CPU.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def gpu_mesh(devices: int = 1, axis: str = "model") -> AbstractMesh:
    """An abstract mesh of `devices` H100s along `axis` (no device attached on jax 0.10)."""
    if AbstractDevice is None:
        return AbstractMesh((devices,), (axis,))
    device = AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    return AbstractMesh((devices,), (axis,), axis_types=(AxisType.Explicit,), abstract_device=device)


def arg(shape, dtype, mesh: AbstractMesh | None = None, spec=P()):
    """An abstract argument, sharded as `spec` over `mesh` when one is given."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else NamedSharding(mesh, spec))


def lower_for_cuda(f, *args, mesh: AbstractMesh | None = None) -> str:
    """The StableHLO text of jit(f) on abstract `args`, lowered for `cuda` on this (GPU-less) machine."""
    mesh = mesh or gpu_mesh()
    context = contextlib.nullcontext() if AbstractDevice is None else use_abstract_mesh(mesh)
    with context:
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
