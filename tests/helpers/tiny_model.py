"""A tiny random Llama (hidden 64, 2 layers) with the default model's tokenizer, for tests
that need a real engine but not real weights: warm-up takes seconds instead of minutes.

Use the `tiny_model_dir` fixture (tests/conftest.py) or `build_tiny_model(path)`,
engines with `TINY_ENGINE_ARGS` (or `tiny_engine_flags()` on the command line), and
`offline_llm(path)` for the offline reference that server and CLI tests compare against.
"""

from __future__ import annotations

import os

# Small engine settings; tests share them with the offline reference. No warm-up: each step
# shape compiles when first used, so a test compiles only the shapes it runs (on CI's cold
# caches, warming every bucket of every engine up was minutes of the suite). The tests of
# warm-up itself (the compile guards, which count compilations process-wide; warm starts;
# tests/engine/test_executables.py) ask for it, in the foreground (the default compiles in the
# background).
# Pages of 16 (the accelerators' default; CPU's is 64): the tests' page arithmetic and their
# preemption and prefix-caching cases are written for them.
TINY_ENGINE_ARGS = dict(
    dtype="float32",
    max_num_seqs=32,
    max_num_batched_tokens=128,
    max_model_len=512,
    kv_cache_memory=16 << 20,
    background_compile=False,
    warmup=False,
    block_size=16,
)
# The same with every step shape compiled before the engine returns.
WARM_ENGINE_ARGS = {**TINY_ENGINE_ARGS, "warmup": True}
# For the tiny HF models of every family (tests/helpers/hf_reference.py: 128 positions, no
# tokenizer): steps of 32 tokens and pages of 4, so prompts of a few dozen tokens are chunked.
FAMILY_ENGINE_ARGS = {
    **TINY_ENGINE_ARGS,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 32,
    "max_model_len": 128,
    "kv_cache_memory": 4 << 20,
    "block_size": 4,
}

_llms: dict[str, object] = {}


def all_steps_loaded(llm):
    """`llm` once every step shape is loaded. Where the executable store holds them all, an
    engine loads its steps when first needed and a ready larger step serves meanwhile (a tiny
    model's whole request can pass before the smallest loads): tests of which step runs need
    them loaded first."""
    llm.engine.wait_compiled()
    return llm


def build_tiny_model(path: str, num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4) -> str:
    """Write a random Llama (2 layers, hidden 64 over 4 heads, unless told; half as many KV heads)
    and the default model's tokenizer (with its chat template) to `path` as an HF directory;
    return `path`.

    The weights are drawn wider than HF's default (initializer_range 0.3, not 0.02) so that the
    logits are peaked: greedy text varies from token to token, and the best two tokens are far
    enough apart that greedy outputs do not flip between batch shapes.
    """
    import torch
    import transformers

    from jaxllm.models.loader import load_model

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(num_heads // 2, 1),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.3,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    load_model(None, progress=False).tokenizer.save_pretrained(path)
    return path


def tiny_engine_flags() -> list[str]:
    """TINY_ENGINE_ARGS as `jaxllm` command-line flags (but a server keeps the default, warming
    up in the background: it runs in a process of its own)."""
    flags = []
    for name, value in TINY_ENGINE_ARGS.items():
        if name not in ("background_compile", "warmup"):
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def offline_llm(path: str):
    """The offline `LLM` over the tiny model with TINY_ENGINE_ARGS, built once per process.

    Its converted weights are cached next to the model (not in ~/.cache), so test runs leave
    no per-run entries behind there."""
    if path not in _llms:
        from jaxllm import LLM

        _llms[path] = LLM(
            path, params_cache_dir=os.path.join(os.path.dirname(path), "params_offline"), **TINY_ENGINE_ARGS
        )
    return _llms[path]
