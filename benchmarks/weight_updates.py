"""Weights into a running engine, and memory back from a sleeping one, against a fresh engine.

    python benchmarks/weight_updates.py                              # the default model
    python benchmarks/weight_updates.py --model qwen2.5-coder-0.5b   # the real 0.5B
    python benchmarks/weight_updates.py --devices 2                  # + reshards between meshes

An engine of float weights (`quantization="none"`, the form a trainer updates) takes new weights
(`LLMEngine.update_weights`) in each of the forms a trainer has them; each figure is the median
of `--repeats` updates, timed to the arrays being ready:

- `zero_copy`: an engine stepping with XLA's dots on its arrays as they are (`packed_weights=
  False`) takes the tree `get_weights` gave it (the buffers themselves);
- `pack_bf16`: the default CPU engine (bf16 weights packed into the C++ GEMM's panels) takes a
  bf16 model tree: every matrix is packed again;
- `cast_pack_f32`: the same from a trainer's float32 master weights (cast, then packed);
- `hf_names`: the same from a flat dict in HF checkpoint names (numpy: fused on the host first);
- with `--devices N` (N virtual CPU devices in this process): `reshard_fsdp_to_tp`, a
  tensor-parallel engine over the N devices taking a tree sharded FSDP-style (each matrix's first
  dimension split over all devices), and `fsdp_to_one_device`, a one-device engine taking it.

Against `fresh_engine`: constructing `LLM(model)` with warm caches until its steps are ready.
Then `sleep(1)` (the KV pool freed), `sleep(2)` (the weights too), each with the process's RSS,
and the time to `wake_up()` (level 1) and to `update_weights` + `wake_up()` (level 2).
JSON to --out (default benchmarks/results/weight_updates.json).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, write_run  # noqa: E402

del sys.path[0]


def rss_mib() -> float:
    """The process's resident memory now, after returning freed heap to the OS."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (its result's arrays ready)."""
    import jax

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a path or short name (default: the default model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--devices", type=int, default=1, help="virtual CPU devices (>1: also the reshard paths)")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--out", default=os.path.join(RESULTS, "weight_updates.json"))
    args = ap.parse_args()
    if args.devices > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        )
    from jaxllm import LLM

    from jaxllm.entrypoints.cli import parse_size

    common = dict(quantization="none", kv_cache_memory=parse_size(args.kv_cache_memory), dtype="bfloat16")
    results: dict = {}
    LLM(args.model, **common).engine.wait_compiled()  # caches warm (params, compiled steps)
    start = time.perf_counter()
    llm = LLM(args.model, **common)
    llm.engine.wait_compiled()
    results["fresh_engine_s"] = time.perf_counter() - start
    tree = llm.engine.get_weights()  # bf16, unpacked (a copy)
    results["paths"] = packed_paths(llm, tree, args.repeats)
    results.update(sleep_figures(llm, tree))
    llm = None
    gc.collect()
    plain = LLM(args.model, packed_weights=False, **common).engine
    own = plain.get_weights()
    results["paths"]["zero_copy"] = timed(lambda: plain.update_weights(own) or plain.runner.params, args.repeats)
    plain = own = None
    if args.devices > 1:
        results["paths"].update(mesh_paths(args, common, tree))
    results.update(model=args.model or "default (SmolLM2-135M-Instruct)", options=common, devices=args.devices)
    print(f"fresh engine (warm caches): {results['fresh_engine_s']:.2f} s")
    fresh = results["fresh_engine_s"]
    for name, seconds in results["paths"].items():
        print(f"  update {name:22s} {seconds * 1000:9.1f} ms  ({fresh / seconds:6.1f}x faster than fresh)")
    wake_1, wake_2 = results["wake_up_1_s"], results["update_and_wake_up_2_s"]
    print(f"RSS MiB: {results['rss_mib']}; wake_up(1) {wake_1:.2f} s, update + wake_up(2) {wake_2:.2f} s")
    write_run(args.out, results)


PROMPT, GREEDY_TOKENS = "def quicksort(items):", 8


def greedy_tokens(llm) -> list[int]:
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def packed_paths(llm, tree, repeats: int) -> dict:
    """The default CPU engine's update times from a bf16 tree, an f32 one and HF names."""
    import jax
    import numpy as np

    engine, want = llm.engine, greedy_tokens(llm)

    def update(weights):
        return lambda: engine.update_weights(weights) or engine.runner.params

    paths = {"pack_bf16": timed(update(tree), repeats)}
    paths["cast_pack_f32"] = timed(update(jax.tree.map(lambda x: x.astype(np.float32), tree)), repeats)
    hf = hf_names(engine)
    if hf is not None:
        paths["hf_names"] = timed(update(hf), repeats)
    assert greedy_tokens(llm) == want
    return paths


