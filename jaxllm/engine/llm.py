"""LLM: the offline API (`generate`, `chat`), shaped like vLLM's."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from jaxllm.config import EngineArgs
from jaxllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
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
    ) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists or {"prompt_token_ids": [...]}) to completion;
        outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = str(next(self._counter))
                if isinstance(prompt, dict):
                    text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
                    self.engine.add_request(request_id, text, params, prompt_token_ids=token_ids, output_kind="final")
                else:
                    self.engine.add_request(request_id, prompt, params, output_kind="final")
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
        with tqdm(total=len(ids), desc="generating", disable=None if use_tqdm else True, unit="req") as bar:
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
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's offline API; scored like HF transformers' `generate(num_beams=...)`,
        see engine/beam_search.py): per prompt, the `beam_width` best sequences, best first.
        The beams share KV pages; a page is copied only when beams write different tokens
        into it."""
        if len(self.engine.replicas) > 1:
            raise ValueError("beam search does not support data_parallel_size > 1 yet")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_ids = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
                prompt = ids if ids is not None else text
            token_ids.append([int(t) for t in prompt] if isinstance(prompt, list) else self.engine.tokenize(prompt))
        return beam_search(self.engine, token_ids, params, use_tqdm=use_tqdm)

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
