"""Throughput of a mixture-of-experts and a sliding-window model (random weights, built
locally with transformers at realistic proportions), the share of a step spent routing, and
the two MoE expert kernels compared.

    python benchmarks/models.py                       # all parts
    python benchmarks/models.py --parts experts       # one part

Parts:
- "throughput": each model through `LLM.generate` with jaxllm's defaults on the standard
  workload's shape (random prompts and outputs, greedy, ignore_eos; --num-prompts,
  --input-len, --output-len): output tokens/s, and ms per engine step.
  Models: `moe`, Qwen3-MoE-shaped (16 experts, top 4, every layer routed); `window`,
  Gemma 3-shaped (5 sliding-window layers of --window tokens to 1 global).
- "routing": the MoE model's routing alone (router matmul, softmax, top-k, the sort of the
  (token, expert) pairs by expert and the gather of their rows: `moe.dispatch`) timed inside
  one jitted call at decode batches of --batches tokens, against the engine's ms per step at
  the same batch (decode only): the share of a step spent routing = layers x routing / step.
- "experts": one MoE layer's MLP at --tokens tokens, each way `models/moe.py` has: `gather`
  (each pair's expert weights gathered), `dense` (every expert on every token, zero-weighted
  outside the top k) and `grouped` (`jax.lax.ragged_dot` over the pairs sorted by expert);
  `moe.expert_impl` is what the engine picks at that size.
- "window_kv": the `window` model on long requests (--long-requests prompts of
  --long-input-len tokens, 32 outputs each, max_model_len 4096): the KV pages its requests
  hold at the busiest step, per KV cache group (global layers, windowed layers), and the
  bytes they take against the bytes the same requests would take if every layer kept every
  page (what the engine did before windowed layers released theirs); and output tokens/s.

JSON to --out (default benchmarks/results/models.json).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import (  # noqa: E402
    RESULTS,
    cpu_line,
    machine_info,
    now_iso,
    parse_range,
    random_workload,
    timeit,
    versions,
    write_result,
)

del sys.path[0]

VOCAB = 32000
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MODELS = {
    "moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=8,
            intermediate_size=1024,
            num_local_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            norm_topk_prob=True,
        ),
    ),
    "window": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(COMMON, num_hidden_layers=12, intermediate_size=2048, query_pre_attn_scalar=64),
    ),
}


def build(kind: str, path: str, window: int) -> str:
    import torch
    import transformers

    config_cls, model_cls, kw = MODELS[kind]
    if kind == "window":
        kw = dict(
            kw,
            sliding_window=window,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)],
        )
    config = getattr(transformers, config_cls)(**kw, architectures=[model_cls])
    torch.manual_seed(0)
    getattr(transformers, model_cls)(config).save_pretrained(path)
    return path


def throughput(llm, requests) -> dict:
    from jaxllm import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False) for r in requests
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    steps0 = llm.engine.stats.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.stats.num_steps - steps0
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "steps": steps,
        "ms_per_step": 1000 * wall / steps,
    }


def decode_ms_per_step(llm, batch: int, decode_tokens: int = 32) -> float:
    from jaxllm import SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    best = float("inf")
    for _ in range(3):
        steps0 = llm.engine.stats.num_steps
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, 1000 * (time.perf_counter() - t0) / (llm.engine.stats.num_steps - steps0))
    return best


def routing_ms(cfg, layer, tokens: int, repeats: int = 16) -> float:
    """ms of one layer's `moe.dispatch` at `tokens` tokens, from `repeats` chained in one call."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models import moe

    @jax.jit
    def chained(h, router):
        def body(_, h):
            rows, _, w, sizes = moe.dispatch(h, router, cfg)
            # Feed a value of the result back so no repeat can be skipped or hoisted.
            return h + 1e-6 * (rows[: h.shape[0]] * w[: h.shape[0], None] + sizes[0])

        return jax.lax.fori_loop(0, repeats, body, h)

    h = jax.random.normal(jax.random.key(0), (tokens, cfg.hidden_size), jnp.float32)
    return 1000 * timeit(lambda: jax.block_until_ready(chained(h, layer["router"]))) / repeats


def experts(cfg, layer, token_counts) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxllm.models import moe
    from jaxllm.models.decoder import ACTIVATIONS

    rows = []
    for tokens in token_counts:
        h = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), jnp.float32)
        row = {"tokens": tokens, "engine_picks": moe.expert_impl(tokens, cfg)}
        for impl in ("gather", "dense", "grouped"):
            fn = jax.jit(lambda h, layer, impl=impl: moe.moe_mlp(layer, h, cfg, ACTIVATIONS[cfg.hidden_act], impl))
            row[f"{impl}_ms"] = 1000 * timeit(lambda: jax.block_until_ready(fn(h, layer)))
        print(
            f"experts, {tokens:5d} tokens: gather {row['gather_ms']:8.3f} ms, dense {row['dense_ms']:8.3f} ms, "
            f"grouped (ragged_dot) {row['grouped_ms']:8.3f} ms; the engine picks {row['engine_picks']}",
            flush=True,
        )
        rows.append(row)
    return rows


