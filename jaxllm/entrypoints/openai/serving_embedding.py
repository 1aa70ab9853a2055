"""/v1/embeddings (OpenAI's schema) and /pooling (vLLM's), on a pooling engine.

An input is a string, a list of strings, a list of token ids or a list of those; texts are
tokenized together in a worker thread. Each input is one engine request (`AsyncLLM.encode`),
and one HTTP request keeps at most `max_num_seqs` of its inputs in the engine at a time: a
request of thousands of inputs is computed a batch after another while other requests join the
same steps, never queued behind all of it. Embeddings come back as floats or as base64 of
little-endian float32 bytes (what the `openai` client asks for by default).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from jaxllm.entrypoints.openai.middleware import request_id_of
from jaxllm.entrypoints.openai.protocol import OpenAIModel, RequestModel
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing, api_error
from jaxllm.entrypoints.openai.serving_utils import APIError, ClientDisconnected, unless_disconnected
from jaxllm.outputs import EmbeddingRequestOutput
from jaxllm.pooling_params import PoolingParams

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # vLLM's extras: cut longer inputs to this many tokens (-1: the context) instead of a 400;
    # normalize the embedding (default: as the model's pooling says).
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None

    def pooling_params(self) -> PoolingParams:
        params = PoolingParams(self.dimensions, self.normalize, self.truncate_prompt_tokens)
        params.verify()
        return params


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same inputs; each answer's `data` is the pooled vector."""


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class PoolingData(OpenAIModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"pool-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage


class OpenAIServingEmbedding(OpenAIServing):
    """The /v1/embeddings and /pooling handlers."""

    async def create_embedding(self, request: EmbeddingRequest, raw: Request) -> EmbeddingResponse | Response:
        return await self._respond(
            request, raw, EmbeddingResponse, lambda i, data: EmbeddingData(index=i, embedding=data)
        )

    async def create_pooling(self, request: PoolingRequest, raw: Request) -> PoolingResponse | Response:
        return await self._respond(request, raw, PoolingResponse, lambda i, data: PoolingData(index=i, data=data))

    async def _respond(self, request: EmbeddingRequest, raw: Request, response, item):
        """The response (`response` of `item(index, vector)` per input), or 499 if the client left."""
        try:
            outputs = await self._run(request, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        data = [item(i, _encoded(o, request.encoding_format)) for i, o in enumerate(outputs)]
        return response(model=self.model_name, data=data, usage=_usage(outputs))

    async def _run(self, request: EmbeddingRequest, raw: Request) -> list[EmbeddingRequestOutput]:
        self.check_model(request.model)
        if self.llm.engine.pooling is None:
            raise APIError(
                f"The model `{self.model_name}` is served for generation, not embeddings (a server started "
                "with --runner pooling serves them)",
                param="model",
            )
        try:
            params = request.pooling_params()
        except ValueError as e:
            raise APIError(str(e), param=str(e).split()[0]) from None
        prompts = await self._prompts(request.input, params.truncate_prompt_tokens)
        request_id = request_id_of(raw.scope)
        try:
            return await unless_disconnected(raw, self._embed_all(prompts, params, request_id))
        except ClientDisconnected:
            raise
        except Exception as e:
            error = api_error(e, request_id)
            if error is None:
                raise
            raise error from e

    async def _prompts(self, inputs: EmbeddingInput, truncate: int | None) -> list[tuple[str | None, list[int]]]:
        """The inputs as (text or None, token ids), texts tokenized together in a worker."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs or any(len(x) == 0 for x in inputs):
            raise APIError("input must not be empty (nor any of its items)", param="input")
        limit = self.args.max_embedding_inputs
        if len(inputs) > limit:
            raise APIError(
                f"at most {limit} inputs are allowed per request (the server's --max-embedding-inputs), "
                f"got {len(inputs)}",
                param="input",
            )
        texts = [x for x in inputs if isinstance(x, str)]
        if texts:
            kwargs = {"truncation": True, "max_length": self._truncate_to(truncate)} if truncate else {}
            try:
                encoded = iter(await self.in_worker(lambda: self.tokenizer(texts, **kwargs)["input_ids"]))
            except Exception as e:  # e.g. text the tokenizer cannot take
                raise APIError(f"input could not be tokenized: {type(e).__name__}", param="input") from e
        prompts = [(x, next(encoded)) if isinstance(x, str) else (None, list(x)) for x in inputs]
        for _, ids in prompts:
            if not truncate and len(ids) > self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens; an input has "
                    f"{len(ids)} (truncate_prompt_tokens cuts longer inputs to fit)",
                    param="input",
                )
        return prompts

    def _truncate_to(self, truncate: int) -> int:
        return self.max_model_len if truncate == -1 else truncate

    async def _embed_all(self, prompts, params: PoolingParams, request_id: str) -> list[EmbeddingRequestOutput]:
        """Every input's output, at most `max_num_seqs` of them in the engine at a time."""
        limit = self.max_num_seqs + self.args.max_waiting_requests
        if self.llm.num_unfinished_requests + min(len(prompts), self.max_num_seqs) > limit:
            raise APIError(
                f"the server is at capacity ({limit} requests running or queued); retry later",
                429,
                headers={"Retry-After": "1"},
            )
        slots = asyncio.Semaphore(self.max_num_seqs)

        async def one(i: int, text: str | None, ids: list[int]) -> EmbeddingRequestOutput:
            async with slots:
                stream = self.llm.encode({"prompt": text, "prompt_token_ids": ids}, params, f"{request_id}-{i}")
                out = None
                async for out in self.metrics.track(stream, log=not self.args.disable_log_requests):
                    pass
                if out is None or out.finish_reason != "stop":
                    raise APIError(f"the request was stopped before its embedding was computed ({request_id})", 503)
                return out

        tasks = [asyncio.ensure_future(one(i, text, ids)) for i, (text, ids) in enumerate(prompts)]
        try:
            return await asyncio.gather(*tasks)
        finally:  # one failed or the client left: the others stop (their streams abort)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _encoded(out: EmbeddingRequestOutput, encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return out.outputs.embedding
    return base64.b64encode(np.asarray(out.outputs.embedding, "<f4").tobytes()).decode("ascii")


def _usage(outputs: list[EmbeddingRequestOutput]) -> EmbeddingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
