"""The checks `run_on_virtual_devices` runs (tests/conftest.py; tests/helpers/virtual_devices.py
starts them): each runs in a subprocess whose JAX sees N virtual CPU devices, generates the same
requests on one device and sharded, and returns what the test compares (JSON). The tests'
assertions stay in the tests.

- `parallel_layouts` (tests/parallel/test_sharding.py, 4 devices): the same batch (greedy, float32, with
  logprobs, every 8th request under a regex constraint) on one device and with each layout
  (tensor x data [x pipeline] parallel sizes, e.g. 2x1, 1x2, 2x2, 2x1x2; mesh:2x2 on a caller's
  ("data", "model") Mesh, mesh:2x1x2 on a ("data", "stage", "model") one; deep:1x1x4 on a
  4-layer copy of the model, against deep:1x1; int8:... with an int8 KV cache and int4 weights
  (`quantization="int4"`), against int8:1x1; w8a8:... with W8A8 weights, against w8a8:1x1; a
  "+swap" suffix preempts by swapping pages to the host), with a KV pool small enough to preempt
  and prompts long enough to be chunked: the token ids, logprobs, per-device parameter and KV
  bytes and each replica's share of the prompts.
- `families` (tests/models/test_model_families.py, 4 devices): the same requests (greedy,
  float32, with logprobs, prompts chunked and longer than any window) from each model on one
  device and with its layout ("MODEL_DIR:TPxPP"): both runs' token ids and logprobs.
- `lora_layouts` (tests/lora/test_adapters.py, 4 devices): requests of several LoRA adapters and
  of the base model in the same steps, in each layout ("TPxPP", e.g. 4x1: more shards than KV
  heads; 2x2): each run's token ids and logprobs.
- `quantized_checkpoints` (tests/quantization/test_quantized_checkpoints.py, 2 devices): writes
  a tiny GGUF of every kept block type (its two layers in different ones) and AWQ and act-order
  GPTQ checkpoints of the tiny model, runs each on one device, tensor-parallel over two and (but
  AWQ) over two pipeline stages (the GGUF with `quantization="gguf"`: sharded runs dequantize a
  GGUF by default): the token ids, the logprobs and the bytes each device holds of the first
  layer slot's fused QKV under "NAME:TPxPP"; for the act-order GPTQ, tensor-parallel, the error
  (its row-split matrices cannot shard).

Imported only in that subprocess, after XLA's flags are set (JAX reads them when it starts).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from tests.helpers.tiny_model import FAMILY_ENGINE_ARGS, TINY_ENGINE_ARGS, build_tiny_model


# The constrained requests' regex: words and single spaces, so that an output cut short by
# max_tokens matches it too up to its last space.
WORDS = r"(alpha|beta|gamma)( (alpha|beta|gamma))*"


def lead(logprobs: dict) -> float:
    """How far a position's most likely token leads the next one (its logprobs: top 3 and the chosen)."""
    first, second = sorted((x.logprob for x in logprobs.values()), reverse=True)[:2]
    return first - second


def device_bytes(tree) -> dict[str, int]:
    """Bytes each device holds of the arrays in `tree`."""
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device.id)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out


