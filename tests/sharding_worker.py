"""Run by tests/test_sharding.py in a subprocess with N virtual CPU devices (XLA flags must be set
before JAX starts, and the other tests keep one device):

    python tests/sharding_worker.py MODEL_DIR OUT.json TPxDP[xPP] [TPxDP[xPP] ...]

Generates the same batch (greedy, float32, with logprobs, every 8th request under a regex
constraint) on one device and with each layout
(tensor x data [x pipeline] parallel sizes, e.g. 2x1, 1x2, 2x2, 2x1x2; mesh:2x2 on a caller's
("data", "model") Mesh, mesh:2x1x2 on a ("data", "stage", "model") one; deep:1x1x4 on a
4-layer copy of the model, against deep:1x1; int8:... with an int8 KV cache and int4 weights
(`quantization="int4"`), against int8:1x1; w8a8:... with W8A8 weights, against w8a8:1x1;
a "+swap" suffix preempts by swapping pages to the host), with a KV
pool small enough to preempt and prompts long enough to be chunked, and writes the token ids,
logprobs, per-device parameter and KV bytes and each replica's share of the prompts to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402

from tiny_model import TINY_ENGINE_ARGS, build_tiny_model  # noqa: E402

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


def main() -> int:
    from jaxllm import LLM, SamplingParams, StructuredOutputsParams

    model_dir, out_path, *layouts = sys.argv[1:]
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
    args = {**TINY_ENGINE_ARGS, "kv_cache_memory": None, "num_gpu_blocks_override": 36,
            "params_cache_dir": os.path.join(os.path.dirname(out_path), "params")}
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
        model = build_tiny_model(os.path.join(os.path.dirname(out_path), "deep"), 4) if is_deep else model_dir
        mesh = None
        if own_mesh:
            mesh = (jax.make_mesh((dp, pp, tp), ("data", "stage", "model")) if pp > 1
                    else jax.make_mesh((dp, tp), ("data", "model")))
        llm = LLM(model, tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp, mesh=mesh,
                  **args, **swap, **quantized)
        engine = llm.engine
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runner = engine.runner
        results[layout] = {
            "model": model,
            "token_ids": [o.outputs[0].token_ids for o in outputs],
            "constrained": [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs[::8]],
            "constraint": WORDS,
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outputs],
            # Each position's lead of the first token over the second (the greedy choice's margin).
            "margins": [[lead(lp) for lp in o.outputs[0].logprobs] for o in outputs],
            "param_bytes": device_bytes(runner.params), "kv_bytes": device_bytes(runner.kv_cache),
            "kv_bytes_all": device_bytes([r.runner.kv_cache for r in engine.replicas]),
            "preemptions": engine.stats.num_preemptions,
            "replica_prompt_queries": [r.kv_cache_manager.prefix_queries for r in engine.replicas],
        }
        del llm, engine, runner
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
