"""Shared test helpers: building a paged, ragged `llama.forward` batch by hand."""

from __future__ import annotations

import numpy as np

from jaxllm import kernels


def make_batch(chunks, block_tables, *, page_size: int, num_tokens: int, num_seqs: int, q_block: int = 8):
    """One step's batch for `llama.forward`, with the keys of every attention impl.

    chunks: per sequence `(token_ids, start)`: its new tokens sit at positions
        `start .. start + len(token_ids) - 1` (the cache already holds positions `< start`).
    block_tables: `[len(chunks), pages_per_seq]` int32, each sequence's pages.
    Sequences of one token go first ("decode" rows of one token), then the rest ("prefill"
    rows of `q_block` tokens), each sequence's tokens contiguous, as the runner lays them out.
    Pads to `num_tokens` tokens (slot -1) and `num_seqs` sequences.
    Returns `(batch, where)`, `where[s]`: the token rows of sequence s in the batch.
    """
    order = sorted(range(len(chunks)), key=lambda s: len(chunks[s][0]) != 1)
    q_lens = np.array([len(chunks[s][0]) for s in order], np.int32)
    kv_lens = np.array([chunks[s][1] + len(chunks[s][0]) for s in order], np.int32)
    tables = np.asarray(block_tables, np.int32)[order].reshape(len(order), -1)
    total = int(q_lens.sum())
    assert total <= num_tokens and len(order) <= num_seqs

    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    where, t = {}, 0
    for s, table in zip(order, tables):
        ids, start = chunks[s]
        pos = np.arange(start, start + len(ids))
        token_ids[t : t + len(ids)] = ids
        positions[t : t + len(ids)] = pos
        slot_mapping[t : t + len(ids)] = table[pos // page_size] * page_size + pos % page_size
        where[s] = np.arange(t, t + len(ids))
        t += len(ids)

    pad_seqs = num_seqs - len(order)
    batch = {
        "token_ids": token_ids, "positions": positions, "slot_mapping": slot_mapping,
        # ragged contract ("reference" / "pallas")
        "kv_lens": np.concatenate([kv_lens, np.zeros(pad_seqs, np.int32)]),
        "block_tables": np.concatenate([tables, np.zeros((pad_seqs, tables.shape[1]), np.int32)]),
        "cu_q_lens": np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, total)]).astype(np.int32),
        "num_seqs": np.int32(len(order)),
    }
    # row groups ("cpu"); `ragged_to_rows` indexes from the group's first token
    num_decode = int((q_lens == 1).sum())
    groups = {"decode": (slice(0, num_decode), 1, num_seqs),
              "prefill": (slice(num_decode, None), q_block, num_tokens // q_block + num_seqs)}
    offset = 0
    for group, (sel, block, num_rows) in groups.items():
        idx, bt, kv, ql = kernels.ragged_to_rows(q_lens[sel], kv_lens[sel], tables[sel], num_tokens=num_tokens,
                                                 num_rows=num_rows, q_block=block)
        batch[f"{group}_token_idx"] = np.where(idx == num_tokens, num_tokens, idx + offset).astype(np.int32)
        batch[f"{group}_block_tables"], batch[f"{group}_kv_lens"], batch[f"{group}_q_lens"] = bt, kv, ql
        offset += int(q_lens[sel].sum())
    return batch, where


def shuffled_block_tables(rng, seq_lens, *, page_size: int, pages_per_seq: int, num_pages: int):
    """Give each sequence its pages from a shuffled pool (non-contiguous, out of order);
    unused table entries point at pages in use (attention must mask them by kv_lens)."""
    perm = rng.permutation(num_pages)
    tables, used = np.zeros((len(seq_lens), pages_per_seq), np.int32), 0
    for s, n in enumerate(seq_lens):
        need = -(-n // page_size)
        assert need <= pages_per_seq and used + need <= num_pages
        tables[s, :need] = perm[used : used + need]
        tables[s, need:] = rng.choice(perm[:used + need], pages_per_seq - need)
        used += need
    return tables
