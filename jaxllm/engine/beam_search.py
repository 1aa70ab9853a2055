"""Beam search over shared KV pages: vLLM's `LLM.beam_search` API, scored like HF transformers.

Each live beam is a Request in the engine core with `append_sampled_tokens=False`: the
scheduler computes it like any other request and reports the top-k logprobs of its last
token in the step's `EngineCoreOutputs`; the search appends the token it chooses. When beams
branch, the best continuation of a beam keeps the beam's Request and every other continuation
is a fork of it (`Scheduler.fork_request`): all pages are shared, and the partially filled
last page is copied only when a fork writes its own token into it (copy-on-write in
`KVCacheManager.allocate_slots`). A beam that is dropped is finished, which releases its
references. The search uses only the engine core's public methods (`add_request`,
`step`, `finish_requests`) and the scheduler's `fork_request`.

Selection follows HF transformers' `generate(num_beams=w, do_sample=False)` exactly:

- each step keeps the best `K = max(2, 1 + #eos) * w` continuations of all beams, ranked by
  the sum of the logprobs of the generated tokens;
- those of the first `w` that end (an EOS token, or `max_tokens` reached) become finished
  hypotheses with score `sum_logprobs / num_generated ** length_penalty` (the EOS token is
  counted); the best `w` that do not end are the next beams;
- `early_stopping=True` stops once `w` hypotheses are finished. `False` (HF's default) stops
  when `w` are finished and the best beam, scored at its current length, cannot beat the
  worst of them; `"never"` scores it at `max_tokens` instead when `length_penalty > 0`.
  Once stopping is decided no hypothesis is added any more.

The result per prompt is the `w` finished hypotheses, best score first.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from jaxllm.core.request import Request, RequestStatus
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclasses.dataclass(slots=True)
class BeamSearchParams:
    """vLLM's beam search options, plus HF's `early_stopping` (True, False or "never").

    Beam search is deterministic: `temperature` must be 0 (it is accepted for vLLM's shape).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(f"beam search is deterministic: temperature must be 0, got {self.temperature!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclasses.dataclass(slots=True)
class BeamSearchSequence:
    """One finished hypothesis. `tokens` holds the prompt and the generated tokens (as in vLLM),
    `text` their decoding (None for a model without a tokenizer); `score` is
    `cum_logprob / num_generated ** length_penalty`."""

    tokens: list[int]
    cum_logprob: float
    score: float
    num_prompt_tokens: int
    finish_reason: str  # "stop" (ended with EOS) | "length"
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclasses.dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best score first


class _PromptSearch:
    """The search state of one prompt: live beams (best first) and finished hypotheses."""

    def __init__(
        self,
        engine,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        max_tokens: int,
        eos_token_ids: tuple[int, ...],
        ids,
        lora=None,
    ):
        self.engine, self.lora = engine, lora
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * params.beam_width  # HF's K
        self.ids = ids
        self.sampling_params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=self.num_candidates, detokenize=False
        )
        self.num_prompt_tokens = len(prompt_token_ids)
        root = self._new_request(prompt_token_ids)
        self.beams: list[Request] = [root]
        self.finished: list[BeamSearchSequence] = []
        self.top: dict[str, tuple[list[int], list[float]]] = {}  # this round's top-k per beam id
        self.num_generated = 0
        self.improvable = True
        self.done = False
        engine.engine_core.add_request(root)

    def _new_request(self, prompt_token_ids: list[int]) -> Request:
        beam_id = f"beam-{next(self.ids)}"
        return Request(beam_id, prompt_token_ids, self.sampling_params, append_sampled_tokens=False, lora=self.lora)

    @property
    def ready(self) -> bool:
        return len(self.top) == len(self.beams)

    def advance(self) -> None:
        """One beam search step, once every beam has its top-k next tokens."""
        params, width = self.params, self.params.beam_width
        candidates = []  # (score, parent, token, logprob)
        for beam in self.beams:
            ids, logprobs = self.top[beam.request_id]
            candidates += [(beam.cumulative_logprob + lp, beam, t, lp) for t, lp in zip(ids, logprobs)]
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[: self.num_candidates]
        self.top = {}
        num_generated = self.num_generated + 1
        at_limit = num_generated >= self.max_tokens
        running, ended = [], []
        for rank, cand in enumerate(candidates):
            if at_limit or cand[2] in self.eos_token_ids:
                if rank < width:
                    ended.append(cand)
            elif len(running) < width:
                running.append(cand)

        full = len(self.finished) == width
        if self.improvable and not (full and params.early_stopping is True):
            for score, parent, token, _ in ended:
                self.finished.append(
                    BeamSearchSequence(
                        parent.all_token_ids + [token],
                        score,
                        score / num_generated**params.length_penalty,
                        self.num_prompt_tokens,
                        "length" if token not in self.eos_token_ids else "stop",
                    )
                )
            self.finished.sort(key=lambda s: -s.score)
            del self.finished[width:]
        self.num_generated = num_generated
        full = len(self.finished) == width
        if running and self.improvable and full:
            length = (
                self.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 else num_generated
            )
            self.improvable = running[0][0] / length**params.length_penalty > self.finished[-1].score
        if not running or not self.improvable or (full and params.early_stopping is True):
            self.release(self.beams)
            self.beams, self.done = [], True
            return
        self._branch(running)

    def _branch(self, running: list[tuple[float, Request, int, float]]) -> None:
        """Make the next beams: the first continuation of a beam keeps its Request (and pages),
        the others fork it; beams without a continuation are released."""
        scheduler = self.engine.scheduler
        kept: set[Request] = set()
        new_beams = []
        for _, parent, token, logprob in running:
            if parent in kept:
                child = self._new_request(parent.prompt_token_ids)
                child.output_token_ids = list(parent.output_token_ids)
                child.cumulative_logprob = parent.cumulative_logprob
                scheduler.fork_request(parent, child)
            else:
                kept.add(parent)
                child = parent
            new_beams.append((child, token, logprob))
        self.release([b for b in self.beams if b not in kept])
        for child, token, logprob in new_beams:
            child.append_output_token(token, logprob)
        self.beams = [child for child, _, _ in new_beams]

    def release(self, beams: list[Request]) -> None:
        self.engine.engine_core.finish_requests([b.request_id for b in beams], RequestStatus.FINISHED_STOPPED)

    def output(self, tokenizer) -> BeamSearchOutput:
        for seq in self.finished:  # no text from a model without a tokenizer (token ids only)
            seq.text = tokenizer.decode(seq.tokens, skip_special_tokens=True) if tokenizer is not None else None
        return BeamSearchOutput(self.finished)


