"""The requests `jaxllm bench` (and benchmarks/) sends: vLLM's random dataset, token ids drawn
uniformly from a model's non-special tokens, with uniform prompt and output lengths."""

from __future__ import annotations

import numpy as np


def vocab_info(model: str | None) -> tuple[int, list[int]]:
    """(vocab size, special token ids) of `model` (None: the bundled GGUF)."""
    from jaxllm.models.loader import default_model_path, load_model, read_gguf

    path = model or default_model_path()
    if path.endswith(".gguf"):
        metadata, _ = read_gguf(path)
        types = np.asarray(metadata["tokenizer.ggml.token_type"])
        return len(types), np.nonzero(types != 1)[0].tolist()  # 1 = normal token
    tok = load_model(path, progress=False).tokenizer
    return len(tok), sorted(set(tok.all_special_ids))


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths uniform in [length (1 - ratio), length (1 + ratio)]."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    return max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))


def random_workload(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int,
    vocab_size: int,
    special_ids: list[int],
) -> list[dict]:
    """vLLM's random dataset: uniform lengths (both ends included), uniform non-special token ids;
    each request a dict of `prompt_token_ids` and `max_tokens`."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    input_lens = rng.integers(input_len_range[0], input_len_range[1] + 1, num_prompts)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, num_prompts)
    return [
        {"prompt_token_ids": allowed[rng.integers(0, len(allowed), n)].tolist(), "max_tokens": int(m)}
        for n, m in zip(input_lens, output_lens)
    ]
