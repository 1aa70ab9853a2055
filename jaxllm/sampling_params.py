"""SamplingParams: how one request is decoded (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math

import numpy as np

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 128  # entries of one request's logit_bias (they travel in every step's inputs)
MAX_TEMPERATURE = 1e6  # past ~100 sampling is already uniform; float32 must hold it
# (low, high, low is allowed) of each float field; the server's request models publish the same.
FLOAT_RANGES = {
    "temperature": (0.0, MAX_TEMPERATURE, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True),
    "repetition_penalty": (0.0, 100.0, False),
}


def _finite32(x) -> bool:
    """True if `x` is a finite number that stays finite as float32."""
    try:
        return math.isfinite(x) and abs(x) < 3.4e38
    except OverflowError:  # an int too large for a float
        return False


@dataclasses.dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`): exactly one of

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular
    expression (Rust `regex` syntax); choice: one of these strings; grammar: a Lark grammar
    or a GBNF/EBNF one (llama.cpp's syntax).

    The grammar engine (jaxllm/structured_output) checks it when the request is added; an
    invalid schema, regex or grammar raises ValueError there."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        if isinstance(self.json, dict):
            try:
                json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"json must be a JSON schema: {e}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached by."""
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.json is not None:
            # (keys in the schema's order: properties are generated in it)
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """Per-request decoding options. Invalid values raise ValueError at construction.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k (a top_k past the vocabulary
    keeps it all); top_p 1.0 and min_p 0.0 disable theirs. Numbers must be finite. `seed` makes a
    request's samples reproducible whatever else is batched
    with it. `logprobs=N` returns the top-N log-probabilities (plus the sampled token's) per
    generated token. `structured_outputs` constrains the output to a JSON schema, regex,
    choice or grammar (`StructuredOutputsParams`); the request ends with "stop" once its
    grammar is complete.

    Logits processors (vLLM's built-ins): `logit_bias` {token id: bias in [-100, 100]} is added
    to the logits before sampling (at most MAX_LOGIT_BIAS entries; logprobs stay the model's);
    `allowed_token_ids` keeps sampling to those tokens and `bad_words` bans each word's last
    token wherever the output so far ends with its others (both as a mask, like a grammar's:
    masked tokens' logprobs are -inf).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict | None = None  # for custom logits processors (`LogitsProcessor.row_state`)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        def bad(name, value, allowed):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")

        for name, (low, high, low_ok) in FLOAT_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite32(value):
                bad(name, value, "a finite number")
            if not (low <= value if low_ok else low < value) or value > high:
                bad(name, value, f"in {'[' if low_ok else '('}{low:g}, {high:g}]")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (value is None or isinstance(value, int)):
                bad(name, value, "an integer")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                bad(name, value, f"an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "an integer")
        if any(not s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")
        self._verify_logits_processors(bad)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")

    def _verify_logits_processors(self, bad) -> None:
        def token_id(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", self.logit_bias, f"a dict of at most {MAX_LOGIT_BIAS} token ids to biases")
            for token, bias in self.logit_bias.items():
                if not token_id(token):
                    bad("logit_bias", token, "keyed by token ids (integers >= 0)")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    bad("logit_bias", bias, "biases in [-100, 100]")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(token_id(t) for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            bad("bad_words", self.bad_words, "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class LogitsProcessor:
    """A batch-level logits processor for Python users (vLLM v1's interface, the JAX way): its
    `apply` is traced into the jitted step, over every row at once, and its per-request state
    travels in the step's inputs as fixed-shape arrays, so nothing recompiles as requests come
    and go. Given to the engine as `LLM(..., logits_processors=[MyProcessor])` (a class, an
    instance, or "module:Class"); a request opts in through `SamplingParams.extra_args`. How it
    differs from vLLM's (eager `apply(logits)`, `update_state(BatchUpdate)`) and how to port one:
    docs/api.md, "Coming from vLLM v1".

    `state`: per-request state arrays, name -> (shape, dtype, neutral value); dtypes int32,
    float32 or bool. A request the processor leaves alone (`row_state` returns None) holds the
    neutral values, and `apply` must leave such rows as they are.

    The step applies processors after logit_bias and the token masks, before penalties,
    temperature and the truncations; greedy rows take the processed argmax. Logprobs stay raw
    (`logprobs_mode="processed_logprobs"` reports the processed ones). An engine with custom
    processors compiles its steps afresh at each start (no executable store: their code is not
    jaxllm's to key the cache by).
    """

    state: dict[str, tuple[tuple[int, ...], str, float | int | bool]] = {}

    def row_state(self, params: SamplingParams, prompt_token_ids: list[int]) -> dict | None:
        """A new request's state (a dict of arrays or scalars by `state`'s names), or None when the
        processor leaves the request alone (its rows then cost `apply` nothing but a no-op)."""
        return None

    def update_state(self, state: dict, output_token_ids) -> None:
        """On the host, when a request's output has grown: update its `state` arrays in place
        (`output_token_ids`: the output so far). Default: nothing (a stateless processor)."""

    def apply(self, logits, state: dict):
        """logits [S, V] f32 -> the processed logits; `state` holds each name's [S, *shape] array.
        Traced into the step: jax.numpy only, no Python branching on values."""
        raise NotImplementedError


_STATE_DTYPES = ("int32", "float32", "bool")


def resolve_logits_processors(processors) -> tuple[LogitsProcessor, ...]:
    """Processor instances from classes, instances or "module:Class" names (EngineArgs.
    logits_processors). Raises ValueError for anything else, or a state the step cannot carry."""
    out = []
    for p in processors or ():
        if isinstance(p, str):
            module, _, name = p.partition(":")
            try:
                p = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"logits_processors: cannot import {module}:{name} ({e})") from None
        if isinstance(p, type):
            p = p()
        if not isinstance(p, LogitsProcessor):
            raise ValueError(f"logits_processors: {p!r} is not a jaxllm.LogitsProcessor")
        for name, (shape, dtype, _) in p.state.items():
            if str(np.dtype(dtype)) not in _STATE_DTYPES or any(int(n) < 1 for n in shape):
                raise ValueError(
                    f"logits_processors: {type(p).__name__}.state[{name!r}] must have a shape of positive sizes "
                    "and dtype int32, float32 or bool"
                )
        out.append(p)
    return tuple(out)