def beam_search(
    engine, prompts: list[list[int]], params: BeamSearchParams, *, use_tqdm: bool = False, lora_request=None
) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (token ids) on an idle `engine`; results in input order.
    `lora_request`: every beam runs under that LoRA adapter.

    Prompts run side by side as long as their beams fit in `max_num_seqs` and their block
    tables, counted as if nothing were shared, fit in the KV pool, so beams never preempt
    each other.
    """
    from tqdm.auto import tqdm

    eos_token_ids = _check_search(engine, params)
    lora = engine._lora_adapter(lora_request)
    max_tokens, pages = _prompt_limits(engine, prompts, params)
    width = params.beam_width
    max_num_seqs = engine.config.scheduler.max_num_seqs
    num_pages = engine.kv_cache_manager.num_pages
    ids = itertools.count()
    queue = collections.deque(range(len(prompts)))
    active: dict[int, _PromptSearch] = {}
    owner: dict[str, _PromptSearch] = {}  # beam id -> its search
    results: dict[int, BeamSearchOutput] = {}

    try:
        with tqdm(total=len(prompts), desc="beam search", disable=None if use_tqdm else True, unit="prompt") as bar:
            while queue or active:
                # Start queued prompts while their beams and pages fit beside the active ones.
                while queue and (
                    not active
                    or (
                        (len(active) + 1) * width <= max_num_seqs
                        and sum(pages[i] for i in active) + pages[queue[0]] <= num_pages
                    )
                ):
                    i = queue.popleft()
                    active[i] = _PromptSearch(engine, prompts[i], params, max_tokens[i], eos_token_ids, ids, lora)
                    owner[active[i].beams[0].request_id] = active[i]
                _step_engine(engine, owner)
                for i, search in list(active.items()):
                    if not search.ready:
                        continue
                    _advance_search(search, owner)
                    if search.done:
                        results[i] = search.output(engine.tokenizer)
                        del active[i]
                        bar.update(1)
    finally:
        for search in active.values():
            search.release(search.beams)
    return [results[i] for i in range(len(prompts))]


def _check_search(engine, params: BeamSearchParams) -> tuple[int, ...]:
    """Raise ValueError unless `engine` can run this search; returns the EOS token ids it ends on."""
    params.verify()
    if engine.has_unfinished_requests() or engine.engine_core.has_unfinished_requests():
        raise ValueError("beam search needs an idle engine; finish or abort the running requests first")
    width = params.beam_width
    max_num_seqs = engine.config.scheduler.max_num_seqs
    if width > max_num_seqs:
        raise ValueError(f"beam_width={width} exceeds max_num_seqs ({max_num_seqs})")
    eos_token_ids = () if params.ignore_eos else tuple(engine.eos_token_ids)
    if max(2, 1 + len(eos_token_ids)) * width > MAX_LOGPROBS:
        raise ValueError(
            f"beam_width={width} with {len(eos_token_ids)} EOS tokens needs more than the "
            f"{MAX_LOGPROBS} top logprobs the sampler returns"
        )
    return eos_token_ids


def _prompt_limits(engine, prompts: list[list[int]], params: BeamSearchParams) -> tuple[list[int], list[int]]:
    """Per prompt (checked like any request's), the tokens its beams may generate within the
    context and the KV pages its beams need at most; raises ValueError where they exceed the pool."""
    kv = engine.kv_cache_manager
    width = params.beam_width
    max_len = engine.config.scheduler.max_model_len
    max_tokens, pages = [], []
    for prompt in prompts:
        engine.check_prompt(prompt, SamplingParams(max_tokens=params.max_tokens))
        max_tokens.append(min(params.max_tokens, max_len - len(prompt)))
        pages.append(width * kv.pages_needed(len(prompt) + max_tokens[-1]))
        if pages[-1] > kv.num_pages:
            raise ValueError(
                f"{width} beams of {len(prompt)} + {max_tokens[-1]} tokens need up to {pages[-1]} "
                f"KV pages but the pool only has {kv.num_pages}; lower beam_width or max_tokens"
            )
    return max_tokens, pages


def _step_engine(engine, owner: dict[str, _PromptSearch]) -> None:
    """One engine step: hand each beam's top-k next tokens to its search."""
    steps = engine.stats.num_steps
    for out in engine.engine_core.step().outputs:
        search = owner.get(out.request_id)
        if search is not None and out.top_logprobs is not None:
            search.top[out.request_id] = out.top_logprobs[0]
    if engine.stats.num_steps == steps:
        raise RuntimeError("beam search made no progress: the engine scheduled nothing")


def _advance_search(search: _PromptSearch, owner: dict[str, _PromptSearch]) -> None:
    """Advance a search whose beams all have their top-k, and map its new beams' ids to it."""
    before = search.beams
    search.advance()
    for beam in before:
        owner.pop(beam.request_id, None)
    for beam in search.beams:
        owner[beam.request_id] = search