def parallel_layouts(workdir: str, model_dir: str, layouts: list[str]) -> dict:
    """{layout: its run} for "1x1", the references the layouts need and each of `layouts`."""
    from jaxllm import LLM, SamplingParams, StructuredOutputsParams

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    prompts = [f"Request {i}: " + " ".join(words[(i + j) % 10] for j in range(4 + 37 * (i % 7))) for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    # Every 8th request under a structured-output constraint: the token mask goes through each layout too.
    constrained = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(regex=WORDS))
    params = [constrained if i % 8 == 0 else params for i in range(len(prompts))]
    # 36 pages of 16 tokens for 16 requests of up to ~300 tokens: preemption happens (4-5 times per
    # layout; 32 requests, or 16 tokens each, took 1.5-2x as long for no other path: the pipeline
    # layouts' steps cost 150-300 ms on 4 virtual devices). Step shapes compile when first used:
    # twelve engines warming up every bucket took most of the run.
    args = {
        **TINY_ENGINE_ARGS,
        "kv_cache_memory": None,
        "num_gpu_blocks_override": 36,
        "params_cache_dir": os.path.join(workdir, "params"),
    }
    results = {}
    references = [f"{p}:1x1" for p in ("deep", "int8", "w8a8") if any(layout.startswith(f"{p}:") for layout in layouts)]
    for layout in ["1x1", *references, *layouts]:
        # "mesh:TPxDP[xPP]": the same, on a Mesh the caller built; "deep:...": on 4 layers;
        # "int8:...": with an int8 KV cache and int4 weights; "w8a8:...": with W8A8 weights.
        own_mesh, is_deep = layout.startswith("mesh:"), layout.startswith("deep:")
        quantized = {"kv_cache_dtype": "int8", "quantization": "int4"} if layout.startswith("int8:") else {}
        if layout.startswith("w8a8:"):
            quantized = {"quantization": "w8a8"}
        tp, dp, pp = (list(map(int, layout.split(":")[-1].removesuffix("+swap").split("x"))) + [1])[:3]
        swap = {"preemption_mode": "swap", "swap_space": 0.01} if layout.endswith("+swap") else {}
        model = build_tiny_model(os.path.join(workdir, "deep"), 4) if is_deep else model_dir
        mesh = None
        if own_mesh:
            mesh = (
                jax.make_mesh((dp, pp, tp), ("data", "stage", "model"))
                if pp > 1
                else jax.make_mesh((dp, tp), ("data", "model"))
            )
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            pipeline_parallel_size=pp,
            mesh=mesh,
            **args,
            **swap,
            **quantized,
        )
        engine = llm.engine
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runner = engine.runner
        results[layout] = {
            "model": model,
            "token_ids": [o.outputs[0].token_ids for o in outputs],
            "constrained": [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs[::8]],
            "constraint": WORDS,
            "logprobs": [
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
            ],
            # Each position's lead of the first token over the second (the greedy choice's margin).
            "margins": [[lead(lp) for lp in o.outputs[0].logprobs] for o in outputs],
            "param_bytes": device_bytes(runner.params),
            "kv_bytes": device_bytes(runner.kv_cache),
            "kv_bytes_all": device_bytes([r.runner.kv_cache for r in engine.replicas]),
            "preemptions": engine.stats.num_preemptions,
            "replica_prompt_queries": [r.kv_cache_manager.prefix_queries for r in engine.replicas],
        }
        del llm, engine, runner
    return results


def families(workdir: str, cases: list[str]) -> dict:
    """{"MODEL_DIR:TPxPP": {"one": its run on one device, "sharded": its run so laid out}}."""
    import numpy as np

    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 256, n).tolist()} for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=2)
    results = {}
    for case in cases:
        model_dir, layout = case.rsplit(":", 1)
        tp, pp = map(int, layout.split("x"))
        runs = {}
        for name, sizes in (("one", (1, 1)), ("sharded", (tp, pp))):
            llm = LLM(
                model_dir,
                **FAMILY_ENGINE_ARGS,
                tensor_parallel_size=sizes[0],
                pipeline_parallel_size=sizes[1],
                params_cache_dir=os.path.join(model_dir, f"cache{name}"),
            )  # step shapes compiled when first used
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name] = {
                "token_ids": [o.outputs[0].token_ids for o in outs],
                "logprobs": [
                    [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
                ],
            }
            del llm
        results[case] = runs
    return results


def lora_layouts(workdir: str, model_dir: str, adapters: dict, prompts: list, assigned: list, layouts: list) -> dict:
    """{"TPxPP": (token ids, logprobs)}: the same requests, of several LoRA adapters (`assigned`:
    one adapter name or None per prompt) and of the base model in the same steps, in each layout
    (float32, greedy)."""
    from jaxllm import LLM, LoRARequest, SamplingParams

    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters.items()))}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=0)
    results = {}
    for name in layouts:
        tp, pp = map(int, name.split("x"))
        llm = LLM(
            model_dir,
            **FAMILY_ENGINE_ARGS,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            params_cache_dir=os.path.join(workdir, f"cache{name}"),
            enable_lora=True,
            max_loras=2,
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=[None if a is None else requests[a] for a in assigned],
        )
        results[name] = (
            [o.outputs[0].token_ids for o in outs],
            [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs],
        )
        del llm
    return results


