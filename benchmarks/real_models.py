"""The race on a real model: jaxllm against llama.cpp on the same GGUF, in one run on one machine.

    python benchmarks/real_models.py --model qwen2.5-coder-1.5b      # or `make bench-real`

Measured, each engine alone (llama.cpp's OpenMP threads spin: nothing else may run):

- one stream, a 128-token prompt and 256 tokens out (greedy, `ignore_eos`): output tok/s over the
  decode (TPOT), against llama.cpp's `llama-bench` tg256 at `-t 2`. Beside it, what a decode
  step must read (the bytes of every weight it streams: each layer's matrices and the LM head;
  the embedding table's one row is left out) over the machine's read bandwidth, measured in the
  same run (XLA's max over 1 GiB), so the headroom is visible;
- time to first token of a 1,024-token prompt (a new one each time: the prefix cache must not
  serve it) against `llama-bench` pp1024;
- 4 streams at once (prompts of 128, 256 tokens out each): output tok/s of the decode against
  `llama-batched-bench` at -npl 4 (its S_TG t/s);
- then `--rounds` more one-stream pairs, llama-bench's tg256 and jaxllm's right after it: a
  host's memory bandwidth moves by a third within minutes, so the ratio of each pair (and their
  median) says more than the ratio of two figures measured ten minutes apart.

jaxllm runs with its defaults for the machine (`--engine-args` JSON adds options), from a warm
start: a subprocess starts it once first (its params cache and compiled steps stored, as after a
user's first start), and its peak RSS is the measured start's (VmHWM, reset before it). Prompts
are random token ids of the model's vocabulary (seed 0), as both tools use.

`--perplexity` measures accuracy instead: jaxllm's perplexity on the text `jaxllm bench
perplexity` ships against transformers reading the same GGUF dequantized (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.models import catalog
from jaxllm.quantization import weight_bytes
from jaxllm.weights.pages import on_huge_pages

# benchmarks/ must not stay on sys.path (its kernels.py would shadow HF's `kernels` package).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from llama_tools import ensure_tools  # noqa: E402
from workload import cpu_line, machine_info, now_iso, versions, write_result  # noqa: E402

del sys.path[0]


def read_bandwidth() -> float:
    """Bytes a second a whole-array reduction reads (1 GiB: past the caches, a host's shared L3
    of hundreds of MiB included), on 2 MiB pages where Linux allows, as the engine's weights are
    (`on_huge_pages`); the best of 10."""
    x = jnp.ones((256 << 20,), jnp.float32)
    on_huge_pages(x, wait=True)
    f = jax.jit(lambda x: x.max())
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def decode_bytes(llm: LLM) -> int:
    """Bytes of the weights one decode step streams: every leaf of the tree a one-row step runs
    on (the small-step codes where the engine keeps them) but an untied embedding table (a step
    reads one row of it)."""
    runner = llm.engine.runner
    params = dict(runner.small_params if runner.small_params is not None else runner.params)
    if "lm_head" in params:
        params.pop("embed", None)
    return weight_bytes(params)


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, vocab - 1000, length).tolist()} for _ in range(n)]


def prime(model: str, engine_args: dict) -> float:
    """Start the engine once in a subprocess, so that the params cache and the compiled steps are
    stored and the measured start is a warm one (as every start after a user's first): seconds."""
    code = f"from jaxllm import LLM; LLM({model!r}, **{engine_args!r}).engine.wait_compiled()"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def peak_rss() -> int:
    """This process's peak resident set in bytes since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets VmHWM
        f.write("5")


def run_jaxllm(model: str, engine_args: dict, repeat: int, peer_one_stream=None, rounds: int = 0) -> dict:
    """jaxllm's measures (each the best of `repeat` after an untimed run); then, given
    `peer_one_stream` (a call giving llama.cpp's one-stream tok/s), `rounds` more of the one
    stream, each right after one of the peer's (`one_stream_pairs`, each pair within a minute),
    since a host's memory bandwidth moves by a third within minutes."""
    first_start_s = prime(model, engine_args)
    reset_peak_rss()  # (not the bandwidth measurement's GiB)
    start = time.perf_counter()
    llm = LLM(model, **engine_args)
    load_s = time.perf_counter() - start
    # (Not `wait_compiled`, which loads every step shape: a warm engine loads each when first
    # needed, and `best`'s untimed first run loads what a measure uses.)
    vocab = llm.engine.cfg.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)

    def best(fn):
        fn()  # compiles what the warm-up left, fills caches
        return min(_timed(fn) for _ in range(repeat))

    def decode_tok_s(batch: list[dict]) -> float:
        """Output tok/s of `batch`'s decode alone: 257 tokens out less 1 (their prompts served
        from the prefix cache both times), as llama.cpp's tg and S_TG count."""
        first = best(lambda: llm.generate(batch, SamplingParams(max_tokens=1, **greedy), use_tqdm=False))
        whole = best(lambda: llm.generate(batch, SamplingParams(max_tokens=257, **greedy), use_tqdm=False))
        return len(batch) * 256 / (whole - first)

    one_stream = decode_tok_s(prompts(vocab, 1, 128))
    # A new prompt each time: a repeated one would be served from the prefix cache.
    fresh = iter(range(100, 200))
    ttft_1024 = best(
        lambda: llm.generate(prompts(vocab, 1, 1024, seed=next(fresh)), SamplingParams(max_tokens=1), use_tqdm=False)
    )
    four_streams = decode_tok_s(prompts(vocab, 4, 128, seed=2))
    pairs = []
    for _ in range(rounds if peer_one_stream else 0):
        peer = peer_one_stream()
        pairs.append({"jaxllm": decode_tok_s(prompts(vocab, 1, 128)), "llama_cpp": peer})
        print(json.dumps(pairs[-1]), flush=True)
    return {
        "one_stream_pairs": pairs,
        "peak_rss_bytes": peak_rss(),
        "kv_pool_bytes": weight_bytes(llm.engine.runner.kv.pages),
        "first_start_s": first_start_s,
        "load_s": load_s,
        "dtype": llm.engine.config.dtype,
        "quantization": llm.engine.config.quantization,
        "decode_bytes": decode_bytes(llm),
        "one_stream_tok_s": one_stream,
        "ttft_1024_s": ttft_1024,
        "prompt_1024_tok_s": 1024 / ttft_1024,
        "four_streams_tok_s": four_streams,
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def with_repack_fallback(run, no_repack: bool) -> dict:
    """run(no_repack), a llama.cpp measurement. llama.cpp's weight repacking crashes on some
    virtual machines (SIGSEGV in `ggml_backend_amx_mul_mat`): a run that dies of a signal with it
    is run again without, and says so."""
    try:
        return run(no_repack)
    except subprocess.CalledProcessError as e:
        # (under /usr/bin/time a signal is an exit status and a line on stderr)
        if no_repack or not (e.returncode < 0 or "terminated by signal" in (e.stderr or "")):
            raise
        print("llama.cpp died of a signal with weight repacking: again without it", flush=True)
        return {**run(True), "repack_crashed": True}


def llama_bench(
    bin_dir: str, path: str, threads: int, args: list[str], no_repack: bool, timeout: float | None = None
) -> tuple[list[dict], int]:
    """`llama-bench` with `args` under /usr/bin/time: (its JSON rows, its peak RSS in bytes).
    Past `timeout` seconds the run is killed (its whole process group) and TimeoutExpired raised."""
    command = ["/usr/bin/time", "-f", "maxrss_kib %M", os.path.join(bin_dir, "llama-bench"), "-m", path]
    command += ["-t", str(threads), *args, "-o", "json"] + (["--repack", "0"] if no_repack else [])
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as bench:
        try:
            stdout, stderr = bench.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(bench.pid, signal.SIGKILL)  # (llama-bench is /usr/bin/time's child)
            bench.communicate()
            raise
    if bench.returncode:
        raise subprocess.CalledProcessError(bench.returncode, command, stdout, stderr)
    return json.loads(stdout), 1024 * int(stderr.rsplit("maxrss_kib", 1)[1].split()[0])


def run_llama_cpp(bin_dir: str, path: str, threads: int, no_repack: bool) -> dict:
    """llama-bench (pp1024, tg256) and llama-batched-bench (4 streams); `no_repack`: without its
    weight repacking (`with_repack_fallback`)."""
    return with_repack_fallback(lambda nr: _run_llama_cpp(bin_dir, path, threads, nr), no_repack)


def _run_llama_cpp(bin_dir: str, path: str, threads: int, no_repack: bool) -> dict:
    rows, rss = llama_bench(bin_dir, path, threads, ["-p", "1024", "-n", "256", "-r", "2"], no_repack)
    pp = next(r for r in rows if r["n_prompt"] == 1024 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] == 256 and r["n_prompt"] == 0)
    batched = subprocess.run(
        [os.path.join(bin_dir, "llama-batched-bench"), "-m", path, "-t", str(threads), "-tb", str(threads)]
        + ["-c", "4096", "-npp", "128", "-ntg", "256", "-npl", "4", "--output-format", "jsonl"]
        + (["--no-repack"] if no_repack else []),
        capture_output=True,
        text=True,
        check=True,
    )
    four = [json.loads(line) for line in batched.stdout.splitlines() if line.startswith("{")]
    return {
        # (llama-bench's KV cache holds its longest test's context: 1,024 tokens, ~28 MiB here)
        "peak_rss_bytes": rss,
        "one_stream_tok_s": tg["avg_ts"],
        "prompt_1024_tok_s": pp["avg_ts"],
        "ttft_1024_s": 1024 / pp["avg_ts"],
        "four_streams_tok_s": four[-1]["speed_tg"] if four else None,
        "build": {k: pp.get(k) for k in ("build_commit", "cpu_info", "backends", "n_threads")},
        "repack": not no_repack,
    }


def run_perplexity(model: str, engine_args: dict) -> dict:
    """Perplexity on the text `jaxllm bench perplexity` ships (windows of 512 tokens): jaxllm
    with its defaults for the machine (plus `engine_args`) against transformers reading the same
    GGUF dequantized, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.bench.perplexity import perplexity, text_windows

    llm = LLM(model, max_model_len=1024, **engine_args)
    ours = perplexity(llm)
    windows = text_windows(llm.get_tokenizer())
    del llm
    folder, file = os.path.split(catalog.path_of(model) or model)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logprobs = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].double(), -1)
            nll -= float(logprobs[torch.arange(len(w) - 1), w[1:]].sum())
            count += len(w) - 1
    reference = float(np.exp(nll / count))
    return {"jaxllm": ours, "transformers": reference, "ratio": ours["perplexity"] / reference}


def long_prompt(tokenizer, length: int) -> list[int]:
    """The first `length` tokens of the shipped text repeated: real prose whose continuation
    needs attention to reach back thousands of tokens."""
    from jaxllm.bench.perplexity import text_windows

    ids = [t for w in text_windows(tokenizer, window=1 << 30) for t in w]
    return (ids * (length // len(ids) + 1))[:length]


def run_long(
    model: str,
    lengths: list[int],
    engine_args: dict,
    bin_dir: str | None,
    threads: int,
    no_repack: bool,
    peer_limit: float | None = None,
) -> list[dict]:
    """Time to first token of prompts of `lengths` tokens: jaxllm with its defaults (a context of
    the longest plus a few tokens), then llama-bench's pp of each length (`-r 1`, with its peak
    RSS), and jaxllm's peak RSS against the weights and KV pool it reports. `peer_limit`: stop
    llama.cpp's run after that many times jaxllm's time and record the ratio as a lower bound
    (`ratio_at_least`): at 32k tokens llama.cpp takes the better part of an hour."""
    # (no prefix caching: the longer prompts begin with the shorter ones)
    llm = LLM(model, max_model_len=max(lengths) + 16, enable_prefix_caching=False, **engine_args)
    llm.engine.wait_compiled()  # (steps of a new context length compile in the background first)
    runner = llm.engine.runner
    weights, kv = weight_bytes(runner.params, runner.small_params), weight_bytes(runner.kv.pages)
    rows = []
    for n in lengths:
        ids = long_prompt(llm.get_tokenizer(), n)
        once = SamplingParams(max_tokens=1, temperature=0)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], once, use_tqdm=False)
        ttft = time.perf_counter() - start
        rows.append({"tokens": n, "jaxllm_ttft_s": ttft, "jaxllm_tok_s": n / ttft})
        print(json.dumps(rows[-1]), flush=True)
    memory = {"weights_bytes": weights, "kv_pool_bytes": kv, "peak_rss_bytes": peak_rss()}
    del llm
    path = catalog.path_of(model) or model
    for row in rows if bin_dir else []:
        n = row["tokens"]
        limit = peer_limit * row["jaxllm_ttft_s"] if peer_limit else None

        def pp(no_repack: bool, n=n, limit=limit) -> dict:
            args = ["-p", str(n), "-n", "0", "-r", "1"]
            (result,), rss = llama_bench(bin_dir, path, threads, args, no_repack, timeout=limit)
            tok_s = result["avg_ts"]
            return {"llama_cpp_ttft_s": n / tok_s, "llama_cpp_tok_s": tok_s, "llama_cpp_peak_rss_bytes": rss}

        try:
            row |= with_repack_fallback(pp, no_repack)
            row["ratio"] = row["jaxllm_tok_s"] / row["llama_cpp_tok_s"]
        except subprocess.TimeoutExpired:
            row |= {"llama_cpp_ttft_s_over": limit, "ratio_at_least": peer_limit}
        print(json.dumps(row), flush=True)
    return [{**memory, **row} for row in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a catalog short name or a GGUF path")
    ap.add_argument(
        "--llama-bin",
        default="auto",
        help="folder of llama-bench and llama-batched-bench; auto: built for this machine if absent "
        "(benchmarks/llama_tools.py); none: jaxllm alone",
    )
    ap.add_argument("--engine-args", default="{}", help="JSON of more LLM(...) options")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-no-repack", action="store_true", help="run llama.cpp without weight repacking")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="one-stream pairs, llama.cpp's then jaxllm's, alternating (0: none)",
    )
    ap.add_argument("--out", default=None, help="JSON result path")
    ap.add_argument(
        "--perplexity", action="store_true", help="measure perplexity against transformers instead of speed"
    )
    ap.add_argument(
        "--long", default=None, metavar="N,N", help="time to first token of long prompts (e.g. 8192,32000) instead"
    )
    ap.add_argument(
        "--peer-limit",
        type=float,
        default=None,
        metavar="X",
        help="with --long: stop llama.cpp after X times jaxllm's time to the first token (the ratio a lower bound)",
    )
    args = ap.parse_args()
    path = catalog.path_of(args.model) or args.model
    machine = machine_info()
    print(cpu_line(machine), flush=True)
    result = {"date": now_iso(), "model": args.model, "file": path, "machine": machine, "versions": versions()}
    if args.perplexity:
        ppl = run_perplexity(args.model, json.loads(args.engine_args))
        print(
            f"{args.model} perplexity on the shipped text ({ppl['jaxllm']['tokens']} tokens): jaxllm "
            f"{ppl['jaxllm']['perplexity']:.4f}, transformers (dequantized, float32) {ppl['transformers']:.4f}, "
            f"ratio {ppl['ratio']:.4f}"
        )
        if args.out:
            write_result(args.out, {**result, "perplexity": ppl})
        return 0
    # (built before anything is measured: the build takes both cores)
    bin_dir = ensure_tools() if args.llama_bin == "auto" else None if args.llama_bin == "none" else args.llama_bin
    if args.long:
        lengths = [int(n) for n in args.long.split(",")]
        rows = run_long(
            args.model,
            lengths,
            json.loads(args.engine_args),
            bin_dir,
            args.threads,
            args.llama_no_repack,
            args.peer_limit,
        )
        if args.out:
            write_result(args.out, {**result, "long": rows})
        return 0
    bandwidth = read_bandwidth()

    def llama_one_stream() -> float:
        def tg256(no_repack: bool) -> dict:
            (row,), _ = llama_bench(bin_dir, path, args.threads, ["-p", "0", "-n", "256", "-r", "1"], no_repack)
            return {"tok_s": row["avg_ts"]}

        return with_repack_fallback(tg256, args.llama_no_repack)["tok_s"]

    ours = run_jaxllm(
        args.model, json.loads(args.engine_args), args.repeat, llama_one_stream if bin_dir else None, args.rounds
    )
    ours["read_bandwidth"] = bandwidth
    ours["decode_bandwidth_share"] = ours["decode_bytes"] * ours["one_stream_tok_s"] / bandwidth
    print(json.dumps(ours), flush=True)
    theirs = run_llama_cpp(bin_dir, path, args.threads, args.llama_no_repack) if bin_dir else None
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; a jaxllm decode step reads {ours['decode_bytes'] / 1e9:.3f} GB")
    print(f"| {args.model} | jaxllm ({ours['dtype']}) | llama.cpp | jaxllm / llama.cpp |\n|---|---:|---:|---:|")
    for key, label in (
        ("one_stream_tok_s", "1 stream, output tok/s"),
        ("prompt_1024_tok_s", "1,024-token prompt, tok/s"),
        ("four_streams_tok_s", "4 streams, output tok/s"),
    ):
        peer = theirs.get(key) if theirs else None
        ratio = f"{ours[key] / peer:.2f}x" if peer else "-"
        print(f"| {label} | {ours[key]:.1f} | {peer if peer is None else f'{peer:.1f}'} | {ratio} |")
    print(f"jaxllm's one stream reads {100 * ours['decode_bandwidth_share']:.0f}% of the read bandwidth")
    if ours["one_stream_pairs"]:
        ratios = sorted(p["jaxllm"] / p["llama_cpp"] for p in ours["one_stream_pairs"])
        ours["one_stream_pair_ratio_median"] = float(np.median(ratios))
        print(
            "1 stream in alternating pairs (llama-bench tg256, then jaxllm): "
            + ", ".join(f"{p['jaxllm']:.1f} vs {p['llama_cpp']:.1f}" for p in ours["one_stream_pairs"])
            + f"; ratios {ratios[0]:.2f}-{ratios[-1]:.2f}x, median {ours['one_stream_pair_ratio_median']:.2f}x"
        )
    if args.out:
        write_result(args.out, {**result, "jaxllm": ours, "llama_cpp": theirs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
