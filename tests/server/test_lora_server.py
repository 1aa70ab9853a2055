"""LoRA adapters over HTTP through the `openai` client, against the offline engine with the same
adapters (which tests/lora/test_adapters.py holds to PEFT): `--lora-modules`, a request's
`model` choosing its adapter, /v1/models with parents, runtime load and unload, the metrics, and
the refusals (unknown adapter 404, bad adapter 400, no key 401, a server without a key 403)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import schemathesis

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.entrypoints.openai.server_args import ServerArgs

from tests.helpers.live_server import start_server
from tests.helpers.tiny_model import TINY_ENGINE_ARGS
from tests.server.test_server_fuzz import fuzz_operation, runs

pytest.importorskip("peft")
from tests.helpers.lora_reference import build_adapter  # noqa: E402

LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three random adapters over the tiny Llama: {name: path}."""
    import transformers

    root = tmp_path_factory.mktemp("adapters")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    targets = {"a": ("q_proj", "v_proj"), "b": ("o_proj", "down_proj"), "c": ("gate_proj", "up_proj", "k_proj")}
    for i, (name, modules) in enumerate(targets.items()):
        build_adapter(base, root / name, r=8, targets=modules, seed=10 + i)
    return {name: str(root / name) for name in targets}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters, tmp_path_factory):
    live = start_server(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("lora-server")),
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
        *("--lora-modules", f"a={adapters['a']}", json.dumps({"name": "b", "path": adapters["b"]})),
        offline=lambda: LLM(tiny_model_dir, **TINY_ENGINE_ARGS, **LORA_ARGS),
    )
    yield live
    live.stop()


def _offline(live, adapters, name: str | None, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    ids = {"a": 1, "b": 2, "c": 3}
    lora = None if name is None else LoRARequest(name, ids[name], adapters[name])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return live.offline.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def _complete(client, model: str, **kwargs):
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}, **kwargs
    )


def test_the_model_field_chooses_the_adapter(lora_server, adapters):
    client = lora_server.client
    texts = {}
    for name in (None, "a", "b"):
        model = name or lora_server.model
        whole = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert whole.model == model
        texts[name] = whole.choices[0].text
        assert texts[name] == _offline(lora_server, adapters, name)
        stream = _complete(client, model, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == texts[name]
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == "b" and chat.choices[0].message.content is not None
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {lora_server.model, "a", "b"}
    assert models["a"].parent == lora_server.model and models["a"].root == adapters["a"]
    with pytest.raises(openai.NotFoundError, match="LoRA adapters `a`, `b`"):
        client.completions.create(model="zzz", prompt=PROMPT, max_tokens=2)
    info = [labels for (name, labels), _ in lora_server.metrics().items() if name == "jaxllm:lora_requests_info"]
    assert info and dict(info[0])["max_lora"] == "2"


def test_adapters_load_and_unload_at_runtime(lora_server, adapters):
    client, post = lora_server.client, lora_server.post
    assert (
        post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]}, headers=None).status_code == 401
    )
    answer = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert answer.status_code == 200 and "added" in answer.text
    assert "c" in {m.id for m in client.models.list().data}
    got = client.completions.create(
        model="c", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == _offline(lora_server, adapters, "c")
    refused = {
        "already": post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["a"]}),
        "missing": post("/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "/nowhere"}),
        "base": post("/v1/load_lora_adapter", {"lora_name": lora_server.model, "lora_path": adapters["a"]}),
        "empty": post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": adapters["a"]}),
    }
    assert {k: r.status_code for k, r in refused.items()} == dict.fromkeys(refused, 400)
    assert "already been loaded" in refused["already"].json()["error"]["message"]
    assert "adapter_config.json" in refused["missing"].json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)
    # The others are unaffected.
    got = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == _offline(lora_server, adapters, "a")
    lora_server.assert_healthy()


LORA_RUNS = runs(["POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter", "GET /v1/models"])


@pytest.mark.parametrize("label, mode", LORA_RUNS, ids=[f"{label}-{mode.value}" for label, mode in LORA_RUNS])
def test_fuzz_lora_operation(lora_server, adapters, label, mode):
    schema = schemathesis.openapi.from_url(lora_server.url + "/openapi.json")
    fuzz_operation(schema, lora_server, label, mode, expect_ok=label == "GET /v1/models")
    lora_server.assert_healthy()
    assert _complete(lora_server.client, "b").choices[0].text == _offline(lora_server, adapters, "b")


def test_without_an_api_key_adapters_cannot_be_loaded_at_runtime(lora_server, adapters, llm):
    async def load(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})

    for engine, server_args in (
        (lora_server.offline.engine, ServerArgs()),
        (llm.engine, ServerArgs(lora_modules=["a=/x"])),
    ):
        async_llm = AsyncLLM(engine=engine)
        try:
            if engine is llm.engine:  # an engine without enable_lora
                with pytest.raises(ValueError, match="needs --enable-lora"):
                    build_app(async_llm, server_args)
                continue
            answer = asyncio.run(load(build_app(async_llm, server_args)))
            assert answer.status_code == 403 and "--api-key" in answer.json()["error"]["message"]
        finally:
            async_llm.shutdown()
