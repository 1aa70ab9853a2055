"""Step time of the jitted model step vs batch shape, where it goes, and this machine's roofline.

    python benchmarks/step.py [--dtype auto] [--context 512] [--out benchmarks/results/step.json]
    python benchmarks/step.py --model qwen2.5-coder-1.5b --batches 1,4 --prefill 512 --out /tmp/step.json

Decode steps of batch 1..256 at a fixed context, and prefill steps of 64..512 prompt tokens,
each timed through the real ModelRunner (host preparation + device step + sampling). The
roofline is measured by the same script, each figure the best of a few calls: the matmul peak
for the dtype (a [512, 576] x [576, 1536] GEMM, the model's shape, through the engine's packed
GEMM where it packs weights) and the memory's read bandwidth (XLA's max over 256 MiB on 2 MiB
pages where Linux allows, as the weights and the KV pool lie, which reads with every core: on a
2-vCPU Zen 4 29.8-32.2 GB/s on 4 KiB pages, where a C loop of AVX-512 loads read 28.2-28.6),
since a step only reads its weights and pages. The donated read+write bandwidth of
an in-place update is printed beside it (about 1.7x the reads there: it counts bytes both ways).

Each step (decode and prefill) is also split into parts, each timed alone at the step's shapes: host (the
runner's input preparation, timed inside the step), GEMMs (every layer's QKV, output,
gate/up (with SwiGLU) and down projections chained as in the model, plus the LM head on the
sampled rows), attention (the backend's kernel over every layer's pages) and the sampler;
"other" is the rest of the step (norms, RoPE, KV writes, embedding). GEMMs are shown in
GFLOP/s against the matmul peak, attention in GB/s of KV pages read against the read
bandwidth.

The weights are what the engine runs by default here (`--quantization` as EngineArgs' to pick
others): on a float32 CPU with the C++ kernels, the default model's Q4_1 blocks kept for the
quantized GEMM; elsewhere the dequantized dtype. The peak stays the float GEMM's. So are the KV
pages (`--kv-cache-dtype` as EngineArgs'): bf16 under a float32 dtype "auto" picked.

`--compare-scan` also times the same forward pass with `lax.scan` over stacked layer weights
and stacked KV pages (the alternative to the runner's unrolled loop), compile time included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import EngineArgs

from jaxllm.engine_config import kv_bytes_per_token, resolve_config, resolve_dtypes
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.outputs import SchedulerOutput
from jaxllm.core.request import Request
from jaxllm.models import decoder, linear
from jaxllm.models.linear import PackedWeight
from jaxllm.weights.pages import on_huge_pages
from jaxllm.weights.prepare import int8_dot_checkpoint, load_with_plan, prepare_weights
from jaxllm.platforms import Platform
from jaxllm.quantization import SMALL_STEP_ROWS, QuantizedWeight
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.quantization.weights import LAYER_MATRICES
from jaxllm.sampling_params import SamplingParams
from jaxllm.utils import resolve_kv_cache_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import cpu_line, machine_info, now_iso, timeit, versions  # noqa: E402

del sys.path[0]


def best_time(fn, repeat: int) -> float:
    """The fastest of `repeat` calls of `fn` (after one untimed call): a peak is what the machine
    reaches, and on a shared host a median drifts with the neighbours' load."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak(dtype, packed: bool) -> float:
    """FLOP/s of a [512, 576] x [576, 1536] product in `dtype`: through the engine's packed
    C++ GEMM when it packs its weights (`packed`), else XLA's dot."""
    if packed:
        from jaxllm.kernels import gemm

        a = jnp.ones((512, 576), jnp.float32)
        b = jnp.asarray(gemm.pack_weight(np.ones((576, 1536), np.float32), dtype=dtype))
        f = jax.jit(gemm.matmul_packed)
    else:
        a = jnp.ones((512, 576), dtype)
        b = jnp.ones((576, 1536), dtype)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * 512 * 576 * 1536 / best_time(lambda: f(a, b).block_until_ready(), 20)


def read_bandwidth() -> float:
    """Bytes a second a whole-array reduction reads from memory (256 MiB, far past the caches),
    on 2 MiB pages where Linux allows, as the engine's weights are (`on_huge_pages`)."""
    x = jnp.ones((64 << 20,), jnp.float32)
    on_huge_pages(x, wait=True)
    f = jax.jit(lambda x: x.max())
    return x.nbytes / best_time(lambda: f(x).block_until_ready(), 10)


