"""The step's typed inputs and the host-side state they are built from.

`StepInputs` (models/step_inputs.py: what the model reads) and `SamplingMetadata` (here: what
the sampler reads) are pytrees of arrays: the jitted step takes them as two arguments.

`InputBatch` keeps one *row* per request that is in the batch (vLLM's persistent batch):
its tokens so far, its page table and its sampling parameters, written once when the
request joins and then only extended (new tokens, new pages). Each step, `prepare` builds the
step's arrays from those rows with numpy indexing, without Python loops over tokens, into
buffers that persist per bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.core.request import Request
from jaxllm.models.step_inputs import StepInputs
from jaxllm.runner import logits_processors
from jaxllm.runner.compile import Bucket
from jaxllm.sampling_params import MAX_LOGIT_BIAS
from jaxllm.structured_output import token_filters

NUM_BANNED = 32  # stop/EOS ids a request can hold back under min_tokens
FLAG_ALL_GREEDY, FLAG_TOP_K_TOP_P, FLAG_PENALTIES, FLAG_LOGPROBS, FLAG_BANNED, FLAG_DRAFTS = range(6)
FLAG_GRAMMAR, FLAG_BIAS, FLAG_CUSTOM = 6, 7, 8
NUM_FLAGS = 9


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling state `[R]`, a row per logits row (runner/sampler.py applies it)."""

    temperature: np.ndarray  # f32, 0 = greedy
    top_p: np.ndarray  # f32
    top_k: np.ndarray  # int32, 0 = off, at most the vocabulary size
    min_p: np.ndarray  # f32
    presence_penalty: np.ndarray  # f32
    frequency_penalty: np.ndarray  # f32
    repetition_penalty: np.ndarray  # f32
    seeds: np.ndarray  # uint32
    output_index: np.ndarray  # int32, outputs so far (folds into the seed)
    output_start: np.ndarray  # int32, prompt length (where outputs start in penalty_tokens)
    penalty_tokens: np.ndarray  # [S, L] int32 prompt + output ids, -1 padding
    banned_tokens: np.ndarray  # [S, NUM_BANNED] int32 ids masked out (under min_tokens), -1 padding
    draft_tokens: np.ndarray  # int32, the draft this row's token verifies (speculative decoding), -1 none
    bias_ids: np.ndarray  # [S, MAX_LOGIT_BIAS] int32 token ids of the row's logit_bias, -1 padding
    bias_values: np.ndarray  # [S, MAX_LOGIT_BIAS] f32 their biases
    flags: np.ndarray  # [NUM_FLAGS] bool, batch-wide: which sampler stages run
    # Custom logits processors' state, "<index>.<name>" -> [S, ...] (runner/logits_processors.py).
    custom: dict = dataclasses.field(default_factory=dict)
    # [S, ceil(vocab / 32)] int32 packed bitmask of the tokens each row may sample (structured
    # output: bit t % 32 of word t // 32), -1 words for unconstrained rows; like penalty_tokens
    # it travels apart, usually as a cached all-ones device array (runner/token_masks.py).
    token_mask: np.ndarray | None = None

    @classmethod
    def zeros(cls, num_seqs: int, processors=()) -> SamplingMetadata:
        f32, i32 = np.float32, np.int32
        return cls(
            temperature=np.zeros(num_seqs, f32),
            top_p=np.ones(num_seqs, f32),
            top_k=np.zeros(num_seqs, i32),
            min_p=np.zeros(num_seqs, f32),
            presence_penalty=np.zeros(num_seqs, f32),
            frequency_penalty=np.zeros(num_seqs, f32),
            repetition_penalty=np.ones(num_seqs, f32),
            seeds=np.zeros(num_seqs, np.uint32),
            output_index=np.zeros(num_seqs, i32),
            output_start=np.zeros(num_seqs, i32),
            penalty_tokens=None,
            banned_tokens=np.full((num_seqs, NUM_BANNED), -1, i32),
            draft_tokens=np.full(num_seqs, -1, i32),
            bias_ids=np.full((num_seqs, MAX_LOGIT_BIAS), -1, i32),
            bias_values=np.zeros((num_seqs, MAX_LOGIT_BIAS), f32),
            flags=np.zeros(NUM_FLAGS, np.bool_),
            custom=logits_processors.zeros(processors, num_seqs),
        )

    @classmethod
    def concat(cls, parts: list[SamplingMetadata]) -> SamplingMetadata:
        """Several batches' metadata (jax arrays, inside the step) as one, rows in order; the
        batch-wide flags combined (all greedy if each is, any other stage if any needs it)."""
        fields = {
            f.name: jnp.concatenate([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(cls)
            if f.name not in ("flags", "penalty_tokens", "token_mask", "custom")
        }
        fields["custom"] = {k: jnp.concatenate([p.custom[k] for p in parts]) for k in parts[0].custom}
        flags = jnp.stack([p.flags for p in parts])
        flags = jnp.any(flags, axis=0).at[FLAG_ALL_GREEDY].set(jnp.all(flags[:, FLAG_ALL_GREEDY]))
        return cls(**fields, flags=flags, penalty_tokens=None)


# Per-row sampling parameters: (SamplingMetadata field, neutral value).
_ROW_PARAMS = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seeds": 0,
}


class InputBatch:
    """Rows of per-request state that persist across steps."""

    def __init__(
        self,
        max_rows: int,
        max_model_len: int,
        max_pages: int,
        page_size: int,
        vocab_size: int,
        num_groups: int = 1,
        processors=(),
    ):
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.token_ids = np.zeros((0, max_model_len), np.int32)
        self.num_tokens = np.zeros(0, np.int32)  # tokens written into the row
        self.num_prompt_tokens = np.zeros(0, np.int32)
        self.page_table = np.zeros((0, num_groups, max_pages), np.int32)  # per KV cache group
        self.min_tokens = np.zeros(0, np.int32)
        self.banned = np.zeros((0, NUM_BANNED), np.int32)  # ids held back until min_tokens
        self.bias_ids = np.zeros((0, MAX_LOGIT_BIAS), np.int32)  # logit_bias, -1 padding
        self.bias_values = np.zeros((0, MAX_LOGIT_BIAS), np.float32)
        self.params = {
            name: np.zeros(0, np.float32 if isinstance(v, float) else np.int64) for name, v in _ROW_PARAMS.items()
        }
        self.uses_penalties = np.zeros(0, np.bool_)
        self.wants_logprobs = np.zeros(0, np.bool_)
        self.uses_top_k_top_p = np.zeros(0, np.bool_)
        self.custom = logits_processors.ProcessorStates(processors, 0)
        self._grow(max_rows)

    def _grow(self, rows: int) -> None:
        old = len(self.num_tokens)
        for name in (
            "token_ids",
            "num_tokens",
            "num_prompt_tokens",
            "page_table",
            "min_tokens",
            "banned",
            "bias_ids",
            "bias_values",
            "uses_penalties",
            "wants_logprobs",
            "uses_top_k_top_p",
        ):
            arr = getattr(self, name)
            grown = np.zeros((rows, *arr.shape[1:]), arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        for name, arr in self.params.items():
            self.params[name] = np.concatenate([arr, np.zeros(rows - old, arr.dtype)])
        self.custom.grow(rows)
        self.free_rows += range(rows - 1, old - 1, -1)

    def remove(self, request_ids) -> None:
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self.free_rows.append(row)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Forget the row's tokens from `num_tokens` on (the request's tokens there changed):
        `rows_for` writes them again, with its pages from there."""
        row = self.row_of.get(request_id)
        if row is not None:
            self.num_tokens[row] = min(self.num_tokens[row], num_tokens)

    def rows_for(self, requests: list[Request]) -> np.ndarray:
        """The rows of `requests` (added if new), brought up to date with their tokens and
        pages: only what changed since the last step is written."""
        rows = np.empty(len(requests), np.int64)
        bs = self.page_size
        for i, req in enumerate(requests):
            row = self.row_of.get(req.request_id)
            if row is None:
                row = self._add(req)
            else:
                have, num_tokens = self.num_tokens[row], req.num_tokens
                if num_tokens > have:
                    self.token_ids[row, have:num_tokens] = req.token_slice(have, num_tokens)
                    self.num_tokens[row] = num_tokens
                    if self.custom.processors:
                        self.custom.update(row, self.token_ids[row, self.num_prompt_tokens[row] : num_tokens])
                # Pages from the one being written on: new pages, and a copy-on-write copy.
                first = req.num_computed_tokens // bs
                for g, table in enumerate(req.page_tables):
                    tail = table[first:]
                    self.page_table[row, g, first : first + len(tail)] = tail
            rows[i] = row
        return rows

    def _add(self, req: Request) -> int:
        if not self.free_rows:
            self._grow(2 * len(self.num_tokens))
        row = self.free_rows.pop()
        self.row_of[req.request_id] = row
        tokens = req.all_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.page_table[row] = 0
        for g, table in enumerate(req.page_tables):  # released pages included: never read
            self.page_table[row, g, : len(table)] = table
        p = req.sampling_params
        values = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": min(max(p.top_k, 0), self.vocab_size),
            "min_p": p.min_p,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
            "seeds": req.seed & 0xFFFFFFFF,
        }
        for name, value in values.items():
            self.params[name][row] = value
        # A grammar decides where a constrained output ends: min_tokens holds nothing back there
        # (the EOS it may require would leave no token to sample).
        grammar = req.grammar is not None and req.grammar.ends_output
        self.min_tokens[row] = 0 if grammar else min(p.min_tokens, self.max_model_len)
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
        self.banned[row] = -1
        self.banned[row, : len(banned[:NUM_BANNED])] = banned[:NUM_BANNED]
        bias = p.logit_bias or {}
        self.bias_ids[row], self.bias_values[row] = -1, 0.0
        self.bias_ids[row, : len(bias)] = list(bias)
        self.bias_values[row, : len(bias)] = list(bias.values())
        self.uses_penalties[row] = p.uses_penalties
        self.wants_logprobs[row] = p.logprobs is not None
        self.uses_top_k_top_p[row] = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0)
        if self.custom.processors:
            self.custom.add(row, p, req.prompt_token_ids, tokens[req.num_prompt_tokens :])
        return row

    def fill_sampling(
        self,
        out: SamplingMetadata,
        rows: np.ndarray,
        no_penalty_tokens,
        positions: np.ndarray | None = None,
        drafts: np.ndarray | None = None,
    ) -> None:
        """Write the sampling state of the step's logits rows into `out`: row i samples the
        token after position `positions[i]` (default: the newest token) of input-batch row
        `rows[i]`, verifying `drafts[i]` (default: none)."""
        n = len(rows)
        for name, neutral in _ROW_PARAMS.items():
            buf = getattr(out, name)
            buf[:n] = self.params[name][rows]
            buf[n:] = neutral
        seen = self.num_tokens[rows] if positions is None else positions + 1  # tokens before the sampled one
        num_out = np.maximum(seen - self.num_prompt_tokens[rows], 0)
        out.output_index[:n], out.output_index[n:] = num_out, 0
        out.output_start[:n], out.output_start[n:] = self.num_prompt_tokens[rows], 0
        holding = num_out < self.min_tokens[rows]
        out.banned_tokens[:n] = np.where(holding[:, None], self.banned[rows], -1)
        out.banned_tokens[n:] = -1
        out.draft_tokens[:n] = -1 if drafts is None else drafts
        out.draft_tokens[n:] = -1
        # logit_bias: copied only when a row has one (a request's first entry is its flag).
        biased = bool((self.bias_ids[rows, 0] >= 0).any())
        if biased:
            out.bias_ids[:n], out.bias_values[:n] = self.bias_ids[rows], self.bias_values[rows]
            out.bias_ids[n:] = -1
        elif out.flags[FLAG_BIAS]:  # (this buffer's last step had some: clear them)
            out.bias_ids[:] = -1
        penalties = self.uses_penalties[rows]
        if penalties.any():
            L = self.max_model_len
            keep = penalties[:, None] & (np.arange(L)[None, :] < seen[:, None])
            tokens = np.full((len(out.temperature), L), -1, np.int32)
            tokens[:n] = np.where(keep, self.token_ids[rows], -1)
            out.penalty_tokens = tokens
        else:
            out.penalty_tokens = no_penalty_tokens
        out.flags[:] = False
        out.flags[FLAG_ALL_GREEDY] = not (out.temperature[:n] > 0).any()
        out.flags[FLAG_TOP_K_TOP_P] = self.uses_top_k_top_p[rows].any()
        out.flags[FLAG_PENALTIES] = penalties.any()
        out.flags[FLAG_LOGPROBS] = self.wants_logprobs[rows].any()
        out.flags[FLAG_BANNED] = (out.banned_tokens[:n] >= 0).any()
        out.flags[FLAG_DRAFTS] = drafts is not None and (drafts >= 0).any()
        out.flags[FLAG_BIAS] = biased
        out.flags[FLAG_CUSTOM] = self.custom.fill(out.custom, rows)


class TokenMasks:
    """One bucket's host buffer of structured-output token masks, `[R, vocab / 32]` int32, -1
    (every token allowed) except on the rows the last `fill` wrote."""

    def __init__(self, num_rows: int, words: int):
        self.host = np.full((num_rows, words), -1, np.int32)
        self._written = np.zeros(0, np.int64)

    def fill(self, grammars) -> np.ndarray:
        """grammars: [(matcher, row, drafts)]: each matcher's mask into its row and, past each
        draft it allows, into the next rows (`token_filters.fill_masks`). Returns the buffer."""
        self.host[self._written] = -1
        self._written = np.concatenate([np.arange(row, row + 1 + len(drafts)) for _, row, drafts in grammars])
        token_filters.fill_masks(grammars, self.host)
        return self.host


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each leaf of a pytree of numpy arrays sits in two flat host buffers (int32 and
    float32), so a step's inputs go to the device in two transfers instead of one per leaf.
    Static (hashable) per bucket: `unpack` slices the buffers inside the jitted step. Each leaf
    starts on a 256-byte boundary (`ALIGN` elements): XLA hands a slice of a buffer to a custom
    call as it is, and the Mosaic GPU kernel's TMA copies refuse inputs not so aligned.

    int32 leaves are copied as they are, uint32 as their bits, bool as 0/1; float32 into the
    float buffer. Measured on the default buckets (23 leaves): one `device_put` of the pytree
    2.0 ms, of one buffer 0.35 ms (busy 2-core Zen 3).
    """

    ALIGN = 64  # elements of 4 bytes: 256 bytes (a class constant, not a field)

    treedef: object
    leaves: tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (numpy dtype name, offset, size, shape)
    num_ints: int
    num_floats: int

    @classmethod
    def of(cls, tree) -> PackedLayout:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        specs, sizes = [], {"i": 0, "f": 0}
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            kind = "f" if dtype == np.float32 else "i"
            if dtype not in (np.float32, np.int32, np.uint32, np.bool_):
                raise TypeError(f"cannot pack a {dtype} step input")
            specs.append((dtype.name, sizes[kind], leaf.size, tuple(leaf.shape)))
            sizes[kind] += leaf.size + -leaf.size % cls.ALIGN
        return cls(treedef, tuple(specs), sizes["i"], sizes["f"])

    def pack(self, tree, ints: np.ndarray, floats: np.ndarray) -> None:
        """Copy the leaves of `tree` (same structure and shapes) into `ints` and `floats`."""
        for leaf, (dtype, offset, size, _) in zip(jax.tree_util.tree_leaves(tree), self.leaves):
            if dtype == "float32":
                floats[offset : offset + size] = leaf.reshape(-1)
            elif dtype == "uint32":
                ints[offset : offset + size] = leaf.reshape(-1).view(np.int32)
            else:
                ints[offset : offset + size] = leaf.reshape(-1)

    def unpack(self, ints, floats):
        """The pytree back from the two (device) buffers; call inside jit."""
        out = []
        for dtype, offset, size, shape in self.leaves:
            x = (floats if dtype == "float32" else ints)[offset : offset + size].reshape(shape)
            if dtype == "uint32":
                x = jax.lax.bitcast_convert_type(x, jax.numpy.uint32)
            elif dtype == "bool":
                x = x != 0
            out.append(x)
        return jax.tree_util.tree_unflatten(self.treedef, out)


@dataclasses.dataclass
class BucketBuffers:
    """One bucket's persistent host buffers: the inputs, and the packed copy that is sent."""

    bucket: Bucket
    inputs: StepInputs
    sampling: SamplingMetadata
    layout: PackedLayout | None = None
    ints: np.ndarray | None = None
    floats: np.ndarray | None = None
    token_masks: TokenMasks | None = None


def fill(buf: np.ndarray, values, pad) -> None:
    """buf[:len(values)] = values, the rest = pad."""
    n = len(values)
    buf[:n] = values
    buf[n:] = pad
