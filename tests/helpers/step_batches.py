"""Building a paged, ragged `decoder.forward` batch by hand, laid out as the runner lays it out
(tests/models/test_models.py, tests/models/test_loader.py)."""

from __future__ import annotations

import numpy as np

from jaxllm.models import decoder
from jaxllm.models.step_inputs import StepInputs
from jaxllm.runner.compile import Bucket


def make_batch(chunks, page_tables, *, cfg, page_size: int, num_tokens: int, num_seqs: int, attention=None):
    """One step's `StepInputs` for `decoder.forward`, laid out as the runner lays them out.

    chunks: per sequence `(token_ids, start)`: its new tokens sit at positions
        `start .. start + len(token_ids) - 1` (the cache already holds positions `< start`).
    page_tables: `[len(chunks), pages_per_seq]` int32, each sequence's pages.
    Sequences of one token go first (decodes), then the rest, each sequence's tokens
    contiguous. Pads to `num_tokens` tokens (slot -1) and `num_seqs` sequences; the
    `attention` backend adds its own metadata (the `cpu` backend's rows).
    Returns `(inputs, where)`, `where[s]`: the token rows of sequence s in the batch.
    """
    order = sorted(range(len(chunks)), key=lambda s: len(chunks[s][0]) != 1)
    q_lens = np.array([len(chunks[s][0]) for s in order], np.int32)
    seq_lens = np.array([chunks[s][1] + len(chunks[s][0]) for s in order], np.int32)
    tables = np.asarray(page_tables, np.int32)[order].reshape(len(order), -1)
    total = int(q_lens.sum())
    assert total <= num_tokens and len(order) <= num_seqs

    inputs = StepInputs.zeros(num_tokens, num_seqs, tables.shape[1], len(cfg.inv_freq()))
    where, t = {}, 0
    for s, table in zip(order, tables):
        ids, start = chunks[s]
        pos = np.arange(start, start + len(ids))
        inputs.token_ids[t : t + len(ids)] = ids
        inputs.positions[t : t + len(ids)] = pos
        inputs.slot_mapping[t : t + len(ids)] = table[pos // page_size] * page_size + pos % page_size
        where[s] = np.arange(t, t + len(ids))
        t += len(ids)
    n = len(order)
    inputs.page_tables[:n], inputs.seq_lens[:n] = tables, seq_lens
    inputs.query_start_loc[1:] = total
    inputs.query_start_loc[1 : n + 1] = np.cumsum(q_lens)
    inputs.num_seqs[...] = n
    inputs.rope_cos, inputs.rope_sin = decoder.rope_tables(inputs.positions, cfg.inv_freq(), xp=np)
    if attention is not None:
        num_decodes = int((q_lens == 1).sum())
        rows = num_tokens // attention.prefill_row_tokens + num_seqs
        inputs.attn_metadata = attention.build_metadata(
            q_lens=q_lens,
            seq_lens=seq_lens,
            page_tables=tables,
            num_decodes=num_decodes,
            bucket=Bucket(num_tokens, num_seqs, rows, num_seqs),
        )
    return inputs, where


def shuffled_page_tables(rng, seq_lens, *, page_size: int, pages_per_seq: int, num_pages: int):
    """Give each sequence its pages from a shuffled pool (non-contiguous, out of order);
    unused table entries point at pages in use (attention must mask them by kv_lens)."""
    perm = rng.permutation(num_pages)
    tables, used = np.zeros((len(seq_lens), pages_per_seq), np.int32), 0
    for s, n in enumerate(seq_lens):
        need = -(-n // page_size)
        assert need <= pages_per_seq and used + need <= num_pages
        tables[s, :need] = perm[used : used + need]
        tables[s, need:] = rng.choice(perm[: used + need], pages_per_seq - need)
        used += need
    return tables
