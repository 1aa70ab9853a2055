"""`StepInputs`: what one step of the model reads besides its weights and pages (the runner
builds them: runner/input_batch.py; the decoder and the attention backends read them).

Shapes (T = bucket tokens, S = bucket sequences, P = pages per sequence, L = max_model_len):

    token_ids, positions, slot_mapping [T] int32    (slot -1 = padding, written nowhere)
    page_tables [S, P] int32, seq_lens [S] int32   (cache length after this step)
    window_*: a model with a window group (two KV cache groups, core/kv_cache_manager.py)
    has the windowed layers' slot_mapping, page_tables and attn_metadata here; else None
    query_start_loc [S + 1] int32                   (sequence s owns tokens [qsl[s], qsl[s+1]))
    num_seqs [] int32, logits_indices [R] int32     (the tokens that get logits: R = S, each
                                                    sequence's last; or R = T, every token)
    rope_cos, rope_sin [T, 1, W] f32                (W = len(ModelConfig.inv_freq()))
    lora_slots [T] int32                            (an engine with LoRA: each token's adapter
                                                    slot, -1 for none; else None: lora/layers.py)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    page_tables: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_seqs: np.ndarray
    logits_indices: np.ndarray
    rope_cos: np.ndarray
    rope_sin: np.ndarray
    attn_metadata: dict  # the attention backend's own arrays (jaxllm/attention/)
    window_slot_mapping: np.ndarray | None = None
    window_page_tables: np.ndarray | None = None
    window_attn_metadata: dict | None = None
    # Async scheduling: per token, the row of the previous step's sampled tokens that is its
    # token id (read on the device), or -1 for `token_ids`' own.
    prev_rows: np.ndarray | None = None
    lora_slots: np.ndarray | None = None

    @classmethod
    def zeros(
        cls,
        num_tokens: int,
        num_seqs: int,
        max_pages: int,
        rope_width: int,
        num_logits: int | None = None,
        window_group: bool = False,
        lora: bool = False,
    ) -> StepInputs:
        i32 = np.int32
        inputs = cls(
            token_ids=np.zeros(num_tokens, i32),
            positions=np.zeros(num_tokens, i32),
            slot_mapping=np.full(num_tokens, -1, i32),
            page_tables=np.zeros((num_seqs, max_pages), i32),
            query_start_loc=np.zeros(num_seqs + 1, i32),
            seq_lens=np.zeros(num_seqs, i32),
            num_seqs=np.zeros((), i32),
            logits_indices=np.zeros(num_logits or num_seqs, i32),
            rope_cos=np.ones((num_tokens, 1, rope_width), np.float32),
            rope_sin=np.zeros((num_tokens, 1, rope_width), np.float32),
            attn_metadata={},
            prev_rows=np.full(num_tokens, -1, i32),
            lora_slots=np.full(num_tokens, -1, i32) if lora else None,
        )
        if window_group:
            inputs.window_slot_mapping = inputs.slot_mapping.copy()
            inputs.window_page_tables = inputs.page_tables.copy()
            inputs.window_attn_metadata = {}
        return inputs

    def num_tokens(self):
        """The step's real tokens (the rest of the bucket's T rows are padding), as a scalar."""
        return self.query_start_loc[self.num_seqs]

    def num_logits(self):
        """At least the real rows of `logits_indices` (they come first): every token's with a
        row per token (speculative verification), else one per sequence."""
        return self.num_tokens() if self.logits_indices.shape[0] == self.token_ids.shape[0] else self.num_seqs

    def window_view(self) -> StepInputs:
        """These inputs as the windowed layers of a two-group model read them (their pages)."""
        return dataclasses.replace(
            self,
            slot_mapping=self.window_slot_mapping,
            page_tables=self.window_page_tables,
            attn_metadata=self.window_attn_metadata,
        )