def memory_bandwidth() -> float:
    x = jnp.ones((64 << 20,), jnp.float32)  # 256 MiB, updated in place
    f = jax.jit(lambda x: x * 1.0001 + 1, donate_argnums=0)
    state = {"x": x}

    def run():
        state["x"] = f(state["x"])
        state["x"].block_until_ready()

    return 2 * x.nbytes / best_time(run, 10)


def make_requests(kv: KVCacheManager, batch: int, context: int, num_new: int, rng) -> list[tuple[Request, int]]:
    out = []
    for i in range(batch):
        req = Request(
            f"r{i}",
            rng.integers(100, 40000, context).tolist(),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        )
        assert kv.allocate_slots(req, context), "KV pool too small for this batch"
        req.num_computed_tokens = context - num_new
        out.append((req, num_new))
    return out


def compare_scan(runner, cfg, params, kv: KVCacheManager, batch: int, context: int, rng) -> dict:
    """Unrolled (the runner's forward) vs lax.scan over stacked layers, same batch."""
    scheduled = make_requests(kv, batch, context, 1, rng)
    *_, buffers = runner.builder.prepare(scheduled)
    dev_batch = jax.device_put(buffers.inputs)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params["layers"])
    k_all = jnp.stack([k for k, _ in runner.kv_cache])
    v_all = jnp.stack([v for _, v in runner.kv_cache])

    def scan_forward(params, stacked, k_all, v_all, b):
        x = decoder.embed(params, b.token_ids, b.positions, cfg)

        def body(x, layer_and_cache):
            layer, k_pages, v_pages = layer_and_cache
            x, k_pages, v_pages = decoder.decoder_layer(
                layer, k_pages, v_pages, x, b, cfg, index=0, attention=runner.attention, cpp_ops=runner.cpp_ops
            )
            return x, (k_pages, v_pages)

        x, (k_all, v_all) = jax.lax.scan(body, x, (stacked, k_all, v_all))
        return x, k_all, v_all

    def unrolled_forward(params, kv_cache, b):
        return decoder.forward(params, kv_cache, b, cfg, attention=runner.attention, cpp_ops=runner.cpp_ops)

    out = {}
    for name, fn, args, donate in (
        ("unrolled", unrolled_forward, (params, runner.kv_cache, dev_batch), (1,)),
        ("scan", scan_forward, (params, stacked, k_all, v_all, dev_batch), (2, 3)),
    ):
        t = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        compile_s = time.perf_counter() - t
        state = {"args": list(args)}

        def run():
            res = compiled(*state["args"])
            jax.block_until_ready(res)
            if name == "unrolled":
                state["args"][1] = res[1]
            else:
                state["args"][2], state["args"][3] = res[1], res[2]

        out[name] = dict(compile_s=compile_s, step_ms=timeit(run, 3) * 1e3)
        if name == "unrolled":
            runner.kv_cache = state["args"][1]
    print(
        f"batch {batch}: unrolled {out['unrolled']['step_ms']:.1f} ms (compile {out['unrolled']['compile_s']:.1f} s)"
        f" | scan {out['scan']['step_ms']:.1f} ms (compile {out['scan']['compile_s']:.1f} s)",
        flush=True,
    )
    return dict(batch=batch, context=context, **{f"{k}_{m}": v for k, d in out.items() for m, v in d.items()})


