"""Attention backends: one object per paged-attention implementation, chosen once.

    backend = get_attention_backend(name, platform)     # None picks the platform's default

Each backend has the same small interface:

- `write_kv(k_pages, v_pages, k, v, slot_mapping)`: store this step's keys/values
  (`kernels.write_kv`, a scatter; the native backend's is one in-place C++ call);
- `build_metadata(...)` (host, numpy): any inputs it needs beyond the ragged step inputs
  (`StepInputs.attn_metadata`); `dummy_metadata(bucket)` gives the same shapes for warm-up;
- `forward(q, k_pages, v_pages, inputs, *, sliding_window, sm_scale)` (device): ragged paged
  attention of q over the block tables, the contract of `kernels.ragged_paged_attention_reference`
  (`sliding_window` None or the window in tokens, `sm_scale` None for head_dim ** -0.5: static,
  per layer);
- `argmax_logsumexp(logits, token_mask)`: the greedy sampler's two row reductions (over the
  tokens a structured-output mask allows),
  `draw(logits, s, u, u_draft)`: the sampled rows' tokens (`runner.sampler.draw_xla`), and
  `rms_norm(x, weight, eps, delta, rows, dtype)`: a layer's RMSNorm with the residual add
  before it; the native backend does each in C++.

| name        | where         | what                                                            |
|-------------|---------------|-----------------------------------------------------------------|
| `native`    | CPU (default) | the C++ XLA FFI kernel (kernels/native.py), built on first use   |
| `cpu`       | CPU           | `jnp` rows: sequences regrouped on the host into query rows     |
| `mosaic`    | GPU (default on Hopper) | the Pallas Mosaic GPU kernel (kernels/paged_attention_mgpu.py); |
|             |               | calls it cannot serve (f32 / int8 / fp8 pages) go to Triton      |
| `pallas`    | GPU (default elsewhere) | the Pallas Triton kernel (kernels/paged_attention.py)  |
| `reference` | any           | the dense `jnp` oracle (slow; for tests)                        |

Choosing `native` builds the C++ library (seconds, cached on disk); nothing else here builds
or loads code, so importing this module and resolving a config stay cheap.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import kernels

logger = logging.getLogger(__name__)


class AttentionBackend:
    """The ragged contract: q [T, q_heads, head_dim] attends over `inputs.block_tables`,
    `inputs.seq_lens`, `inputs.query_start_loc`, `inputs.num_seqs` (runner/input_batch.py)."""

    name: str
    # Query tokens per prefill attention row: only the `cpu` backend regroups into rows, but
    # the step buckets are counted in them for every backend (runner/compile.py).
    prefill_row_tokens = 16

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def write_kv(self, k_pages, v_pages, k, v, slot_mapping):
        return kernels.write_kv(k_pages, v_pages, k, v, slot_mapping)

    def build_metadata(self, *, q_lens, seq_lens, block_tables, num_decodes, bucket) -> dict:
        return {}

    def dummy_metadata(self, bucket, max_blocks: int) -> dict:
        return {}

    def kernel(self, q, k_pages, v_pages, seq_lens, block_tables, query_start_loc, num_seqs, **options):
        raise NotImplementedError

    def forward(self, q, k_pages, v_pages, inputs, *, sliding_window=None, sm_scale=None):
        return self.kernel(q, k_pages, v_pages, inputs.seq_lens, inputs.block_tables, inputs.query_start_loc,
                           inputs.num_seqs, sliding_window=sliding_window, sm_scale=sm_scale)

    def argmax_logsumexp(self, logits, token_mask=None):
        """logits [S, V] f32 -> (argmax [S] int32, logsumexp [S] f32), over the tokens a packed
        `token_mask` [S, ceil(V / 32)] allows (None: all)."""
        from jaxllm.runner import sampler

        return sampler.xla_argmax_logsumexp(logits, token_mask)

    def draw(self, logits, s, u, u_draft):
        """Sampled rows' tokens [S] int32 from processed logits [S, V] (runner/sampler.py)."""
        from jaxllm.runner import sampler

        return sampler.draw_xla(logits, s, u, u_draft)

    def rms_norm(self, x, weight, eps, delta=None, rows=None, dtype=jnp.float32):
        """`models.decoder.rms_norm` of x [T, H] f32 (of `x + delta`, returned first, when delta
        is given) in `dtype`; `rows` (the real rows) lets a kernel skip a bucket's padding."""
        from jaxllm.models.decoder import rms_norm

        s = x if delta is None else x + delta
        normed = rms_norm(s, weight, eps).astype(dtype)
        return normed if delta is None else (s, normed)


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def kernel(self, *args, **options):
        return kernels.ragged_paged_attention_reference(*args, **options)


