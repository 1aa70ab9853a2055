"""The attention backends' small interface (one module per backend beside this one)."""

from __future__ import annotations

from jaxllm import kernels


class AttentionBackend:
    """The ragged contract: q [T, q_heads, head_dim] attends over `inputs.page_tables`,
    `inputs.seq_lens`, `inputs.query_start_loc`, `inputs.num_seqs` (runner/input_batch.py)."""

    name: str
    # Query tokens per prefill attention row: only the `cpu` backend regroups into rows, but
    # the step buckets are counted in them for every backend (runner/compile.py).
    prefill_row_tokens = 16
    # Whether `forward(..., causal=False)` works (an encoder's bidirectional attention).
    bidirectional = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def write_kv(self, k_pages, v_pages, k, v, slot_mapping):
        return kernels.write_kv(k_pages, v_pages, k, v, slot_mapping)

    def build_metadata(self, *, q_lens, seq_lens, page_tables, num_decodes, bucket) -> dict:
        return {}

    def dummy_metadata(self, bucket, max_pages: int) -> dict:
        return {}

    def kernel(self, q, k_pages, v_pages, seq_lens, page_tables, query_start_loc, num_seqs, **options):
        raise NotImplementedError

    def forward(self, q, k_pages, v_pages, inputs, *, sliding_window=None, sm_scale=None, causal=True):
        if not causal and not self.bidirectional:
            raise NotImplementedError(
                f"the {self.name} attention backend has no bidirectional attention (encoder models): use native"
            )
        return self.kernel(
            q,
            k_pages,
            v_pages,
            inputs.seq_lens,
            inputs.page_tables,
            inputs.query_start_loc,
            inputs.num_seqs,
            sliding_window=sliding_window,
            sm_scale=sm_scale,
            **({} if causal else {"causal": False}),
        )
