"""Run by tests/test_model_families.py in a subprocess with 4 virtual CPU devices (XLA flags
must be set before JAX starts):

    python tests/family_sharding_worker.py OUT.json MODEL_DIR:TPxPP [MODEL_DIR:TPxPP ...]

Generates the same requests (greedy, float32, with logprobs, prompts chunked and longer than
any window) from each model on one device and with its layout, and writes both runs' token
ids and logprobs to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"


def main() -> int:
    import numpy as np

    from jaxllm import LLM, SamplingParams

    out_path, *cases = sys.argv[1:]
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 256, n).tolist()} for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False, logprobs=2)
    results = {}
    for case in cases:
        model_dir, layout = case.rsplit(":", 1)
        tp, pp = map(int, layout.split("x"))
        runs = {}
        for name, sizes in (("one", (1, 1)), ("sharded", (tp, pp))):
            llm = LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
                      kv_cache_memory=4 << 20, block_size=4, tensor_parallel_size=sizes[0],
                      pipeline_parallel_size=sizes[1], params_cache_dir=os.path.join(model_dir, f"cache{name}"),
                      warmup=False)      # step shapes compiled when first used
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name] = {"token_ids": [o.outputs[0].token_ids for o in outs],
                          "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                       for o in outs]}
            del llm
        results[case] = runs
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
