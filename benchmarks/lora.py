"""Multi-LoRA on the default model: what serving adapters costs in throughput, and what loading
a new adapter costs the requests already running, in one run.

    python benchmarks/lora.py
    python benchmarks/lora.py --repeat 5 --adapters 4 --rank 16
    python benchmarks/lora.py --quick            # a smoke test: tiny workload, well under a minute

Adapters: `--adapters` random PEFT adapters of rank `--rank` (every attention and MLP projection
of every layer, lora_alpha = 2 r, values ~ N(0, 0.01)) written with safetensors into a temporary
folder; no torch or peft is needed.

1. Throughput: the standard workload (benchmarks/workload.py, as throughput.py runs it: every
   request greedy with `ignore_eos`, all submitted at once through `LLM.generate`) on
     base         an engine started without enable_lora
     lora         an engine with enable_lora, max_loras = --adapters, the requests spread
                  round-robin over the adapters
     lora-engine-base  the same LoRA engine, every request on the base model (the cost of the
                  slots alone)
   Each engine is built once, compiled (`wait_compiled`) and warmed up; the configurations then
   alternate `--repeat` times, medians reported, with each one's output tokens/s over base's.
   Prefix caching is off in every engine, so the repeats recompute the same prompts alike.
2. Loading an adapter while serving (on the LoRA engine): `--load-batch` requests decode steadily
   under adapter 1; one request (`--load-prompt-tokens` prompt tokens, 1 output token) arrives under
   an adapter that
     control    is already in a slot (the steps only prefill it)
     cold       was never read: `add_request` reads it (safetensors -> the engine's fused layout)
                and the step that admits it writes a device slot
     preloaded  was read beforehand by `add_lora` (timed, before the window): the step only
                writes the slot
   Per case, a fresh adapter each round (one untimed round first; medians over --repeat): the
   median step time over `--window` steps before and after, `add_request`'s own time, the steps
   from the arrival until the new request's token is out (async scheduling: a step is in flight
   while `add_request` runs) and the step that wrote a slot (`runner.lora.num_loads`), the new
   request's time to first token, and the running requests' stall: that whole arrival (from the
   call of add_request) less as many steady steps. A case's stall beyond the control's is the
   cost of the adapter itself (`load_cost_s`). The adapter files were just written, so the "disk
   read" comes from the page cache. Sizes: the adapter's file, its fused host copy (`nbytes`) and
   one device slot.

JSON to --out (default benchmarks/results/lora.json).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, add_workload_args, make_workload, write_run  # noqa: E402

del sys.path[0]

CONFIGS = ("base", "lora", "lora-engine-base")


# ----------------------------------------------------------------------------- adapters


def adapter_shapes(cfg) -> dict[str, tuple[int, int]]:
    """HF module name (e.g. model.layers.0.self_attn.q_proj) -> (out, in) of every Linear an
    adapter can adapt in a model of `cfg`, from the engine's own fusing of the base weights."""
    from jaxllm.models.checkpoint import linear_sources

    shapes: dict[str, tuple[int, int]] = {}
    for layer in linear_sources(cfg):
        for source in layer.values():
            for k, module in enumerate(source.modules):
                rows = source.rows[source.module_of == k]
                out = max(int(rows.max()) + 1, shapes.get(module, (0, 0))[0])
                shapes[module] = (out, source.in_dim)
    return shapes