def quantized_checkpoints(workdir: str, model_dir: str) -> dict:
    """{"NAME:TPxPP": its run, or {"error": why it was refused}}; the checkpoints written in `workdir`."""
    from jaxllm import LLM, SamplingParams
    from tests.helpers.quantized_checkpoints import write_quantized_gguf, write_quantized_hf

    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 10 + 5 * i))} for i in range(4)]
    checkpoints = {
        "gguf": write_quantized_gguf(os.path.join(workdir, "tiny.gguf")),
        "gguf-untied": write_quantized_gguf(os.path.join(workdir, "untied.gguf"), untied=True),
    }
    for name, method, bits, act_order in [("awq", "awq", 4, False), ("gptq-act-order", "gptq", 4, True)]:
        checkpoints[name] = os.path.join(workdir, name)
        write_quantized_hf(model_dir, method, bits, act_order, checkpoints[name], os.path.join(workdir, name + "-ref"))
    results = {}
    for name, path in checkpoints.items():
        # (AWQ over stages takes the GGUF's path; act-order GPTQ tensor-parallel only to see it refused)
        for tp, pp in ((1, 1), (2, 1)) + (((1, 2),) if name != "awq" else ()):
            key = f"{name}:{tp}x{pp}"
            try:
                llm = LLM(
                    path,
                    tensor_parallel_size=tp,
                    pipeline_parallel_size=pp,
                    params_cache_dir=os.path.join(workdir, "params"),
                    quantization="gguf" if name.startswith("gguf") else None,
                    **TINY_ENGINE_ARGS,
                )
            except ValueError as e:
                results[key] = {"error": str(e)}
                continue
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            wqkv = llm.engine.runner.params["layers"][0]["wqkv"]
            results[key] = {
                "quantization": llm.engine.config.quantization,
                "table_codes": type(llm.engine.runner.params["embed"]).__name__ == "QuantizedWeight",
                "token_ids": [o.outputs[0].token_ids for o in outputs],
                "logprobs": [o.outputs[0].cumulative_logprob for o in outputs],
                "qkv_bytes": [
                    sum(
                        s.data.nbytes
                        for leaf in jax.tree_util.tree_leaves(wqkv)
                        for s in leaf.addressable_shards
                        if s.device == d
                    )
                    for d in jax.devices()
                ],
            }
            del llm, outputs, wqkv
    return results


def weight_updates(workdir: str, model_dir: str, other_dir: str, layouts: list[str]) -> dict:
    """{layout "TPxDPxPP": ...} for engines on `model_dir` laid out so: whether `get_weights`
    gives the loader's own tree (values and the engine's "model" splits), then the greedy tokens
    after `update_weights` with `other_dir`'s weights in HF names, from a one-device model tree,
    and from a model tree sharded FSDP-style (every matrix's first dimension split over all
    devices: a trainer's mesh), each time starting from the first model again."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from safetensors.numpy import load_file

    from jaxllm import LLM, SamplingParams
    from jaxllm.models.loader import load_model

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    own = load_model(model_dir, dtype="float32", use_cache=False, progress=False).params
    other_tree = load_model(other_dir, dtype="float32", use_cache=False, progress=False).params
    hf = load_file(os.path.join(other_dir, "model.safetensors"))
    fsdp = jax.make_mesh((len(jax.devices()),), ("fsdp",))

    def fsdp_place(x):
        split = x.ndim == 2 and x.shape[0] % len(jax.devices()) == 0
        return jax.device_put(x, NamedSharding(fsdp, PartitionSpec("fsdp" if split else None)))

    results = {}
    for name in layouts:
        kind, _, shape = name.rpartition(":")
        tp, dp, pp = map(int, shape.split("x"))
        # "mesh:...": on a ("data", "stage", "model") Mesh of the caller's (jax.make_mesh's axis
        # types); "int4:..." / "w8a8:...": quantized weights, against a fresh engine of the same
        # options on `other_dir` (`fresh`).
        mesh = jax.make_mesh((dp, pp, tp), ("data", "stage", "model")) if kind == "mesh" else None
        options = dict(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp, **TINY_ENGINE_ARGS)
        if kind in ("int4", "w8a8"):
            options["quantization"] = kind
            fresh = LLM(other_dir, **options)
            results[name + ":fresh"] = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy, use_tqdm=False)]
            del fresh
        llm = LLM(model_dir, mesh=mesh, **options)
        engine = llm.engine
        if kind in ("int4", "w8a8"):  # no float weights to give back: the updates only
            runs = {}
            for source, weights in [("hf", hf), ("fsdp", jax.tree.map(fsdp_place, other_tree))]:
                engine.update_weights(weights)
                runs[source] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            results[name] = {"runs": runs}
            del llm, engine
            continue
        got = engine.get_weights()
        same = all(
            np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(own))
        )
        wqkv = got["layers"][0]["wqkv"]
        runs = {}
        for source, weights in [
            ("hf", hf),
            ("one_device", jax.tree.map(jax.numpy.asarray, other_tree)),
            ("fsdp", jax.tree.map(fsdp_place, other_tree)),
        ]:
            engine.update_weights(weights)
            runs[source] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            engine.update_weights(own)
        results[name] = {
            "same_tree": same and jax.tree.structure(got) == jax.tree.structure(own),
            "wqkv_spec": str(getattr(wqkv.sharding, "spec", None)),
            "runs": runs,
            "version": engine.weight_version,
        }
        del llm, engine
    return results


def grpo_on_mesh(workdir: str, model_dir: str, example: str) -> dict:
    """examples/grpo.py's run with the engine tensor x data parallel (2x2) and the trainer's
    params split FSDP-style over the 4 devices: its result (rewards, logprob agreement)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_example", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = {k: v for k, v in TINY_ENGINE_ARGS.items() if k != "dtype"}
    return module.run(model_dir, iterations=12, mesh="2x2", log=lambda *_: None, **args)
