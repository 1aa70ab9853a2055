"""Attention backends: one object per paged-attention implementation, chosen once.

    backend = get_attention_backend(name, platform)     # None: the platform's default

Each backend has the same small interface:

- `write_kv(k_pages, v_pages, k, v, slot_mapping)`: store this step's keys/values
  (`kernels.write_kv`, a scatter; the native backend's is one in-place C++ call);
- `build_metadata(...)` (host, numpy): any inputs it needs beyond the ragged step inputs
  (`StepInputs.attn_metadata`); `dummy_metadata(bucket)` gives the same shapes for warm-up;
- `forward(q, k_pages, v_pages, inputs, *, sliding_window, sm_scale)` (device): ragged paged
  attention of q over the page tables, the contract of `kernels.ragged_paged_attention_reference`
  (`sliding_window` None or the window in tokens, `sm_scale` None for head_dim ** -0.5: static,
  per layer);

Norms and sampling are not attention's: the platform says whether the step runs them in C++
(`platforms.Platform.cpp_ops`: `models/decoder.add_norm`, `runner/sampler.sampling_ops`).

| name (module)            | where         | what                                                            |
|--------------------------|---------------|-----------------------------------------------------------------|
| `native` (native.py)     | CPU (default) | the C++ XLA FFI kernel (kernels/native.py), built on first use   |
| `cpu` (rows.py)          | CPU           | `jnp` rows: sequences regrouped on the host into query rows     |
| `mosaic` (mosaic.py)     | GPU (default on Hopper) | the Pallas Mosaic GPU kernel (kernels/paged_attention_mgpu.py); |
|                          |               | calls it cannot serve (f32 / int8 / fp8 pages) go to Triton      |
| `pallas` (pallas.py)     | GPU (default elsewhere) | the Pallas Triton kernel (kernels/paged_attention.py)  |
| `reference` (reference.py) | any          | the dense `jnp` oracle (slow; for tests)                        |

Choosing `native` builds the C++ library (seconds, cached on disk); nothing else here builds
or loads code, so importing this module and resolving a config stay cheap.
"""

from __future__ import annotations

import logging

import jax

from jaxllm.attention.base import AttentionBackend
from jaxllm.attention.mosaic import MosaicBackend, mosaic_gpu_capable
from jaxllm.attention.native import NativeBackend
from jaxllm.attention.pallas import PallasBackend
from jaxllm.attention.reference import ReferenceBackend
from jaxllm.attention.rows import RowsBackend
from jaxllm.platforms import Platform

logger = logging.getLogger(__name__)

BACKENDS = {cls.name: cls for cls in (NativeBackend, RowsBackend, MosaicBackend, PallasBackend, ReferenceBackend)}


def get_attention_backend(
    name: str | None = None, platform: str | Platform | None = None, *, batch_invariant: bool = False
) -> AttentionBackend:
    """The backend called `name`, or the platform's default (`Platform.attention_backend`; on a
    CPU without the C++ kernels, the `jnp` rows, logged as a warning with why). `platform`: a
    `Platform`, or a platform's name (default: JAX's default backend). `batch_invariant`: one
    kernel path for every work item (the native backend only; others raise ValueError)."""
    if name is None:
        platform = _platform(platform)
        name = platform.attention_backend
        if platform.name == "cpu" and name != "native":
            from jaxllm.kernels import native

            logger.warning(
                "native CPU attention unavailable (%s); using the slower jnp rows backend", native.unavailable_reason()
            )
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {tuple(BACKENDS)}, got {name!r}")
    if batch_invariant:
        if name != "native":
            raise ValueError(f"batch_invariant needs the native attention backend, not {name!r}")
        return BACKENDS[name](batch_invariant=True)
    return BACKENDS[name]()


def _platform(platform: str | Platform | None) -> Platform:
    """`platform` as a `Platform` (its C++ build confirmed), from its name if need be."""
    if isinstance(platform, Platform):
        return platform.confirmed()
    name = platform or jax.default_backend()
    try:
        device = jax.devices(name)[0]
    except RuntimeError:  # a platform this process has no device of (tests, lowering)
        return Platform(name)
    return Platform.detect(device).confirmed()


__all__ = ["AttentionBackend", "BACKENDS", "get_attention_backend", "mosaic_gpu_capable"]