def write_adapter(path: str, shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> int:
    """A random PEFT LoRA adapter of `rank` over every module of `shapes` at `path`; its file's bytes."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (out, inp) in shapes.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, inp)) * 0.01).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float32)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in shapes}),
        "bias": "none",
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    file = os.path.join(path, "adapter_model.safetensors")
    save_file(tensors, file)
    return os.path.getsize(file)


# ----------------------------------------------------------------------------- 1. throughput


def throughput(llm, workload: list[dict], adapters: list | None) -> dict:
    """One pass of the workload through `llm.generate`, the requests round-robin over `adapters`
    (None: all on the base model)."""
    from jaxllm import SamplingParams

    prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in workload]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w["max_tokens"]) for w in workload]
    lora = [adapters[i % len(adapters)] for i in range(len(workload))] if adapters else None
    runner_lora = llm.engine.runner.lora
    loads = runner_lora.num_loads if runner_lora is not None else 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if tokens != sum(w["max_tokens"] for w in workload):
        raise SystemExit(f"wrong number of output tokens: {tokens}")
    return dict(
        wall_s=wall,
        output_tok_s=tokens / wall,
        slot_writes=(runner_lora.num_loads - loads) if runner_lora is not None else 0,
    )


# ----------------------------------------------------------------------------- 2. loading while serving


def load_while_serving(engine, args, steady_lora, new_loras: dict, vocab: int, rng) -> dict:
    """`--load-batch` requests decoding under `steady_lora`; one request arrives per case of
    `new_loras` (case -> LoRARequest), each between `--window` timed steps (see the module doc).

    With async scheduling a step is in flight while the host works (add_request included), so
    each case counts the whole arrival: from the call of `add_request` to the end of the step
    that gave the new request's token, against as many steady steps (`stall_s`)."""
    from jaxllm import SamplingParams

    window = args.window
    steady_tokens = args.settle + len(new_loras) * (2 * window + 4) + 8
    steady = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steady_tokens, detokenize=False)
    one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, detokenize=False)
    tag = f"{rng.integers(1 << 30)}"
    steady_ids = [f"steady-{tag}-{i}" for i in range(args.load_batch)]
    for request_id in steady_ids:
        ids = rng.integers(100, vocab - 100, args.load_prompt_tokens).tolist()
        engine.add_request(request_id, prompt_token_ids=ids, params=steady, lora_request=steady_lora)
    slots = engine.runner.lora

    def step() -> tuple[float, int, list]:
        """One step: its seconds, the slot writes in it, its outputs."""
        before = slots.num_loads
        start = time.perf_counter()
        outputs = engine.step()
        return time.perf_counter() - start, slots.num_loads - before, outputs

    for _ in range(args.settle):  # every steady request prefilled and decoding
        step()
    cases = {}
    for case, lora in new_loras.items():
        add_lora_s = None
        if case == "preloaded":  # read now; the step in flight finishes meanwhile, before the window
            start = time.perf_counter()
            engine.add_lora(lora)
            add_lora_s = time.perf_counter() - start
        before = [step()[0] for _ in range(window)]
        ids = rng.integers(100, vocab - 100, args.load_prompt_tokens).tolist()
        request_id = f"new-{tag}-{case}"
        arrival = time.perf_counter()
        engine.add_request(request_id, prompt_token_ids=ids, params=one, lora_request=lora)
        add_request_s = time.perf_counter() - arrival
        arrival_steps, writes, ttft = [], [], None
        while ttft is None:  # the steps until the new request's token is out
            seconds, loads, outputs = step()
            arrival_steps.append(seconds)
            writes.append(loads)
            if any(o.request_id == request_id and o.outputs[0].token_ids for o in outputs):
                ttft = time.perf_counter() - arrival
            if len(arrival_steps) > 64:
                raise SystemExit(f"{case}: the new request got no token in 64 steps")
        after = []
        for _ in range(window):
            seconds, loads, _ = step()
            after.append(seconds)
            writes.append(loads)
        steady_step = float(np.median(before))
        cases[case] = dict(
            before_median_s=steady_step,
            add_request_s=add_request_s,
            add_lora_s=add_lora_s,
            arrival_steps_s=arrival_steps,
            load_steps_s=[t for t, n in zip(arrival_steps + after, writes) if n],
            slot_writes=sum(writes),
            ttft_s=ttft,
            stall_s=ttft - len(arrival_steps) * steady_step,
            after_median_s=float(np.median(after)),
        )
    if not all(r in engine.output_processor.requests for r in steady_ids):
        print("warning: a steady request finished early; raise its max_tokens", file=sys.stderr)
    engine.abort_request(steady_ids)
    while engine.has_unfinished_requests():
        engine.step()
    return cases


