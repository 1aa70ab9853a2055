"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names an adapter (or the base
model), `/v1/models` lists the adapters with their `parent`, `--lora-modules` serves some from
the start, and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` change them at runtime.
The adapters live in the engine (`LLMEngine.add_lora`, engine/lora.py); this module maps names
to them. Runtime loading reads a path on the server's disk, so it needs the server's API key."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from jaxllm.entrypoints.openai.serving_utils import APIError
from jaxllm.lora.request import LoRAError, LoRARequest


def parse_lora_module(text: str) -> tuple[str, str]:
    """`NAME=PATH` or `{"name": ..., "path": ...}` -> (name, path); ValueError if neither."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
            return str(item["name"]), str(item["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'--lora-modules: {text!r} is not a JSON object with "name" and "path"') from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is not NAME=PATH")
    return name, path


def find_adapter(engine, name: str) -> LoRARequest | None:
    return next((r for r in engine.lora_requests() if r.lora_name == name), None)


def register_lora_modules(engine, modules: list[str]) -> None:
    """Read and check the `--lora-modules` adapters (ValueError naming the bad one)."""
    if engine.adapters is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for text in modules:
        name, path = parse_lora_module(text)
        _check_new_name(engine, name)
        engine.add_lora(LoRARequest(name, _next_id(engine), path))


def _next_id(engine) -> int:
    return max(engine.list_loras(), default=0) + 1


def _check_new_name(engine, name: str) -> None:
    if name == engine.model_name:
        raise LoRAError(f"the adapter name {name!r} is the base model's")
    if find_adapter(engine, name) is not None:
        raise LoRAError(f"The lora adapter '{name}' has already been loaded.")


def lora_cards(engine) -> list[ModelCard]:
    """/v1/models' entries for the adapters served."""
    base, max_model_len = engine.model_name, engine.config.scheduler.max_model_len
    return [
        ModelCard(id=r.lora_name, root=r.lora_path, parent=base, max_model_len=max_model_len)
        for r in engine.lora_requests()
    ]


def add_lora_routes(app: FastAPI, llm: AsyncLLM, api_key: str | None, responses) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (an engine with enable_lora).
    `responses(*codes)`: the routes' documented answers."""
    engine = llm.engine
    changing = asyncio.Lock()  # one load or unload at a time: names stay unique
    done = {200: {"description": "done (a line of text)", "content": {"text/plain": {"schema": {"type": "string"}}}}}

    def check_allowed() -> None:
        if not api_key:
            raise APIError(
                "loading and unloading adapters at runtime needs a server started with --api-key (they are read "
                "from the server's disk); --lora-modules serves adapters from the start",
                403,
            )

    @app.post("/v1/load_lora_adapter", response_class=Response, responses={**responses(403), **done})
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        check_allowed()
        async with changing:
            try:
                _check_new_name(engine, request.lora_name)
                lora = LoRARequest(request.lora_name, _next_id(engine), request.lora_path)
                await asyncio.to_thread(engine.add_lora, lora)  # disk reads off the event loop
            except LoRAError as e:
                raise APIError(str(e), 400, param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses={**responses(403, 404), **done})
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        check_allowed()
        async with changing:
            lora = find_adapter(engine, request.lora_name)
            if lora is None or request.lora_int_id not in (None, lora.lora_int_id):
                raise APIError(f"The lora adapter '{request.lora_name}' cannot be found.", 404, param="lora_name")
            await llm.run_on_engine(lambda e: e.remove_lora(lora.lora_int_id))
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