def sleep_figures(llm, tree) -> dict:
    """RSS awake, after sleep(1) and sleep(2), woken; the times to wake up."""
    import jax

    engine, want = llm.engine, greedy_tokens(llm)
    rss = {"awake": rss_mib()}
    engine.sleep(1)
    rss["sleep_1"] = rss_mib()
    start = time.perf_counter()
    engine.wake_up()
    jax.block_until_ready(engine.runner.kv_cache)
    out = {"wake_up_1_s": time.perf_counter() - start}
    engine.sleep(2)
    rss["sleep_2"] = rss_mib()
    start = time.perf_counter()
    engine.update_weights(tree)
    engine.wake_up()
    jax.block_until_ready((engine.runner.kv_cache, engine.runner.params))
    out["update_and_wake_up_2_s"] = time.perf_counter() - start
    rss["woken"] = rss_mib()
    assert greedy_tokens(llm) == want
    return {**out, "rss_mib": rss}


def mesh_paths(args, common: dict, tree) -> dict:
    """From a tree sharded FSDP-style over every device: to a tensor-parallel engine over them,
    and to a one-device engine."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxllm import LLM

    fsdp = jax.make_mesh((args.devices,), ("fsdp",))

    def place(x):
        split = x.ndim == 2 and x.shape[0] % args.devices == 0
        return jax.device_put(x, NamedSharding(fsdp, PartitionSpec("fsdp" if split else None)))

    sharded = jax.tree.map(place, tree)
    paths = {}
    for name, options in [("reshard_fsdp_to_tp", {"tensor_parallel_size": args.devices}), ("fsdp_to_one_device", {})]:
        try:
            engine = LLM(args.model, **common, **options).engine
        except ValueError as e:  # e.g. heads that do not split that many ways
            print(f"{name}: skipped ({e})")
            continue
        paths[name] = timed(lambda: engine.update_weights(sharded) or engine.runner.params, args.repeats)
    return paths


def hf_names(engine) -> dict | None:
    """The model's weights in HF names, as a trainer holding an HF model would send them
    (from the engine's own tree, un-fused), or None for a family this script does not map."""
    import numpy as np

    cfg = engine.cfg
    if cfg.architecture not in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        return None
    tree = engine.get_weights()
    out = {"model.embed_tokens.weight": np.asarray(tree["embed"]), "model.norm.weight": np.asarray(tree["final_norm"])}
    if "lm_head" in tree:
        out["lm_head.weight"] = np.asarray(tree["lm_head"]).T
    q, kv = cfg.q_size, cfg.kv_size
    for i, layer in enumerate(tree["layers"]):
        p = f"model.layers.{i}."
        wqkv = np.asarray(layer["wqkv"]).T
        gate_up = np.asarray(layer["w_gate_up"]).T
        out |= {
            p + "input_layernorm.weight": np.asarray(layer["attn_norm"]),
            p + "post_attention_layernorm.weight": np.asarray(layer["mlp_norm"]),
            p + "self_attn.q_proj.weight": wqkv[:q],
            p + "self_attn.k_proj.weight": wqkv[q : q + kv],
            p + "self_attn.v_proj.weight": wqkv[q + kv :],
            p + "self_attn.o_proj.weight": np.asarray(layer["wo"]).T,
            p + "mlp.gate_proj.weight": gate_up[: cfg.intermediate_size],
            p + "mlp.up_proj.weight": gate_up[cfg.intermediate_size :],
            p + "mlp.down_proj.weight": np.asarray(layer["w_down"]).T,
        }
        if "bqkv" in layer:
            b = np.asarray(layer["bqkv"])
            out |= {
                p + "self_attn.q_proj.bias": b[:q],
                p + "self_attn.k_proj.bias": b[q : q + kv],
                p + "self_attn.v_proj.bias": b[q + kv :],
            }
    return out


if __name__ == "__main__":
    main()
