"""Tensor, pipeline and data parallelism on virtual CPU devices: per-device memory, step time.

    python benchmarks/sharding.py              # layouts 1x1 2x1 4x1 1x2 2x2 1x1x2 1x1x4 2x1x2 on 4 devices
    python benchmarks/sharding.py --layouts 1x1,2x1 --requests 16

The model is a random Llama built with transformers (default: hidden 512, 8 heads, 4 KV heads of
64, MLP 1536, 8 layers, SmolLM2's vocabulary): shapes that divide by 2 and 4, unlike the default
model's 9 heads. For each layout (TPxDP[xPP]) it reports the bytes of parameters and KV pages
each device holds, and, on one fixed greedy workload, the wall time, output tok/s, mean device
time per step and the pipeline's idle fraction (stage-ticks that ran no micro-batch, of all).
Every layout's token ids are checked against 1x1.

Virtual devices are slices of the same 2 cores: sharding cannot make this faster here; the
figures show the cost of the collectives and of running the shards one after another. JSON to
--out (default benchmarks/results/sharding.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# benchmarks/ must not be on sys.path: kernels.py here would shadow HF's `kernels` package, which
# transformers imports when it probes for it. workload.py itself imports only stdlib + numpy.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, machine_info, now_iso, versions  # noqa: E402

del sys.path[0]


def build_model(path: str, args) -> str:
    import torch
    import transformers

    from jaxllm.models.loader import load_model

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    load_model(None, progress=False).tokenizer.save_pretrained(path)
    return path


def device_bytes(tree) -> list[int]:
    import jax

    out: dict[int, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return [out[k] for k in sorted(out)]


def run_layout(model_dir: str, layout: str, args, cache_dir: str) -> dict:
    import numpy as np

    from jaxllm import LLM, SamplingParams

    tp, dp, pp = (list(map(int, layout.split("x"))) + [1])[:3]
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype="float32",
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        max_model_len=1024,
        kv_cache_memory=64 << 20,
        params_cache_dir=cache_dir,
    )
    llm.engine.wait_compiled()
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 40000, int(rng.integers(32, 256))).tolist()}
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = llm.engine
    steps0, device0 = engine.stats.num_steps, engine.stats.time_device
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = engine.stats.num_steps - steps0
    runners = [r.runner for r in engine.replicas]
    ticks = sum(r.builder.stage_ticks for r in runners)
    return {
        "layout": layout,
        "tp": tp,
        "dp": dp,
        "pp": pp,
        "startup_s": startup,
        "wall_s": wall,
        "pipeline_idle": 1 - sum(r.builder.busy_stage_ticks for r in runners) / ticks if ticks else 0.0,
        "output_tok_s": args.requests * args.max_tokens / wall,
        "device_ms_per_step": 1000 * (engine.stats.time_device - device0) / max(steps, 1),
        "steps": steps,
        "param_bytes_per_device": device_bytes(engine.runner.params),
        "kv_bytes_per_device": device_bytes([r.runner.kv_cache for r in engine.replicas]),
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1x1,2x1,4x1,1x2,2x2,1x1x2,1x1x4,2x1x2", help="TPxDP[xPP], comma-separated")
    ap.add_argument("--devices", type=int, default=4, help="virtual CPU devices")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(RESULTS, "sharding.json"))
    args = ap.parse_args()
    # Before JAX starts (nothing above imports it).
    flag = f" --xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + flag
    work = tempfile.mkdtemp(prefix="jaxllm-sharding-")
    model_dir = build_model(os.path.join(work, "model"), args)
    rows = []
    for layout in args.layouts.split(","):
        row = run_layout(model_dir, layout, args, os.path.join(work, "params"))
        row["same_tokens_as_1x1"] = row["token_ids"] == rows[0]["token_ids"] if rows else True
        rows.append(row)
        print(
            f"{layout:>6}: params/device {[b >> 20 for b in row['param_bytes_per_device']]} MiB, "
            f"KV/device {[b >> 20 for b in row['kv_bytes_per_device']]} MiB, {row['output_tok_s']:.1f} out tok/s, "
            f"{row['device_ms_per_step']:.1f} ms/step device, pipeline idle {row['pipeline_idle']:.0%}, "
            f"start-up {row['startup_s']:.1f} s, "
            f"same tokens as 1x1: {row['same_tokens_as_1x1']}",
            flush=True,
        )
    for row in rows:
        del row["token_ids"]
    result = {
        "when": now_iso(),
        "machine": machine_info(),
        "versions": versions(),
        "devices": args.devices,
        "model": {"hidden": args.hidden, "layers": args.layers},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r["same_tokens_as_1x1"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
