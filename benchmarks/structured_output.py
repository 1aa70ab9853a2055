"""Structured output: the grammar backends compared, the valid-output rate on the default model,
and what the token mask costs a step.

    python benchmarks/structured_output.py                      # all three parts
    python benchmarks/structured_output.py --parts backends     # one part

Parts:
- "backends": for each schema of tests/helpers/schema_suite.py, llguidance and (if installed)
  xgrammar: the time to compile it, and the time to fill one token mask along a valid instance,
  token by token (median and the worst), plus each backend's one-off tokenizer set-up.
- "validity": the default model (chat template, --samples requests per schema, temperature 1,
  seeded, max_tokens --max-tokens) under each schema's constraint; an output counts as valid
  when `jsonschema` accepts it. Reports the rate per schema and over all. With --unbounded,
  the schemas without the suite's bounds on strings and decimals (see tests/helpers/schema_suite.py).
- "overhead": one engine, the same prompts decoded --decode-tokens tokens each (ignore_eos),
  at --batches requests at a time, with every request constrained (a JSON array of objects
  whose minItems no output reaches in that many tokens, so no grammar ends early) and with
  none, alternating --repeats times; the median of each. Reports the mean time per engine
  step (wall time / steps) both ways and their ratio.

JSON to --out (default benchmarks/results/structured_output.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, ROOT, VERSIONED, cpu_line, machine_info, now_iso, versions, write_result  # noqa: E402

del sys.path[0]
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
from schema_suite import SCHEMAS, unbounded, validate  # noqa: E402

del sys.path[0]

# Every request's constraint in the overhead part: no output of --decode-tokens tokens completes it.
LONG_ARRAY = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["id", "name"],
        "additionalProperties": False,
    },
}


def _ms(seconds: list[float]) -> dict:
    return {"median_ms": 1000 * statistics.median(seconds), "max_ms": 1000 * max(seconds)}


def backends(tokenizer, vocab_size: int, eos: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    out = {}
    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    out["llguidance"] = {"version": versions(["llguidance"]).get("llguidance"), "tokenizer_s": time.perf_counter() - t0}
    try:
        import xgrammar as xgr

        t0 = time.perf_counter()
        xgr_compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos),
            cache_enabled=False,
        )
        out["xgrammar"] = {"version": versions(["xgrammar"]).get("xgrammar"), "tokenizer_s": time.perf_counter() - t0}
    except ImportError:
        xgr = None
    rows = []
    from jaxllm.structured_output.llguidance_backend import JSON_OPTIONS

    for name, _, schema, example in SCHEMAS:
        tokens = tokenizer.encode(json.dumps(example), add_special_tokens=False)
        row = {"schema": name, "tokens": len(tokens)}
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(
            ll_tok,
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS),
            log_level=0,
        )
        row["llguidance_compile_ms"] = 1000 * (time.perf_counter() - t0)
        mask, fills = lln.allocate_token_bitmask(1, vocab_size), []
        for t in tokens:
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(matcher, mask)
            fills.append(time.perf_counter() - t0)
            assert matcher.consume_token(t), (name, matcher.get_error())
        row["llguidance_mask"] = _ms(fills)
        if xgr is not None:
            t0 = time.perf_counter()
            compiled = xgr_compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
            )
            row["xgrammar_compile_ms"] = 1000 * (time.perf_counter() - t0)
            matcher, bitmask, fills = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab_size), []
            for t in tokens:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                fills.append(time.perf_counter() - t0)
                assert matcher.accept_token(t), name
            row["xgrammar_mask"] = _ms(fills)
        rows.append(row)
        print(
            f"{name:12s} {len(tokens):3d} tokens | llguidance compile {row['llguidance_compile_ms']:6.1f} ms, "
            f"mask {row['llguidance_mask']['median_ms'] * 1000:5.0f} us (max {row['llguidance_mask']['max_ms']:5.2f}"
            " ms)"
            + (
                f" | xgrammar compile {row['xgrammar_compile_ms']:6.1f} ms, mask "
                f"{row['xgrammar_mask']['median_ms'] * 1000:5.0f} us "
                f"(max {row['xgrammar_mask']['max_ms']:5.2f} ms)"
                if xgr is not None
                else ""
            ),
            flush=True,
        )
    for backend in [b for b in ("llguidance", "xgrammar") if b in out]:
        out[backend]["compile_ms_median"] = statistics.median(r[f"{backend}_compile_ms"] for r in rows)
        out[backend]["mask_ms_median"] = statistics.median(r[f"{backend}_mask"]["median_ms"] for r in rows)
        out[backend]["mask_ms_worst"] = max(r[f"{backend}_mask"]["max_ms"] for r in rows)
        print(
            f"{backend}: tokenizer set-up {out[backend]['tokenizer_s']:.2f} s; median over schemas: compile "
            f"{out[backend]['compile_ms_median']:.1f} ms, mask {out[backend]['mask_ms_median'] * 1000:.0f} us; "
            f"worst mask {out[backend]['mask_ms_worst']:.2f} ms",
            flush=True,
        )
    return {"summary": out, "rows": rows}


def validity(llm, samples: int, max_tokens: int, bounded: bool = True) -> dict:
    import jsonschema

    from jaxllm import SamplingParams, StructuredOutputsParams

    prompts, params, names = [], [], []
    for name, prompt, schema, _ in SCHEMAS:
        schema = schema if bounded else unbounded(schema)
        messages = [{"role": "user", "content": f"{prompt} Answer in JSON."}]
        for i in range(samples):
            prompts.append({"prompt_token_ids": llm.engine.apply_chat_template(messages)})
            params.append(
                SamplingParams(
                    temperature=1.0,
                    seed=i,
                    max_tokens=max_tokens,
                    structured_outputs=StructuredOutputsParams(json=schema),
                )
            )
            names.append(name)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    per_schema: dict[str, dict] = {}
    for name, out, p in zip(names, outs, params):
        row = per_schema.setdefault(name, {"valid": 0, "total": 0, "finish": {}, "example": None})
        text = out.outputs[0].text
        try:
            validate(json.loads(text), p.structured_outputs.json)
            row["valid"] += 1
            row["example"] = row["example"] or text
        except (ValueError, jsonschema.ValidationError):
            row["invalid_example"] = text
        row["total"] += 1
        reason = out.outputs[0].finish_reason
        row["finish"][reason] = row["finish"].get(reason, 0) + 1
    valid, total = sum(r["valid"] for r in per_schema.values()), len(outs)
    for name, row in per_schema.items():
        print(
            f"{name:12s} {row['valid']}/{row['total']} valid, finish {row['finish']}; e.g. {row['example']}", flush=True
        )
    print(f"valid: {valid}/{total} = {valid / total:.1%} over {len(per_schema)} schemas ({wall:.0f} s)", flush=True)
    return {
        "valid": valid,
        "total": total,
        "rate": valid / total,
        "samples_per_schema": samples,
        "bounded": bounded,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "per_schema": per_schema,
    }


def overhead(llm, batches: list[int], decode_tokens: int, repeats: int) -> list[dict]:
    from jaxllm import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=LONG_ARRAY)
    messages = [[{"role": "user", "content": f"List {n} products as JSON."}] for n in range(max(batches))]
    prompts = [{"prompt_token_ids": llm.engine.apply_chat_template(m)} for m in messages]
    rows = []
    for batch in batches:

        def run(constrained: bool) -> dict:
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=i,
                    max_tokens=decode_tokens,
                    ignore_eos=True,
                    structured_outputs=constraint if constrained else None,
                )
                for i in range(batch)
            ]
            stats = llm.engine.stats
            steps0 = stats.num_steps
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:batch], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == decode_tokens for o in outs)
            steps = stats.num_steps - steps0
            return {"wall_s": wall, "steps": steps, "ms_per_step": 1000 * wall / steps}

        run(True), run(False)  # warm-up
        runs = {True: [], False: []}
        for _ in range(repeats):
            for constrained in (False, True):
                runs[constrained].append(run(constrained))
        off, on = (sorted(r, key=lambda x: x["ms_per_step"])[len(r) // 2] for r in (runs[False], runs[True]))
        row = {
            "batch": batch,
            "none": off,
            "all": on,
            "ratio": on["ms_per_step"] / off["ms_per_step"],
            "runs_ms_per_step": {
                "none": [r["ms_per_step"] for r in runs[False]],
                "all": [r["ms_per_step"] for r in runs[True]],
            },
        }
        rows.append(row)
        print(
            f"batch {batch:3d}: {off['ms_per_step']:7.2f} ms/step unconstrained, {on['ms_per_step']:7.2f} ms/step "
            f"all constrained: {row['ratio']:.3f}x",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--parts", default="backends,validity,overhead")
    ap.add_argument("--samples", type=int, default=8, help="validity: requests per schema (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=384, help="validity: max_tokens (default: %(default)s)")
    ap.add_argument("--unbounded", action="store_true", help="validity: the schemas without their bounds")
    ap.add_argument("--batches", default="1,8,32", help="overhead: requests at a time (default: %(default)s)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="overhead: tokens per request (default: %(default)s)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="overhead: runs each way, alternating (default: %(default)s)"
    )
    ap.add_argument("--out", default=os.path.join(RESULTS, "structured_output.json"))
    args = ap.parse_args()
    parts = args.parts.split(",")

    from jaxllm import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(32, *map(int, args.batches.split(","))),
        max_model_len=1024,
        kv_cache_memory=1 << 30,
    )
    llm.engine.wait_compiled()
    machine = machine_info()
    print(f"CPU: {cpu_line(machine)}; dtype {llm.engine.config.dtype}", flush=True)
    result = {
        "benchmark": "structured_output",
        "command": "python " + shlex.join(sys.argv),
        "date": now_iso(),
        "machine": machine,
        "versions": versions((*VERSIONED, "llguidance", "xgrammar")),
        "dtype": llm.engine.config.dtype,
    }
    if "backends" in parts:
        result["backends"] = backends(llm.get_tokenizer(), llm.engine.cfg.vocab_size, list(llm.engine.eos_token_ids))
    if "validity" in parts:
        result["validity"] = validity(llm, args.samples, args.max_tokens, bounded=not args.unbounded)
    if "overhead" in parts:
        result["overhead"] = overhead(llm, list(map(int, args.batches.split(","))), args.decode_tokens, args.repeats)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