class PallasBackend(AttentionBackend):
    name = "pallas"

    def kernel(self, *args, **options):
        return kernels.ragged_paged_attention(*args, **options)


class MosaicBackend(AttentionBackend):
    """The Mosaic GPU kernel (warpgroup MMAs: compute capability 9.x), or the Triton kernel for a
    cache layout it does not read (decided per layer at trace time, logged once)."""

    name = "mosaic"

    def __init__(self):
        self._fallbacks: set[str] = set()

    def kernel(self, q, k_pages, *args, **options):
        from jaxllm.kernels import paged_attention_mgpu

        why = paged_attention_mgpu.unsupported(q.shape, k_pages.dtype, k_pages.shape[2])
        if why is None:
            return paged_attention_mgpu.ragged_paged_attention_mgpu(q, k_pages, *args, **options)
        if why not in self._fallbacks:
            self._fallbacks.add(why)
            logger.info("attention: the Triton kernel serves a %s", why)
        return kernels.ragged_paged_attention(q, k_pages, *args, **options)


def mosaic_gpu_capable(device) -> bool:
    """Whether `device` runs the Mosaic GPU kernel: a CUDA GPU of compute capability 9.x (Hopper's
    warpgroup MMA; Blackwell's tcgen05 MMAs are another kernel, not written yet)."""
    capability = str(getattr(device, "compute_capability", ""))
    return device.platform == "gpu" and capability.split(".")[0] == "9"


class NativeBackend(AttentionBackend):
    name = "native"

    def __init__(self):
        from jaxllm.kernels import native

        native.require()   # builds (or loads from the cache) and registers the C++ kernels
        self._native = native

    def write_kv(self, k_pages, v_pages, k, v, slot_mapping):
        return self._native.write_kv(k_pages, v_pages, k, v, slot_mapping)

    def kernel(self, *args, **options):
        return self._native.paged_attention_cpu(*args, **options)

    def argmax_logsumexp(self, logits, token_mask=None):
        return self._native.argmax_logsumexp(logits, token_mask)

    def draw(self, logits, s, u, u_draft):
        return self._native.sample_rows(logits, s.temperature, s.min_p, s.top_k, s.top_p, s.draft_tokens, u, u_draft)

    def rms_norm(self, x, weight, eps, delta=None, rows=None, dtype=jnp.float32):
        # One call for XLA:CPU's five unfused ops (csrc/norm.cc); padding rows come back zeros.
        if x.ndim != 2 or x.dtype != jnp.float32:
            return super().rms_norm(x, weight, eps, delta, rows, dtype)
        return self._native.rms_norm(x, weight, eps, delta, rows, dtype)


# Rows per part of the `cpu` backend (see kernels.paged_attention_rows): parts walk pages only
# up to their own longest row, and rows are sorted longest first.
ROWS_PER_PART = {"decode": 16, "prefill": 8}