def breakdown(runner, cfg, scheduled) -> dict:
    """Seconds of the step's parts for `scheduled`, each timed alone at the step's shapes (the
    GEMMs on the weights the step takes: the small-step codes, where the engine keeps them)."""
    from jaxllm.runner import sampler

    *_, buffers = runner.builder.prepare(scheduled)
    params = runner.step_params(buffers.bucket)
    inputs = jax.device_put(buffers.inputs)
    T, S = inputs.token_ids.shape[0], buffers.bucket.num_seqs
    x = jnp.ones((T, cfg.hidden_size), jnp.float32)

    @jax.jit
    def gemms(params, x):
        for layer in params["layers"]:
            qkv = linear.apply(layer["wqkv"], x)
            x = x + linear.apply(layer["wo"], qkv[:, : cfg.q_size])
            x = x + linear.apply(layer["w_down"], linear.apply(layer["w_gate_up"], x, swiglu=True))
        return decoder.compute_logits(params, x[:S], cfg)

    @jax.jit
    def attention(kv_cache, q, inputs):
        return [runner.attention.forward(q, k, v, inputs) for k, v in kv_cache]

    q = jnp.ones((T, cfg.num_heads, cfg.head_dim), jnp.float32)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((S, cfg.vocab_size), np.float32))
    sampling = jax.device_put(buffers.sampling)
    sample = jax.jit(lambda logits, s: sampler.sample(logits, s, *sampler.sampling_ops(runner.cpp_ops)))
    return {
        "gemm": timeit(lambda: gemms(params, x).block_until_ready(), 5),
        "attention": timeit(lambda: jax.block_until_ready(attention(runner.kv_cache, q, inputs)), 5),
        "sampler": timeit(lambda: jax.block_until_ready(sample(logits, sampling)), 5),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="as EngineArgs.model (default: the default model)")
    ap.add_argument("--dtype", default="auto", help="auto (what the engine picks here), float32 or bfloat16")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="as EngineArgs.kv_cache_dtype (default: what the engine picks for the dtype here)",
    )
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--prefill", default="64,128,256,512")
    ap.add_argument("--out", default="benchmarks/results/step.json")
    ap.add_argument(
        "--no-packed-weights",
        action="store_true",
        help="leave the weights to XLA's dots (EngineArgs.packed_weights=False), for a before/after",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        help="as EngineArgs.quantization (default: what the engine picks here; 'none': dequantized)",
    )
    ap.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="as EngineArgs.int8_activations (default: what the engine picks for the dtype here)",
    )
    ap.add_argument("--compare-scan", default="", help="decode batch sizes to time with lax.scan too, e.g. 1,32")
    args = ap.parse_args()

    platform = Platform.detect()
    eargs = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        max_model_len=max(2048, args.context),  # (a decode at --context needs it in the model length)
        kv_cache_memory=3 << 30,
        warmup=False,
        packed_weights=not args.no_packed_weights,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
    )
    # The dtypes as the engine resolves them (a GGUF's codes may make "auto" float32 + int8).
    int8_codes = int8_dot_checkpoint(eargs, platform, one_device=True)
    why = platform.resolve_dtype(args.dtype, int8_codes)[1]
    eargs = resolve_dtypes(eargs, platform, False, int8_codes)
    kv_why = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype, eargs.dtype)[1]
    args.dtype = eargs.dtype
    machine = machine_info()
    print(f"{cpu_line(machine)}; dtype {eargs.dtype} ({why}); KV pages {eargs.kv_cache_dtype} ({kv_why})")
    loaded, plan = load_with_plan(eargs, platform, None, one_device=True, progress=False)
    cfg = loaded.cfg
    eargs = dataclasses.replace(
        eargs,
        quantization=plan.quantization,
        small_step_codes=plan.small_step_codes,
        int8_activations=plan.int8_activations,
    )
    config = resolve_config(eargs, cfg, loaded.name)
    params, small_params = prepare_weights(loaded.params, cfg, plan, tokenizer=loaded.resolve_tokenizer())
    runner = ModelRunner(config, cfg, params, small_params=small_params)
    jax.block_until_ready(runner.kv_cache)  # its zeroing thread would share the cores with the peaks' timing
    rng = np.random.default_rng(0)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    small_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(small_params))
    llama_dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    # The C++ GEMM's weights (float panels, or codes in panels): its float peak is the reference.
    packed = any(
        isinstance(w, PackedWeight) or (isinstance(w, QuantizedWeight) and w.layout == "panels")
        for w in runner.params["layers"][0].values()
    )
    peak = matmul_peak(llama_dtype, packed)
    bw, copy_bw = read_bandwidth(), memory_bandwidth()
    # The layers' matrices (packed ones are PackedWeights, quantized ones QuantizedWeights):
    # 2 FLOPs per weight per token.
    flops_per_token = 2 * sum(
        np.prod(x.shape) if isinstance(x, QuantizedWeight) else np.size(x.panels if isinstance(x, PackedWeight) else x)
        for layer in params["layers"]
        for name, x in layer.items()
        if name in LAYER_MATRICES
    )
    lm_head_flops = 2 * cfg.hidden_size * cfg.vocab_size
    rows = []

    def measure(kind, batch, num_new):
        kv = KVCacheManager(config.cache.num_pages, config.cache.page_size)
        scheduled = make_requests(kv, batch, args.context if kind == "decode" else num_new, num_new, rng)
        timings = []

        def step():
            timings.append(runner.execute(SchedulerOutput(scheduled)).timings)

        dt = timeit(step, 3)
        tokens = batch * num_new
        flops = tokens * flops_per_token + batch * lm_head_flops
        small = runner.small_params is not None and tokens <= SMALL_STEP_ROWS  # the codes the step reads
        step_bytes = small_bytes if small else weight_bytes
        roof = max(flops / peak, step_bytes / bw)
        rows.append(
            dict(
                kind=kind,
                batch=batch,
                tokens=tokens,
                context=args.context if kind == "decode" else num_new,
                step_ms=dt * 1e3,
                tokens_per_s=tokens / dt,
                roofline_ms=roof * 1e3,
                fraction_of_roofline=roof / dt,
            )
        )
        r = rows[-1]
        print(
            f"{kind:8s} batch {batch:4d} tokens {tokens:4d}: {r['step_ms']:8.1f} ms  {r['tokens_per_s']:8.1f} tok/s"
            f"  roofline {r['roofline_ms']:7.1f} ms ({100 * r['fraction_of_roofline']:.0f}%)",
            flush=True,
        )
        parts = breakdown(runner, cfg, scheduled)
        parts["host"] = float(np.median([t["prepare"] for t in timings]))
        parts["other"] = max(0.0, dt - sum(parts.values()))
        r.update({f"{k}_ms": v * 1e3 for k, v in parts.items()}, gemm_gflops=flops / parts["gemm"] / 1e9)
        line = f"; GEMMs {r['gemm_gflops']:.0f} GFLOP/s ({100 * r['gemm_gflops'] * 1e9 / peak:.0f}% of peak)"
        if kind == "decode":  # (a decode's attention reads its pages; a prompt's computes)
            kv_bytes = batch * args.context * kv_bytes_per_token(cfg, config.cache.dtype)
            r["attention_gbs"] = kv_bytes / parts["attention"] / 1e9
            share = 100 * r["attention_gbs"] * 1e9 / bw
            line += f", attention {r['attention_gbs']:.1f} GB/s ({share:.0f}% of bandwidth)"
        times = ", ".join(f"{k} {v * 1e3:.1f} ms ({100 * v / dt:.0f}%)" for k, v in parts.items())
        print(f"    {times}{line}", flush=True)

    path = "packed C++ GEMM" if packed else "XLA dot"
    print(
        f"matmul peak {peak / 1e9:.0f} GFLOP/s ({args.dtype}, {path}), memory reads {bw / 1e9:.1f} GB/s "
        f"(in-place update, read + write: {copy_bw / 1e9:.1f} GB/s), "
        f"weights {weight_bytes / 1e6:.0f} MB (quantization {plan.quantization or 'none'})"
    )
    for b in map(int, args.batches.split(",")):
        measure("decode", b, 1)
    for p in map(int, args.prefill.split(",")):
        measure("prefill", 1, p)
    scan_rows = []
    for b in filter(None, args.compare_scan.split(",")):
        kv = KVCacheManager(config.cache.num_pages // 4, config.cache.page_size)
        scan_rows.append(compare_scan(runner, cfg, runner.params, kv, int(b), args.context, rng))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            dict(
                date=now_iso(),
                machine=machine,
                versions=versions(),
                command=shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                dtype=args.dtype,
                kv_cache_dtype=config.cache.dtype,
                quantization=plan.quantization,  # (the run's method: a checkpoint's, or one applied on load)
                packed_weights=packed,
                matmul_peak_flops=peak,
                read_bandwidth=bw,
                memory_bandwidth=copy_bw,
                weight_bytes=weight_bytes,
                rows=rows,
                scan_vs_unrolled=scan_rows,
            ),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
