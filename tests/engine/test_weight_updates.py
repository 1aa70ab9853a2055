"""Weights in and out of a running engine (`get_weights`, `update_weights`, `sleep`/`wake_up`):
an engine given another checkpoint's weights must answer as a fresh engine on that checkpoint
(the independent reference), through every form the engine keeps them in, and bad updates must
leave it serving its old weights."""

from __future__ import annotations

import asyncio
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm import LLM, SamplingParams
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.runner.compile import no_compile_guard
from jaxllm.weights.update import WeightUpdateError
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, WARM_ENGINE_ARGS

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def other_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with every weight changed (a trained step's worth and more): a second
    checkpoint of the same architecture, whose fresh engine is the reference."""
    path = str(tmp_path_factory.mktemp("other") / "tiny-llama-2")
    shutil.copytree(tiny_model_dir, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    rng = np.random.default_rng(1)
    changed = {k: (v * rng.uniform(0.5, 1.5, v.shape)).astype(v.dtype) for k, v in weights.items()}
    save_file(changed, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def hf_weights(path: str) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(other_model_dir):
    """Greedy tokens of fresh engines on the second checkpoint, per (dtype, quantization)."""
    cache = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = tokens(LLM(other_model_dir, **{**TINY_ENGINE_ARGS, **options}))
        return cache[key]

    return get


@pytest.mark.parametrize(
    "options",
    [
        dict(dtype="float32", packed_weights=False),
        dict(dtype="float32"),
        dict(dtype="bfloat16"),
        dict(dtype="float32", quantization="int8_weight_only"),
    ],
    ids=["f32-xla", "f32-packed", "bf16", "int8"],
)
def test_update_from_hf_names_equals_a_fresh_engine(tiny_model_dir, other_model_dir, reference, options):
    llm = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, **options})
    before = tokens(llm)
    outputs = llm.engine.update_weights(hf_weights(other_model_dir))
    assert outputs == []
    after = tokens(llm)
    assert after == reference(**options)
    assert after != before  # (the two checkpoints disagree: the update did something)
    # ... and back, from the model tree a trainer holds (the first engine's, as get_weights gives it).
    if options.get("quantization") is None:
        first = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, **options})
        llm.engine.update_weights(first.engine.get_weights())
        assert tokens(llm) == before


def test_model_tree_round_trip_is_zero_copy(tiny_model_dir):
    llm = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "packed_weights": False})
    engine = llm.engine
    mine = jax.tree.map(lambda x: x * 1.25 if x.ndim == 2 else x + 0, engine.get_weights())
    engine.update_weights(mine)
    # The engine now steps with the caller's very buffers, and get_weights hands them back.
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(mine)]
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.runner.params)] == pointers
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.get_weights())] == pointers


def test_packed_weights_come_back_as_the_model_tree(tiny_model_dir):
    """get_weights unpacks the C++ panels (f32 and bf16) into the loader's own tree."""
    from jaxllm.models.loader import load_model

    for dtype in ("float32", "bfloat16"):
        llm = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "dtype": dtype})
        got = llm.engine.get_weights()
        want = load_model(tiny_model_dir, dtype=dtype, use_cache=False, progress=False).params
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_bad_updates_name_the_leaf_and_keep_the_old_weights(tiny_model_dir, other_model_dir):
    llm = LLM(tiny_model_dir, **TINY_ENGINE_ARGS)
    engine = llm.engine
    before = tokens(llm)
    tree = engine.get_weights()
    hf = hf_weights(other_model_dir)

    def wrong(edit):
        t = jax.tree.map(lambda x: x, tree)
        edit(t)
        return t

    cases = [
        (wrong(lambda t: t["layers"][1].pop("wo")), r"missing \['layers'\]\[1\]\['wo'\]"),
        (wrong(lambda t: t["layers"][0].update(extra=jnp.zeros(3))), r"unexpected \['layers'\]\[0\]\['extra'\]"),
        (wrong(lambda t: t["layers"][0].update(wqkv=jnp.zeros((64, 100)))), r"\['wqkv'\] has shape \(64, 100\)"),
        (wrong(lambda t: t.update(final_norm=jnp.zeros(64, jnp.int32))), r"\['final_norm'\] has dtype int32"),
        (wrong(lambda t: t["layers"][0].update(wo="weights")), r"\['wo'\] is a str"),
        (
            {k: v for k, v in hf.items() if "layers.1.mlp.down_proj" not in k},
            "layers.1.mlp.down_proj.weight is missing",
        ),
        (
            {**hf, "model.layers.0.mlp.extra.weight": hf["model.norm.weight"]},
            "not weights of this model: model.layers.0.mlp.extra",
        ),
        ({**hf, "model.norm.weight": np.zeros(65, np.float32)}, r"model.norm.weight has shape \(65,\)"),
    ]
    for weights, message in cases:
        with pytest.raises(WeightUpdateError, match=message):
            engine.update_weights(weights)
    with pytest.raises(ValueError, match="in_flight"):
        engine.update_weights(tree, in_flight="later")
    assert engine.weight_version == 0
    assert tokens(llm) == before


