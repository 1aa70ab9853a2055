"""`SpeculativeConfig`: EngineArgs' `speculative_config` option (vLLM's dict, or its JSON),
parsed and checked."""

from __future__ import annotations

import dataclasses

from jaxllm.utils import QUANTIZATION_ALIASES, QUANTIZATION_METHODS, json_object

MAX_SPECULATIVE_TOKENS = 15  # a step verifies at most this many drafts per request


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (jaxllm/spec_decode): `num_speculative_tokens` drafts per running
    request per step, proposed by `method`, verified by the model in the same step. Steps
    speculate only while at most `disable_by_batch_size` requests run: bigger batches are
    compute-bound on CPU, where verifying k drafts costs about k + 1 tokens' work."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # n-gram
    prompt_lookup_max: int = 0
    disable_by_batch_size: int = 8
    model: str | None = None  # draft model: a path or hub id, as for the target
    quantization: str | None = None  # the draft model's (canonical, as EngineArgs'); None: the target's asked
    # The draft proposes only the first this many token ids (its LM head cut to them, in whole
    # panels of 16): a BPE vocabulary's ids follow its merges, the most frequent first. None: all.
    draft_vocab_size: int | None = None
    # A draft model stops proposing for a request once a draft's probability under it falls below
    # this (transformers' assistant_confidence_threshold); the step already dispatched after it
    # still adds its draft. 0: always num_speculative_tokens.
    draft_confidence_threshold: float = 0.0

    METHODS = ("ngram", "draft_model")

    def max_seqs(self, scheduler) -> int:
        """Most sequences a speculating step holds: disable_by_batch_size, within the
        `engine_config.SchedulerConfig`'s max_num_seqs and token budget (each sequence brings up
        to 1 + num_speculative_tokens tokens)."""
        return min(
            self.disable_by_batch_size,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens // (self.num_speculative_tokens + 1),
        )

    @classmethod
    def parse(cls, config: dict | str | None) -> SpeculativeConfig | None:
        """From vLLM's `speculative_config` (a dict or its JSON); raises ValueError when bad.
        For n-gram, prompt_lookup_min and _max default to each other, or both to 5 (vLLM's); a
        `model` without a method means a draft model."""
        if config is None:
            return None
        if isinstance(config, str):
            try:
                config = json_object(config)
            except ValueError as e:
                raise ValueError(f"speculative_config: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {config!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        known |= {"disable_by_batch_size", "model", "quantization", "draft_vocab_size", "draft_confidence_threshold"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported field(s) {unknown}; known: {sorted(known)}")
        model = config.get("model")
        method = config.get("method") or ("draft_model" if model is not None else None)
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config method must be one of {cls.METHODS}, got {method!r}")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: a draft model needs 'model', its path or hub id")
            lo = hi = 0
        else:
            lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        quantization = config.get("quantization")
        if quantization is not None and method != "draft_model":
            raise ValueError("speculative_config quantization is a draft model's: n-gram has none")
        if quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(
                f"speculative_config quantization must be one of {QUANTIZATION_METHODS}, got {quantization!r}"
            )
        vocab = config.get("draft_vocab_size")
        if vocab is not None and (
            method != "draft_model" or isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1
        ):
            raise ValueError(
                f"speculative_config draft_vocab_size is a draft model's positive token count, got {vocab!r}"
            )
        threshold = config.get("draft_confidence_threshold", 0.0)
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not 0.0 <= threshold < 1.0
            or (threshold and method != "draft_model")
        ):
            raise ValueError(
                "speculative_config draft_confidence_threshold is a draft model's probability in [0, 1), "
                f"got {threshold!r}"
            )
        draft = (
            (model, QUANTIZATION_ALIASES.get(quantization, quantization), vocab, float(threshold))
            if method == "draft_model"
            else (None, None, None, 0.0)
        )
        out = cls(method, config.get("num_speculative_tokens"), lo, hi, config.get("disable_by_batch_size", 8), *draft)
        out._check()
        return out

    def _check(self) -> None:
        """Raise ValueError for counts that are not positive or lookups that cross."""
        checked = ["num_speculative_tokens", "disable_by_batch_size"] + (
            ["prompt_lookup_min", "prompt_lookup_max"] if self.method == "ngram" else []
        )
        for name in checked:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
