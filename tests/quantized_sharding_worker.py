"""Run by tests/test_quantized_checkpoints.py in a subprocess with 2 virtual CPU devices (XLA
flags must be set before JAX starts):

    python tests/quantized_sharding_worker.py TINY_MODEL_DIR WORKDIR OUT.json

Writes a tiny GGUF of every kept block type (its two layers in different ones) and AWQ and
act-order GPTQ checkpoints of the tiny model, runs each on one device, tensor-parallel over two
and (but AWQ) over two pipeline stages (the GGUF with `quantization="gguf"`: sharded runs dequantize a
GGUF by default), and writes the token ids, the logprobs and the bytes each device holds of
the first layer slot's fused QKV to OUT.json under "NAME:TPxPP"; for the act-order GPTQ,
tensor-parallel, the error (its row-split matrices cannot shard).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax  # noqa: E402


def main() -> int:
    from jaxllm import LLM, SamplingParams
    from test_quantized_checkpoints import write_quantized_gguf, write_quantized_hf
    from tiny_model import TINY_ENGINE_ARGS

    model_dir, work, out_path = sys.argv[1:]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 10 + 5 * i))} for i in range(4)]
    checkpoints = {"gguf": write_quantized_gguf(os.path.join(work, "tiny.gguf"))}
    for name, method, bits, act_order in [("awq", "awq", 4, False), ("gptq-act-order", "gptq", 4, True)]:
        checkpoints[name] = os.path.join(work, name)
        write_quantized_hf(model_dir, method, bits, act_order, checkpoints[name], os.path.join(work, name + "-ref"))
    results = {}
    for name, path in checkpoints.items():
        # (AWQ over stages takes the GGUF's path; act-order GPTQ tensor-parallel only to see it refused)
        for tp, pp in ((1, 1), (2, 1)) + (((1, 2),) if name != "awq" else ()):
            key = f"{name}:{tp}x{pp}"
            try:
                llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          params_cache_dir=os.path.join(work, "params"),
                          quantization="gguf" if name == "gguf" else None, **TINY_ENGINE_ARGS)
            except ValueError as e:
                results[key] = {"error": str(e)}
                continue
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            wqkv = llm.engine.runner.params["layers"][0]["wqkv"]
            results[key] = {
                "quantization": llm.engine.config.quantization,
                "token_ids": [o.outputs[0].token_ids for o in outputs],
                "logprobs": [o.outputs[0].cumulative_logprob for o in outputs],
                "qkv_bytes": [sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(wqkv)
                                  for s in leaf.addressable_shards if s.device == d) for d in jax.devices()],
            }
            del llm, outputs, wqkv
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