def test_gguf_codes_engine_refuses_float_updates(tmp_path):
    """An engine serving a GGUF's own blocks says so, rather than serving something else."""
    from tests.helpers.quantized_checkpoints import write_quantized_gguf

    path = write_quantized_gguf(str(tmp_path / "tiny.gguf"))
    llm = LLM(path, quantization="gguf", **{**TINY_ENGINE_ARGS, "params_cache_dir": str(tmp_path / "params")})
    with pytest.raises(WeightUpdateError, match="quantization='none'"):
        llm.engine.update_weights({})
    with pytest.raises(WeightUpdateError, match="codes"):
        llm.engine.get_weights()


def test_no_step_recompiles_after_update_or_sleep(tiny_model_dir, other_model_dir):
    llm = LLM(tiny_model_dir, **WARM_ENGINE_ARGS)
    engine = llm.engine
    with no_compile_guard():
        tokens(llm)
        engine.update_weights(hf_weights(other_model_dir))
        tokens(llm)
        engine.sleep(1)
        engine.wake_up()
        tokens(llm)


def test_in_flight_requests_keep_abort_or_wait(tiny_model_dir, other_model_dir, reference):
    """keep: a request goes on under the new weights, each token tagged with its version, and
    the prefix cache no longer serves pages the old weights computed; abort: its last output;
    wait: it ends under the old weights first."""
    new = hf_weights(other_model_dir)
    llm = LLM(tiny_model_dir, **TINY_ENGINE_ARGS)
    engine = llm.engine
    prompt = PROMPTS[0] * 6  # several full pages, for the prefix cache
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def start(request_id):
        engine.add_request(request_id, prompt, long, output_kind="final")
        for _ in range(5):
            assert engine.step() == []

    start("keep")
    assert engine.update_weights(new, version="v1") == []
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    versions = out.outputs[0].weight_versions
    assert versions[0] == 0 and versions[-1] == "v1" and len(versions) == 30
    assert versions == sorted(versions, key=lambda v: v == "v1")  # old ones, then new ones
    assert out.weight_version == "v1"
    # The same prompt again: nothing the old weights computed is reused; it equals a fresh engine's.
    (again,) = llm.generate([prompt], long, use_tqdm=False)
    assert again.num_cached_tokens == 0
    fresh = LLM(other_model_dir, **TINY_ENGINE_ARGS)
    assert again.outputs[0].token_ids == fresh.generate([prompt], long, use_tqdm=False)[0].outputs[0].token_ids

    start("abort")
    (aborted,) = engine.update_weights(new, in_flight="abort")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_used_pages == 0

    start("wait")
    (waited,) = engine.update_weights(hf_weights(tiny_model_dir), version="v3", in_flight="wait")
    assert waited.outputs[0].finish_reason == "length" and set(waited.outputs[0].weight_versions) == {2}
    assert engine.weight_version == "v3"


def test_sleep_and_wake_up(tiny_model_dir, other_model_dir):
    llm = LLM(tiny_model_dir, **TINY_ENGINE_ARGS)
    engine = llm.engine
    before = tokens(llm)
    engine.sleep(1)
    assert engine.runner.kv._pages is None
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.wake_up()
    assert tokens(llm) == before
    tree = engine.get_weights()
    engine.sleep(2)
    assert engine.runner.params is None
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.wake_up()
    with pytest.raises(RuntimeError, match="level 2"):
        engine.get_weights()
    engine.update_weights(tree)
    engine.wake_up()
    assert tokens(llm) == before
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.sleep(1)


def test_async_engine_updates_between_steps(tiny_model_dir, other_model_dir, reference):
    async def main():
        engine = AsyncLLM(**{**TINY_ENGINE_ARGS, "model": tiny_model_dir})
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        longer = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

        async def run(prompt, params=params, started=None):
            last = None
            async for out in engine.generate(prompt, params):
                last = out
                if started is not None:
                    started.set()
            return last

        try:
            # wait: the request in flight ends under the old weights; one sent meanwhile waits
            # for the new ones.
            started = asyncio.Event()
            first = asyncio.create_task(run(PROMPTS[0], longer, started))
            await started.wait()
            update = asyncio.create_task(engine.update_weights(hf_weights(other_model_dir), in_flight="wait"))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(run(PROMPTS[1]))
            await update
            first, second = await first, await second
            assert len(first.outputs[0].token_ids) == 400 and set(first.outputs[0].weight_versions) == {0}
            assert set(second.outputs[0].weight_versions) == {1}
            # abort: the stream in flight ends with finish reason "abort".
            started = asyncio.Event()
            third = asyncio.create_task(run(PROMPTS[2], longer, started))
            await started.wait()
            await engine.update_weights(hf_weights(tiny_model_dir), in_flight="abort")
            third = await third
            assert third.outputs[0].finish_reason == "abort" and len(third.outputs[0].token_ids) < 400
            with pytest.raises(WeightUpdateError):
                await engine.update_weights({"model.norm.weight": np.zeros(3)})
            return second.outputs[0].token_ids
        finally:
            engine.shutdown()

    second = asyncio.run(main())
    fresh = LLM(other_model_dir, **TINY_ENGINE_ARGS)
    want = fresh.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert second == want[0].outputs[0].token_ids


