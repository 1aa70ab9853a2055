"""GPU benchmark: the paged attention kernels' time, bandwidth and MBU, then the whole engine.

    python benchmarks/gpu.py                           # on a GPU: both kernels, then the engine
    python benchmarks/gpu.py --contexts 1024,32768 --skip-engine
    python benchmarks/gpu.py --smoke                   # tiny shapes, anywhere (on CPU in interpret mode)

Kernels (Llama-3-8B's attention: 32 query / 8 KV heads of 128, bf16 pages of 16 tokens): the
Mosaic GPU kernel and the Triton kernel on decode-only batches at each context (as many
sequences as `--kv-gib` of KV holds, at most `--batch`) and on a mixed batch (decodes and
prefill chunks). Each reports the median time of `--repeat` calls after 0.3 s of warm-up calls
(`gpu_quant.median_seconds`), the bytes it must move (the K/V rows of the sequences' tokens, the
page tables, q, and the output it writes), those bytes over the time, and MBU: that rate over
this device's copy bandwidth, measured first (a device-to-device copy, bytes read plus written).

Quantized matmul: the Triton kernel that reads int8 / int4 codes as they are (the GPU path of
weight-only quantization) against a bf16 `jnp.dot` of the dequantized weight, on Llama-3-8B's
matrices at `--quant-rows` rows (`gpu_quant.py`, which also searches tilings).

Engine: random weights of a Llama-3-8B shape (`--layers` of them, bf16; written once as a
checkpoint under `--workdir`) through `LLM.generate` on the standard workload (128 requests,
prompts 32-256, outputs 32-128, greedy, ignore_eos), a run for each `--quantization` entry,
`METHOD[:KV_CACHE_DTYPE]` as `LLM` takes them (`none`: bf16 weights; `none:int8`: int8 KV pages):
output tok/s and device time per step.

It needs only what the GPU image has (jax, numpy, safetensors) besides jaxllm itself. JSON to
--out (default benchmarks/results/gpu.json) and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
import gpu_quant  # noqa: E402
from gpu_quant import median_seconds  # noqa: E402
from workload import RESULTS, now_iso, random_workload, versions, write_result  # noqa: E402

del sys.path[0]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

LLAMA3_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)
SMOKE = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512)


def copy_bandwidth(nbytes: int, repeat: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    x = jnp.zeros(nbytes // 2, jnp.bfloat16)
    return 2 * nbytes / median_seconds(jax.jit(lambda a: a + 1), x, repeat=repeat)


def attention_case(q_lens, kv_lens, shape, page_size: int, seed: int):
    """Kernel inputs for sequences of `q_lens` new tokens over `kv_lens` cached ones (random
    pages, each sequence's pages in shuffled order); and the bytes the call must move."""
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    pages = [-(-n // page_size) for n in kv_lens]
    num_pages, width = sum(pages) + 1, max(pages)
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    tables = np.zeros((len(kv_lens), width), np.int32)
    start = 0
    for s, n in enumerate(pages):
        tables[s, :n] = order[start : start + n]
        start += n
    key = jax.random.key(seed)
    k = jax.random.normal(key, (hkv, num_pages, page_size, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, jnp.bfloat16)
    num_tokens = sum(q_lens)
    q = jax.random.normal(jax.random.fold_in(key, 2), (num_tokens, hq, d), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (
        q,
        jax.lax.bitcast_convert_type(k, jnp.uint16),
        jax.lax.bitcast_convert_type(v, jnp.uint16),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(cu),
        jnp.int32(len(kv_lens)),
    )
    moved = 2 * hkv * sum(kv_lens) * d * 2 + tables.nbytes + 2 * num_tokens * hq * d * 2
    return args, moved


def kernels_under_test(interpret: bool) -> dict:
    from jaxllm.kernels.paged_attention import ragged_paged_attention
    from jaxllm.kernels.paged_attention_mgpu import ragged_paged_attention_mgpu

    return {
        "mosaic": jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, interpret=interpret)),
        "triton": jax.jit(lambda *a: ragged_paged_attention(*a, interpret=interpret)),
    }


def kernel_rows(args, shape, bandwidth: float) -> list[dict]:
    from jaxllm.kernels.reference import ragged_paged_attention_reference

    cases = []
    for ctx in args.contexts:
        per_seq = 2 * shape["kv_heads"] * shape["head_dim"] * 2 * ctx
        n = max(1, min(args.batch, int(args.kv_gib * 2**30) // per_seq))
        cases.append((f"decode ctx {ctx} x {n}", [1] * n, [ctx] * n))
    n = max(1, args.batch // 2)
    chunk = min(512, args.contexts[0])
    cases.append(
        (
            f"mixed: {n} decodes ctx {args.contexts[0]} + 4 chunks of {chunk}",
            [1] * n + [chunk] * 4,
            [args.contexts[0]] * n + [chunk * (i + 1) for i in range(4)],
        )
    )
    rows = []
    kernels = kernels_under_test(args.interpret)
    for i, (name, q_lens, kv_lens) in enumerate(cases):
        inputs, moved = attention_case(q_lens, kv_lens, shape, args.page_size, seed=i)
        ref = np.asarray(ragged_paged_attention_reference(*inputs), np.float32) if i == 0 else None
        for kernel, fn in kernels.items():
            row = {"case": name, "kernel": kernel, "num_seqs": len(q_lens), "tokens": sum(q_lens), "bytes": moved}
            try:
                if ref is not None:  # the first case also checks the numbers
                    row["max_abs_err"] = float(np.abs(np.asarray(fn(*inputs), np.float32) - ref).max())
                seconds = median_seconds(fn, *inputs, repeat=args.repeat)
            except Exception as e:  # one kernel failing must not hide the other's figures
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            else:
                row.update(ms=seconds * 1e3, gb_s=moved / seconds / 1e9, mbu=moved / seconds / bandwidth)
            rows.append(row)
            print(format_row(row), flush=True)
        del inputs
    return rows


def format_row(row: dict) -> str:
    if "error" in row:
        return f"| {row['case']} | {row['kernel']} | failed: {row['error'][:120]} | | | |"
    return (
        f"| {row['case']} | {row['kernel']} | {row['ms']:.3f} | {row['bytes'] / 2**20:.1f} | "
        f"{row['gb_s']:.0f} | {100 * row['mbu']:.0f}% |"
    )


def write_checkpoint(path: str, shape: dict, seed: int = 0) -> str:
    """A Llama checkpoint of `shape` with random float16 weights (0.02 x N(0, 1); tensors are
    windows of one random buffer, enough for a timing run), unless `path` already holds one."""
    from safetensors.numpy import save_file

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    h, f, d = shape["hidden"], shape["intermediate"], shape["head_dim"]
    pool = (0.02 * np.random.default_rng(seed).standard_normal(1 << 24)).astype(np.float16)

    def tensor(*dims):
        n = int(np.prod(dims))
        reps = -(-n // pool.size)
        return np.tile(pool, reps)[:n].reshape(dims) if reps > 1 else pool[:n].reshape(dims).copy()

    tensors = {
        "model.embed_tokens.weight": tensor(shape["vocab"], h),
        "model.norm.weight": np.ones(h, np.float16),
        "lm_head.weight": tensor(shape["vocab"], h),
    }
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": tensor(shape["heads"] * d, h),
                p + "self_attn.k_proj.weight": tensor(shape["kv_heads"] * d, h),
                p + "self_attn.v_proj.weight": tensor(shape["kv_heads"] * d, h),
                p + "self_attn.o_proj.weight": tensor(h, shape["heads"] * d),
                p + "mlp.gate_proj.weight": tensor(f, h),
                p + "mlp.up_proj.weight": tensor(f, h),
                p + "mlp.down_proj.weight": tensor(h, f),
                p + "input_layernorm.weight": np.ones(h, np.float16),
                p + "post_attention_layernorm.weight": np.ones(h, np.float16),
            }
        )
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": d,
        "vocab_size": shape["vocab"],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return path


def engine_row(args, shape: dict, config: str) -> dict:
    """One `--quantization` entry's engine run."""
    from jaxllm import LLM, SamplingParams

    method, _, kv = config.partition(":")
    quantization = None if method == "none" else method
    path = write_checkpoint(os.path.join(args.workdir, f"llama3-8b-shape-{shape['layers']}l"), shape)
    workload = random_workload(args.num_prompts, (32, 256), (32, 128), 0, shape["vocab"], [])
    t = time.perf_counter()
    llm = LLM(
        path,
        dtype="bfloat16",
        attention_backend=args.engine_backend,
        max_num_seqs=args.max_num_seqs,
        quantization=quantization,
        kv_cache_dtype=kv or "auto",
        params_cache_dir=os.path.join(args.workdir, "params"),
        warmup=not args.smoke,
    )
    llm.engine.wait_compiled()
    start_s = time.perf_counter() - t
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=w["max_tokens"]) for w in workload]
    t = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w["prompt_token_ids"]} for w in workload], params, use_tqdm=False)
    wall = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats
    row = {
        "layers": shape["layers"],
        "quantization": quantization,
        "kv_cache_dtype": str(llm.engine.config.cache.dtype),
        "attention_backend": llm.engine.runner.attention.name,
        "requests": len(workload),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "out_tok_s": out_tokens / wall,
        "steps": stats.num_steps,
        "device_ms_per_step": 1e3 * stats.time_device / max(stats.num_steps, 1),
        "start_s": start_s,
    }
    del llm, outputs
    gc.collect()  # the next engine's KV pool takes the device memory this one held
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--contexts", default="512,1024,2048,4096,8192,16384,32768", type=lambda s: [int(x) for x in s.split(",")]
    )
    ap.add_argument("--batch", type=int, default=64, help="most decode sequences per case")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="most KV bytes per case")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--skip-kernels", action="store_true", help="leave out the attention kernels' rows")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-quant", action="store_true", help="leave out the quantized matmul's rows")
    ap.add_argument("--quant-rows", default="1,16,128,1024", help="row counts of x for the quantized matmul")
    ap.add_argument(
        "--quantization",
        default="none",
        type=lambda s: s.split(","),
        help="the engine's runs, each METHOD[:KV_CACHE_DTYPE] (none: bf16 weights; e.g. none,int4,none:int8)",
    )
    ap.add_argument("--layers", type=int, default=LLAMA3_8B["layers"], help="decoder layers of the engine's model")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--engine-backend", default=None, help="attention backend for the engine (default: the platform's)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxllm-gpu-bench"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, 1 repeat, no warm-up; on CPU the kernels are interpreted (a test runs this)",
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "gpu.json"))
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    args.interpret = device.platform != "gpu"
    shape = dict(LLAMA3_8B, layers=args.layers)
    if args.smoke:
        gpu_quant.WARM_S = 0.0
        shape = SMOKE
        args.contexts, args.batch, args.repeat, args.num_prompts = [40], 3, 1, 4
    elif args.interpret:
        raise SystemExit("no GPU here: run with --smoke (tiny shapes in interpret mode), or on a GPU")
    label = f"{device.device_kind} (compute capability {getattr(device, 'compute_capability', '-')})"
    bandwidth = copy_bandwidth(64 << 20 if args.smoke else 4 << 30, args.repeat)
    print(f"# {label}; jax {jax.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    if not args.skip_kernels:
        print("| case | kernel | ms | MiB moved | GB/s | MBU |\n|---|---|---:|---:|---:|---:|")
    result = {
        "date": now_iso(),
        "device": label,
        "versions": versions(),
        "copy_gb_s": bandwidth / 1e9,
        "attention_shape": {k: shape[k] for k in ("heads", "kv_heads", "head_dim")},
        "page_size": args.page_size,
        "kernels": [] if args.skip_kernels else kernel_rows(args, shape, bandwidth),
    }
    if not args.skip_quant:
        print("\n" + gpu_quant.HEADER)
        quant_args = ["--smoke"] if args.smoke else ["--rows", args.quant_rows, "--repeat", str(args.repeat)]
        result["quantized_matmul"] = gpu_quant.run(gpu_quant.parse_args(quant_args))
    if not args.skip_engine:
        result["engines"] = []
        for config in args.quantization:
            e = engine_row(args, shape, config)
            result["engines"].append(e)
            print(
                f"engine ({e['layers']} layers, {e['attention_backend']}, quantization {e['quantization']}, "
                f"KV {e['kv_cache_dtype']}): "
                f"{e['out_tok_s']:.1f} out tok/s, {e['device_ms_per_step']:.2f} ms device per step, "
                f"{e['steps']} steps, start {e['start_s']:.1f} s",
                flush=True,
            )
        result["engine"] = result["engines"][0]
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
