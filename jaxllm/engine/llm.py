"""LLM: the offline API (`generate`, `chat`; `embed`, `score` for a pooling engine), shaped like vLLM's."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from jaxllm.config import EngineArgs
from jaxllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Offline inference. `LLM()` loads the default model (SmolLM2-135M-Instruct).

    Keyword arguments are `EngineArgs` fields: model, dtype, max_num_seqs,
    max_num_batched_tokens, block_size, max_model_len, kv_cache_memory, seed,
    enable_prefix_caching, ...
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()
        self.last_run_stats: dict = {}

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists or {"prompt_token_ids": [...]}) to completion;
        outputs come back in input order. `priority`: one per prompt, lower first (an engine
        with scheduling_policy="priority"). `lora_request`: the adapter of every prompt, or one
        per prompt (None: the base model), on an engine with enable_lora."""
        return self._submit(
            prompts, sampling_params or SamplingParams(), SamplingParams, use_tqdm, priority, lora_request
        )

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed prompts (as `generate` takes them) on a pooling engine (`runner="pooling"`);
        outputs come back in input order, each `outputs.embedding` a list of floats."""
        if pooling_params is None:
            pooling_params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        elif truncate_prompt_tokens is not None:
            raise ValueError("give truncate_prompt_tokens in the pooling params or as the keyword, not both")
        outputs = self._submit(prompts, pooling_params, PoolingParams, use_tqdm)
        failed = [o.request_id for o in outputs if o.finish_reason != "stop"]
        if failed:
            raise RuntimeError(f"the engine failed while embedding request(s) {failed} (logged)")
        return outputs

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of embeddings, as vLLM scores with an embedding model: one text
        against each of `text_2`, or the pairs of two lists of the same length."""
        firsts = [text_1] if isinstance(text_1, (str, dict)) or _is_token_ids(text_1) else list(text_1)
        seconds = [text_2] if isinstance(text_2, (str, dict)) or _is_token_ids(text_2) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise ValueError(f"score takes one text or as many as text_2: got {len(firsts)} and {len(seconds)}")
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
        embedded = self.embed([*firsts, *seconds], params, use_tqdm=use_tqdm)
        n = len(seconds)
        return [
            ScoringRequestOutput(
                b.request_id,
                a.prompt_token_ids + b.prompt_token_ids,
                ScoringOutput(float(sum(x * y for x, y in zip(a.outputs.embedding, b.outputs.embedding)))),
            )
            for a, b in zip(embedded[:n], embedded[n:])
        ]

    def _submit(self, prompts, params, kind: type, use_tqdm: bool, priority=None, lora_request=None) -> list:
        """Add every prompt with its params and adapter (one for all, or one each) and priority,
        run them to completion."""
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = [params] * len(prompts) if isinstance(params, kind) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        adapters = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, one, rank, adapter in zip(prompts, params, priority, adapters):
                request_id = str(next(self._counter))
                text, token_ids = (
                    (prompt.get("prompt"), prompt.get("prompt_token_ids"))
                    if isinstance(prompt, dict)
                    else (prompt, None)
                )
                self.engine.add_request(
                    request_id,
                    text,
                    one,
                    prompt_token_ids=token_ids,
                    output_kind="final",
                    priority=rank,
                    lora_request=adapter,
                )
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        results: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        stats = self.engine.stats
        gen0, prompt0 = stats.generation_tokens, stats.prompt_tokens
        desc = "generating" if self.engine.pooling is None else "embedding"
        with tqdm(total=len(ids), desc=desc, disable=None if use_tqdm else True, unit="req") as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"out {(stats.generation_tokens - gen0) / max(elapsed, 1e-9):.1f} tok/s", refresh=False
                )
        elapsed = time.perf_counter() - start
        self.last_run_stats = {
            "seconds": elapsed,
            "generation_tokens": stats.generation_tokens - gen0,
            "prompt_tokens": stats.prompt_tokens - prompt0,
        }
        return [results[i] for i in ids]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's offline API; scored like HF transformers' `generate(num_beams=...)`,
        see engine/beam_search.py): per prompt, the `beam_width` best sequences, best first.
        The beams share KV pages; a page is copied only when beams write different tokens
        into it. `lora_request`: the adapter every beam runs under."""
        if len(self.engine.replicas) > 1:
            raise ValueError("beam search does not support data_parallel_size > 1 yet")
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        token_ids = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
                prompt = ids if ids is not None else text
            token_ids.append([int(t) for t in prompt] if isinstance(prompt, list) else self.engine.tokenize(prompt))
        return beam_search(self.engine, token_ids, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)


def _is_token_ids(prompt) -> bool:
    """One prompt given as token ids (not a list of prompts)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
