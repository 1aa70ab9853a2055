"""One process of a two-process jaxllm run on 127.0.0.1 (jax.distributed, gloo collectives), for
tests/parallel/test_sharding.py:

    python -m tests.helpers.multihost_worker MODEL_DIR OUT.json PORT PROCESS_ID [ENGINE_ARGS_JSON]

Each process has one CPU device; the model is split over both (tensor_parallel_size=2). Process
0 generates the test batch and writes the token ids to OUT.json, then releases process 1, which
follows its steps until then. Both start with dtype="auto", and process 1 poses as the other
CPU kind (its CPU flags changed so that alone it would pick the other dtype): both must run in
process 0's pick, which each writes to OUT.json.dtype<process id>. ENGINE_ARGS_JSON: more
engine arguments (quantization, say), with which both run in float32.
"""

from __future__ import annotations

import json
import sys

from tests.helpers.tiny_model import WARM_ENGINE_ARGS


PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 6) for i in range(24)]


# Both processes compile every step shape in lockstep before the first step: 5 shapes, not 8.
FEWER_SHAPES = {"max_num_seqs": 8, "max_num_batched_tokens": 64}


def sampling_params():
    """Greedy, 24 tokens; every 4th request under a structured-output constraint (its mask goes
    to the follower with the step)."""
    from jaxllm import SamplingParams, StructuredOutputsParams

    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex=r"(fox|dog)( (fox|dog))*"),
    )
    return [constrained if i % 4 == 0 else plain for i in range(len(PROMPTS))]


def main() -> int:
    from jaxllm import LLM, platforms

    model_dir, out_path, port, process_id = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    if process_id == 1 and not extra:
        flags = (
            frozenset()
            if platforms.Platform.named("cpu").default_dtype[0] == "bfloat16"
            else frozenset({"avx512_bf16"})
        )
        platforms.cpu_flags = lambda: flags
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        distributed_coordinator=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        **{**WARM_ENGINE_ARGS, **FEWER_SHAPES, "dtype": "float32" if extra else "auto", **extra},
    )
    with open(f"{out_path}.dtype{process_id}", "w") as f:
        f.write(llm.engine.config.dtype)
    if not llm.engine.is_leader:
        llm.engine.follow()
        return 0
    try:
        outputs = llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    with open(out_path, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outputs], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
