"""`cpu`: `jnp` attention over rows (kernels/rows.py), where the C++ kernels cannot be built."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm import kernels
from jaxllm.attention.base import AttentionBackend

# Rows per part of the `cpu` backend (see kernels.paged_attention_rows): parts walk pages only
# up to their own longest row, and rows are sorted longest first.
ROWS_PER_PART = {"decode": 16, "prefill": 8}


class RowsBackend(AttentionBackend):
    """`jnp` attention over rows: decodes as one-token rows, prompt chunks split into rows of
    `prefill_row_tokens` query tokens (`kernels.ragged_to_rows`). Its metadata, per group
    ("decode", "prefill"): `{group}_token_idx [R, row_tokens]` (index into q; T = padding),
    `{group}_page_tables [R, max_pages]`, `{group}_kv_lens [R]`, `{group}_q_lens [R]`."""

    name = "cpu"

    def build_metadata(self, *, q_lens, seq_lens, page_tables, num_decodes, bucket) -> dict:
        T, nd = bucket.num_tokens, num_decodes
        d = bucket.num_decode_rows
        idx = np.full((d, 1), T, np.int32)
        idx[:nd, 0] = np.arange(nd)
        meta = {
            "decode_token_idx": idx,
            "decode_page_tables": _padded(page_tables[:nd], d),
            "decode_kv_lens": _padded(seq_lens[:nd], d),
            "decode_q_lens": _padded(np.ones(nd, np.int32), d),
        }
        if bucket.num_prefill_rows:
            p_idx, p_bt, p_kv, p_q = kernels.ragged_to_rows(
                q_lens[nd:],
                seq_lens[nd:],
                page_tables[nd:],
                num_tokens=T,
                num_rows=bucket.num_prefill_rows,
                row_tokens=self.prefill_row_tokens,
            )
            p_idx = np.where(p_idx < T, p_idx + int(q_lens[:nd].sum()), T).astype(np.int32)
            meta.update(prefill_token_idx=p_idx, prefill_page_tables=p_bt, prefill_kv_lens=p_kv, prefill_q_lens=p_q)
        return meta

    def dummy_metadata(self, bucket, max_pages: int) -> dict:
        meta = {}
        for group, rows, row_tokens in (
            ("decode", bucket.num_decode_rows, 1),
            ("prefill", bucket.num_prefill_rows, self.prefill_row_tokens),
        ):
            if rows:
                meta.update(
                    {
                        f"{group}_token_idx": np.full((rows, row_tokens), bucket.num_tokens, np.int32),
                        f"{group}_page_tables": np.zeros((rows, max_pages), np.int32),
                        f"{group}_kv_lens": np.zeros(rows, np.int32),
                        f"{group}_q_lens": np.zeros(rows, np.int32),
                    }
                )
        return meta

    def forward(self, q, k_pages, v_pages, inputs, *, sliding_window=None, sm_scale=None, causal=True):
        if not causal:
            raise NotImplementedError("the cpu (rows) attention backend has no bidirectional attention: use native")
        meta = inputs.attn_metadata
        q_pad = jnp.concatenate([q, jnp.zeros_like(q[:1])])  # row T is the padding sink
        out = jnp.zeros_like(q_pad)
        for group, rows_per_part in ROWS_PER_PART.items():
            idx = meta.get(f"{group}_token_idx")
            if idx is None:
                continue
            o = kernels.paged_attention_rows(
                q_pad[idx],
                k_pages,
                v_pages,
                meta[f"{group}_page_tables"],
                meta[f"{group}_kv_lens"],
                meta[f"{group}_q_lens"],
                rows_per_part=rows_per_part,
                sliding_window=sliding_window,
                sm_scale=sm_scale,
            )
            out = out.at[idx].set(o)
        return out[: q.shape[0]]


def _padded(x: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, *x.shape[1:]), np.int32)
    out[: len(x)] = x
    return out