def window_kv(path: str, args, cache_dir: str) -> dict:
    import numpy as np

    from jaxllm import LLM, SamplingParams
    from jaxllm.engine_config import kv_bytes_per_token

    llm = LLM(path, params_cache_dir=cache_dir, dtype=args.dtype, max_model_len=4096)
    llm.engine.wait_compiled()
    core, cfg, cache = llm.engine.engine_core, llm.engine.cfg, llm.engine.config.cache
    kv = core.kv_cache_manager
    layers = [
        cfg.num_layers - sum(1 for i in range(cfg.num_layers) if cfg.window(i)),
        sum(1 for i in range(cfg.num_layers) if cfg.window(i)),
    ]
    page_bytes = kv_bytes_per_token(cfg, cache.dtype) // cfg.num_layers * cache.page_size  # one layer's page
    peak = {"held": [0, 0], "tokens": 0}
    step = core.step

    def watched():
        out = step()
        held = [sum(len(g.held(r)) for r in core.scheduler.running) for g in kv.groups]
        if held[0] > peak["held"][0]:
            peak["held"] = held
        return out

    core.step = watched
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(3, VOCAB, args.long_input_len).tolist()} for _ in range(args.long_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    held = peak["held"]
    with_groups = page_bytes * (held[0] * layers[0] + held[1] * layers[1])
    one_pool = page_bytes * held[0] * cfg.num_layers
    out = {
        "requests": args.long_requests,
        "input_len": args.long_input_len,
        "output_len": 32,
        "window": max(cfg.layer_windows),
        "layers_global_windowed": layers,
        "pool_pages_per_group": [g.num_pages for g in kv.groups],
        "peak_pages_held_per_group": held,
        "peak_kv_mib": with_groups / 2**20,
        "peak_kv_mib_if_every_layer_kept_every_page": one_pool / 2**20,
        "output_tok_s": tokens / wall,
        "wall_s": wall,
    }
    print(
        f"window_kv: {args.long_requests} x {args.long_input_len}-token prompts, pages held at the peak "
        f"{held} (global, windowed layers) = {out['peak_kv_mib']:.1f} MiB of KV, against "
        f"{out['peak_kv_mib_if_every_layer_kept_every_page']:.1f} MiB if every layer kept every page "
        f"({one_pool / with_groups:.2f}x); {out['output_tok_s']:.1f} output tok/s",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="throughput,routing,experts,window_kv")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=parse_range, default=(32, 256))
    ap.add_argument("--output-len", type=parse_range, default=(32, 128))
    ap.add_argument("--window", type=int, default=128, help="the sliding window of the `window` model")
    ap.add_argument("--batches", default="1,8,32", help="routing: decode batches (default: %(default)s)")
    ap.add_argument("--tokens", default="1,4,8,32,256,1024", help="experts: tokens (default: %(default)s)")
    ap.add_argument("--long-requests", type=int, default=8, help="window_kv: requests (default: %(default)s)")
    ap.add_argument("--long-input-len", type=int, default=3000, help="window_kv: prompt tokens (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "models.json"))
    args = ap.parse_args()
    parts = args.parts.split(",")

    from jaxllm import LLM

    machine = machine_info()
    print(f"CPU: {cpu_line(machine)}", flush=True)
    result = {
        "benchmark": "models",
        "command": "python " + shlex.join(sys.argv),
        "date": now_iso(),
        "machine": machine,
        "versions": versions(),
    }
    requests = random_workload(args.num_prompts, args.input_len, args.output_len, 0, VOCAB, [0, 1, 2])
    with tempfile.TemporaryDirectory() as tmp:
        for kind, uses in (("moe", {"throughput", "routing", "experts"}), ("window", {"throughput"})):
            if not uses & set(parts):
                continue
            llm = LLM(
                build(kind, os.path.join(tmp, kind), args.window),
                params_cache_dir=os.path.join(tmp, "cache"),
                dtype=args.dtype,
                max_model_len=512,
            )
            llm.engine.wait_compiled()
            cfg = llm.engine.cfg
            out = result[kind] = {
                "config": MODELS[kind][2],
                "dtype": llm.engine.config.dtype,
                "layer_windows": list(cfg.layer_windows),
            }
            if "throughput" in parts:
                out["throughput"] = throughput(llm, requests)
                t = out["throughput"]
                print(
                    f"{kind}: {t['output_tok_s']:.0f} output tok/s, {t['ms_per_step']:.1f} ms/step "
                    f"({llm.engine.config.dtype})",
                    flush=True,
                )
            if kind != "moe":
                continue
            layer = llm.engine.runner.params["layers"][0]
            if "routing" in parts:
                out["routing"] = []
                for batch in map(int, args.batches.split(",")):
                    step, route = decode_ms_per_step(llm, batch), routing_ms(cfg, layer, batch)
                    share = len(cfg.moe_layers) * route / step
                    out["routing"].append(
                        {
                            "batch": batch,
                            "ms_per_step": step,
                            "routing_ms_per_layer": route,
                            "moe_layers": len(cfg.moe_layers),
                            "share_of_step": share,
                        }
                    )
                    print(
                        f"routing, decode batch {batch:3d}: {route:.3f} ms a layer x {len(cfg.moe_layers)} "
                        f"of {step:.2f} ms a step = {share:.1%}",
                        flush=True,
                    )
            if "experts" in parts:
                out["experts"] = experts(cfg, layer, list(map(int, args.tokens.split(","))))
            del llm
        if "window_kv" in parts:
            result["window_kv"] = window_kv(
                build("window", os.path.join(tmp, "window"), args.window), args, os.path.join(tmp, "cache")
            )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