# ----------------------------------------------------------------------------- main


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--adapters", type=int, default=4, help="adapters (and max_loras) of the LoRA engine")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' rank (and max_lora_rank)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3, help="passes of each configuration (and load cases)")
    ap.add_argument("--no-lora-engine-base", action="store_true", help="skip the LoRA engine's base-only runs")
    g = ap.add_argument_group("loading while serving")
    g.add_argument("--load-batch", type=int, default=16, help="requests decoding while the adapter loads")
    g.add_argument("--load-prompt-tokens", type=int, default=64, help="prompt tokens of each request there")
    g.add_argument("--window", type=int, default=16, help="steps timed before and after each arrival")
    g.add_argument("--settle", type=int, default=8, help="steps before the first window")
    ap.add_argument("--quick", action="store_true", help="a smoke test: everything tiny (overrides the sizes)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "lora.json"))
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.input_len_range, args.output_len_range = 8, (16, 32), (4, 8)
        args.max_num_seqs, args.max_num_batched_tokens, args.repeat = 8, 64, 1
        args.load_batch, args.load_prompt_tokens, args.window, args.settle = 4, 16, 3, 3
    from jaxllm import LLM, LoRARequest

    workload, desc = make_workload(args)
    common = dict(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    if args.quick:
        common["kv_cache_memory"] = 256 << 20
    llms = {"base": LLM(args.model, **common)}
    llms["lora"] = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    for llm in llms.values():
        llm.engine.wait_compiled()
    engine = llms["lora"].engine
    shapes = adapter_shapes(engine.cfg)
    root = tempfile.mkdtemp(prefix="jaxllm-lora-bench-")  # the adapters' files, removed at exit
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    file_bytes = {}

    def new_adapter(name: str, lora_int_id: int) -> LoRARequest:
        path = os.path.join(root, name)
        file_bytes[name] = write_adapter(path, shapes, args.rank, seed=lora_int_id)
        return LoRARequest(name, lora_int_id, path)

    adapters = [new_adapter(f"adapter-{i + 1}", i + 1) for i in range(args.adapters)]
    warm = workload[: min(len(workload), 2 * args.adapters)]
    for name, llm in llms.items():  # warm-up: a short pass (the LoRA engine reads and loads every adapter)
        short = [dict(w, max_tokens=min(w["max_tokens"], 4)) for w in warm]
        throughput(llm, short, adapters if name == "lora" else None)

    # 1. throughput, the configurations alternating
    configs = [c for c in CONFIGS if not (c == "lora-engine-base" and args.no_lora_engine_base)]
    runs = {c: [] for c in configs}
    for r in range(args.repeat):
        for config in configs:
            llm = llms["base" if config == "base" else "lora"]
            runs[config].append(throughput(llm, workload, adapters if config == "lora" else None))
            run = runs[config][-1]
            print(
                f"[{r + 1}/{args.repeat}] {config:17s} {run['output_tok_s']:8.1f} output tok/s ({run['wall_s']:.2f} s, "
                f"{run['slot_writes']} slot writes)"
            )
    results = {c: {k: median(run[k] for run in rs) for k in rs[0]} for c, rs in runs.items()}
    for config in configs:
        results[config]["vs_base"] = results[config]["output_tok_s"] / results["base"]["output_tok_s"]

    # 2. loading an adapter while serving, a fresh adapter per case and round (the first round untimed)
    rng = np.random.default_rng(args.seed)
    vocab = engine.cfg.vocab_size
    load_runs = []
    for r in range(-1, args.repeat):
        new = {
            "control": adapters[0],
            "cold": new_adapter(f"cold-{r}", 1000 + 2 * r),
            "preloaded": new_adapter(f"preloaded-{r}", 1001 + 2 * r),
        }
        cases = load_while_serving(engine, args, adapters[0], new, vocab, rng)
        if r < 0:
            continue
        load_runs.append(cases)
        for case, c in cases.items():
            print(
                f"[{r + 1}/{args.repeat}] {case:9s} step {c['before_median_s'] * 1e3:6.1f} ms before, "
                f"{c['after_median_s'] * 1e3:6.1f} ms after; arrival: add_request {c['add_request_s'] * 1e3:6.1f} ms + "
                f"steps {' '.join(f'{t * 1e3:.1f}' for t in c['arrival_steps_s'])} ms, "
                f"stall {c['stall_s'] * 1e3:6.1f} ms, {c['slot_writes']} slot writes"
            )
    load = {}
    keys = ("before_median_s", "add_request_s", "add_lora_s", "ttft_s", "stall_s", "after_median_s")
    for case in load_runs[0]:
        rs = [run[case] for run in load_runs]
        load[case] = {k: median(run[k] for run in rs) for k in keys}
        load[case]["load_step_s"] = median(t for run in rs for t in run["load_steps_s"])
        load[case]["slot_writes"] = [run["slot_writes"] for run in rs]
        # what the adapter itself cost the running requests: the stall beyond the control's (its prefill)
        load[case]["load_cost_s"] = median(run[case]["stall_s"] - run["control"]["stall_s"] for run in load_runs)
    cached = engine.adapters.get(adapters[0])
    slot_bytes = sum(a.nbytes + sum(p.nbytes for p in b) for a, b in engine.runner.lora.stacks.values())
    sizes = dict(
        adapter_file_bytes=file_bytes["adapter-1"],
        adapter_host_bytes=cached.nbytes,  # fused float32 layout, zero-padded blocks
        slot_bytes=slot_bytes // args.adapters,
        all_slots_bytes=slot_bytes,
    )

    # summary
    base = results["base"]["output_tok_s"]
    print(
        f"\nthroughput, {desc['num_requests']} requests, {desc['output_tokens']} output tokens "
        f"(medians of {args.repeat}):"
    )
    for config in configs:
        tok_s, vs = results[config]["output_tok_s"], results[config]["vs_base"]
        print(f"  {config:17s} {tok_s:8.1f} output tok/s  {vs:.3f}x base")
    print(f"  lora / base = {results['lora']['output_tok_s'] / base:.3f} (goal >= 0.8)")
    print(
        f"\nloading while serving ({args.load_batch} requests decoding under adapter 1, max_loras={args.adapters}; "
        f"adapter {sizes['adapter_file_bytes'] / 2**20:.1f} MiB on disk, {sizes['adapter_host_bytes'] / 2**20:.1f} MiB "
        f"read, slot {sizes['slot_bytes'] / 2**20:.1f} MiB):"
    )
    for case, c in load.items():
        load_step = "" if c["load_step_s"] is None else f", slot-writing step {c['load_step_s'] * 1e3:.1f} ms"
        add_lora = "" if c["add_lora_s"] is None else f" (add_lora beforehand {c['add_lora_s'] * 1e3:.1f} ms)"
        print(
            f"  {case:9s} step {c['before_median_s'] * 1e3:5.1f} ms before, {c['after_median_s'] * 1e3:5.1f} ms after; "
            f"add_request {c['add_request_s'] * 1e3:5.1f} ms{add_lora}{load_step}; new request's TTFT "
            f"{c['ttft_s'] * 1e3:6.1f} ms; running requests stalled {c['stall_s'] * 1e3:6.1f} ms"
        )
    print(
        "  the load itself (stall beyond the control's): "
        + ", ".join(f"{case} {load[case]['load_cost_s'] * 1e3:.1f} ms" for case in load if case != "control")
    )
    out = dict(
        throughput=results,
        lora_over_base=results["lora"]["output_tok_s"] / base,
        throughput_runs=runs,
        load=load,
        load_runs=load_runs,
        sizes=sizes,
        workload=desc,
        args={k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
    )
    write_run(args.out, out)


if __name__ == "__main__":
    main()