def test_updates_on_a_mesh_equal_a_fresh_engine(tiny_model_dir, other_model_dir, reference, run_on_virtual_devices):
    """One-device, tensor (with KV heads repeated: tp 4 over 2 KV heads), data and pipeline
    parallel engines give the loader's tree from get_weights, and after an update from HF names,
    from a one-device tree and from a trainer's FSDP mesh, answer as a fresh one-device engine
    on those weights."""
    layouts = ["1x1x1", "2x1x1", "4x1x1", "1x2x1", "2x1x2", "mesh:2x1x2"]
    quantized = ["int4:2x1x2", "w8a8:2x1x1"]
    results = run_on_virtual_devices(4, "weight_updates", tiny_model_dir, other_model_dir, layouts + quantized)
    for name in quantized:  # re-quantized on the mesh as a fresh load of the same weights quantizes
        want = results[name + ":fresh"]
        assert results[name]["runs"] == {"hf": want, "fsdp": want}, name
    want = reference(dtype="float32")
    for name in layouts:
        r = results[name]
        assert r["same_tree"], name
        assert r["runs"] == {"hf": want, "one_device": want, "fsdp": want}, name
        assert r["version"] == 6
    assert "model" in results["2x1x1"]["wqkv_spec"]


def test_server_routes_update_sleep_and_wake(tiny_model_dir, other_model_dir, tmp_path):
    """--enable-weight-updates, through the official client where it applies: the key is
    required, the new weights serve the next request (tagged with their version in the response,
    /v1/models and the metrics), bad checkpoints are 4xx, and a sleeping server answers 503."""
    import httpx
    import openai

    from jaxllm.entrypoints.openai.api_server import build_app
    from jaxllm.entrypoints.openai.server_args import ServerArgs
    from tests.helpers.quantized_checkpoints import write_quantized_gguf

    with pytest.raises(ValueError, match="--api-key"):
        build_app(
            AsyncLLM(engine=LLM(tiny_model_dir, **TINY_ENGINE_ARGS).engine), ServerArgs(enable_weight_updates=True)
        )
    other_shapes = write_quantized_gguf(str(tmp_path / "other-shapes.gguf"))
    fresh = LLM(other_model_dir, **TINY_ENGINE_ARGS)
    want = fresh.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text

    async def main():
        llm = AsyncLLM(engine=LLM(tiny_model_dir, **TINY_ENGINE_ARGS).engine)
        app = build_app(llm, ServerArgs(api_key="k", enable_weight_updates=True))
        plain = build_app(llm, ServerArgs(api_key="k"))
        key = {"Authorization": "Bearer k"}
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                update = {"path": other_model_dir, "version": "step-1"}
                assert (await http.post("/update_weights", json=update)).status_code == 401
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://p") as p:
                    assert (await p.post("/update_weights", json=update, headers=key)).status_code == 404
                r = await http.post("/update_weights", json=update, headers=key)
                assert r.status_code == 200 and r.json()["weight_version"] == "step-1"
                client = openai.AsyncOpenAI(api_key="k", base_url="http://app/v1", http_client=http)
                models = await client.models.list()
                assert models.data[0].weight_version == "step-1"
                done = await client.completions.create(
                    model=models.data[0].id,
                    prompt=PROMPTS[0],
                    max_tokens=12,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                assert done.choices[0].text == want and done.weight_versions == ["step-1"]
                for path, status, message in [
                    (str(tmp_path / "nothing"), 404, "no checkpoint"),
                    (other_shapes, 400, "shape"),
                ]:
                    r = await http.post("/update_weights", json={"path": path}, headers=key)
                    assert r.status_code == status and message in r.json()["error"]["message"], r.text
                r = await http.post(
                    "/update_weights", json={"path": other_model_dir, "in_flight": "later"}, headers=key
                )
                assert r.status_code == 400
                assert (await http.post("/sleep", json={"level": 1}, headers=key)).json() == {"sleep_level": 1}
                assert (await http.get("/is_sleeping", headers=key)).json()["is_sleeping"] is True
                with pytest.raises(openai.APIStatusError) as asleep:
                    await client.completions.create(model=models.data[0].id, prompt="hi", max_tokens=2)
                assert asleep.value.status_code == 503 and "wake_up" in asleep.value.message
                metrics = (await http.get("/metrics")).text
                assert 'jaxllm:weight_version_info{model_name="' in metrics and 'version="step-1"} 1.0' in metrics
                assert "jaxllm:engine_sleep_level" in metrics and "jaxllm:weight_updates_total" in metrics
                assert (await http.post("/wake_up", headers=key)).json() == {"sleep_level": 0}
                again = await client.completions.create(
                    model=models.data[0].id,
                    prompt=PROMPTS[0],
                    max_tokens=12,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                assert again.choices[0].text == want
        finally:
            llm.shutdown()

    asyncio.run(main())
