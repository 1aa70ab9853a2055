"""Ragged paged attention in plain `jnp`: the oracle the kernels are tested against.

Contract shared with the Pallas kernel (`paged_attention.py`):

    q:            [T, num_q_heads, head_dim]     (rows past cu_q_lens[num_seqs] are padding)
    k_pages:      [num_kv_heads, num_pages, page_size, head_dim]   (same for v_pages)
    kv_lens:      [S] int32   tokens in each sequence's cache, this step's included
    page_tables: [S, pages_per_seq] int32
    cu_q_lens:    [S + 1] int32   sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1] of q
    num_seqs:     int32 scalar, sequences past it are padding

Row i of sequence s (q_len rows) sits at position kv_lens[s] - q_len + i and attends causally
to positions 0..that position. Padding rows come out as zeros.

`ragged_paged_attention_reference` is written for clarity (it gathers a whole context per
query token), not speed; the `jnp` path that serves (the `cpu` backend) is kernels/rows.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels.kv_write import logical_pages

NEG_INF = -1e30


def mask_scores(s, q_pos, k_pos, sliding_window, logits_soft_cap):
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return jnp.where(mask, s, NEG_INF), mask


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logits_soft_cap", "causal"))
def ragged_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    sliding_window=None,
    logits_soft_cap=None,
    causal=True,
):
    """Oracle: per query token, gather its sequence's whole context and attend densely
    (`causal` False: every key of the sequence, as an encoder attends)."""
    num_tokens, num_q_heads, head_dim = q.shape
    k_pages, v_pages = logical_pages(k_pages), logical_pages(v_pages)
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, kv_lens.shape[0] - 1)
    valid = t < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])  # [T]
    if not causal:  # (each row as the sequence's last: every key of it passes the mask)
        q_pos = kv_lens[seq] - 1
    ctx = page_tables.shape[1] * page_size
    k = k_pages[:, page_tables[seq]].reshape(num_kv_heads, num_tokens, ctx, head_dim)
    v = v_pages[:, page_tables[seq]].reshape(num_kv_heads, num_tokens, ctx, head_dim)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("tkgd,ktcd->tkgc", qg, k.astype(jnp.float32)) * sm_scale
    k_pos = jnp.arange(ctx, dtype=jnp.int32)
    s, mask = mask_scores(s, q_pos[:, None, None, None], k_pos[None, None, None, :], sliding_window, logits_soft_cap)
    p = jnp.exp(s - s.max(-1, keepdims=True)) * mask
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    o = jnp.einsum("tkgc,ktcd->tkgd", p, v.astype(jnp.float32))
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
