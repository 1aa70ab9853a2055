"""/tokenize and /detokenize (vLLM's extra routes): text or chat messages -> token ids, and back."""

from __future__ import annotations

from jaxllm.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing
from jaxllm.entrypoints.openai.serving_utils import APIError


class OpenAIServingTokenization(OpenAIServing):
    """The /tokenize and /detokenize handlers."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if request.messages is not None:
            ids = await self.chat_prompt(request.messages, request.add_generation_prompt)
        elif request.prompt is not None:
            ids = await self.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        else:
            raise APIError("give `prompt` or `messages`", param="prompt")
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=list(ids))

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await self.in_worker(self.tokenizer.decode, request.tokens))