class RowsBackend(AttentionBackend):
    """`jnp` attention over rows: decodes as one-token rows, prompt chunks split into rows of
    `prefill_row_tokens` query tokens (`kernels.ragged_to_rows`). Its metadata, per group
    ("decode", "prefill"): `{group}_token_idx [R, row_tokens]` (index into q; T = padding),
    `{group}_block_tables [R, max_blocks]`, `{group}_kv_lens [R]`, `{group}_q_lens [R]`."""

    name = "cpu"

    def build_metadata(self, *, q_lens, seq_lens, block_tables, num_decodes, bucket) -> dict:
        T, nd = bucket.num_tokens, num_decodes
        d = bucket.num_decode_rows
        idx = np.full((d, 1), T, np.int32)
        idx[:nd, 0] = np.arange(nd)
        meta = {"decode_token_idx": idx, "decode_block_tables": _padded(block_tables[:nd], d),
                "decode_kv_lens": _padded(seq_lens[:nd], d), "decode_q_lens": _padded(np.ones(nd, np.int32), d)}
        if bucket.num_prefill_rows:
            p_idx, p_bt, p_kv, p_q = kernels.ragged_to_rows(
                q_lens[nd:], seq_lens[nd:], block_tables[nd:], num_tokens=T,
                num_rows=bucket.num_prefill_rows, row_tokens=self.prefill_row_tokens)
            p_idx = np.where(p_idx < T, p_idx + int(q_lens[:nd].sum()), T).astype(np.int32)
            meta.update(prefill_token_idx=p_idx, prefill_block_tables=p_bt, prefill_kv_lens=p_kv,
                        prefill_q_lens=p_q)
        return meta

    def dummy_metadata(self, bucket, max_blocks: int) -> dict:
        meta = {}
        for group, rows, row_tokens in (("decode", bucket.num_decode_rows, 1),
                                        ("prefill", bucket.num_prefill_rows, self.prefill_row_tokens)):
            if rows:
                meta.update({f"{group}_token_idx": np.full((rows, row_tokens), bucket.num_tokens, np.int32),
                             f"{group}_block_tables": np.zeros((rows, max_blocks), np.int32),
                             f"{group}_kv_lens": np.zeros(rows, np.int32),
                             f"{group}_q_lens": np.zeros(rows, np.int32)})
        return meta

    def forward(self, q, k_pages, v_pages, inputs, *, sliding_window=None, sm_scale=None):
        meta = inputs.attn_metadata
        q_pad = jnp.concatenate([q, jnp.zeros_like(q[:1])])  # row T is the padding sink
        out = jnp.zeros_like(q_pad)
        for group, rows_per_part in ROWS_PER_PART.items():
            idx = meta.get(f"{group}_token_idx")
            if idx is None:
                continue
            o = kernels.paged_attention_rows(
                q_pad[idx], k_pages, v_pages, meta[f"{group}_block_tables"], meta[f"{group}_kv_lens"],
                meta[f"{group}_q_lens"], rows_per_part=rows_per_part, sliding_window=sliding_window, sm_scale=sm_scale)
            out = out.at[idx].set(o)
        return out[:q.shape[0]]


def _padded(x: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, *x.shape[1:]), np.int32)
    out[:len(x)] = x
    return out


BACKENDS = {cls.name: cls for cls in (NativeBackend, RowsBackend, MosaicBackend, PallasBackend, ReferenceBackend)}


def get_attention_backend(name: str | None = None, platform: str | None = None) -> AttentionBackend:
    """The backend called `name`, or the platform's default: on CPU the C++ kernel, or the
    `jnp` rows when it cannot be built here (no C++ compiler; logged as a warning); on a Hopper
    GPU the Mosaic GPU kernel, on other GPUs the Triton one."""
    platform = platform or jax.default_backend()
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"attention backend must be one of {tuple(BACKENDS)}, got {name!r}")
        return BACKENDS[name]()
    if platform != "cpu":
        try:
            device = jax.devices(platform)[0]
        except RuntimeError:        # a platform this process has no device of (tests, lowering)
            return PallasBackend()
        return MosaicBackend() if mosaic_gpu_capable(device) else PallasBackend()
    try:
        return NativeBackend()
    except RuntimeError as e:
        logger.warning("native CPU attention unavailable (%s); using the slower jnp rows backend", e)
        return RowsBackend()


__all__ = ["AttentionBackend", "BACKENDS", "get_attention_backend", "mosaic_gpu_capable"]
