"""Shared fixtures (the tiny model, its engine and its HF twin) and helpers for building a
paged, ragged `decoder.forward` batch by hand."""

from __future__ import annotations

import gc
import os

import jax
import numpy as np
import pytest

from jaxllm.models import decoder
from jaxllm.runner.compile import Bucket
from jaxllm.models.step_inputs import StepInputs
from cuda_lowering import ON_GPU
from tiny_model import TINY_ENGINE_ARGS, build_tiny_model, offline_llm

# The shared live server's limits (the hardening tests probe them; the defaults are larger).
SERVER_FLAGS = ("--max-request-body-bytes", "1MiB", "--max-logprobs", "10", "--request-read-timeout", "3",
                "--max-prompts-per-request", "64", "--max-stop-strings", "8", "--enable-auto-tool-choice",
                "--tool-call-parser", "hermes")


@pytest.fixture(scope="module", autouse=True)
def free_compiled_code():
    """After each module, drop the executables nothing refers to any more: each holds its
    machine code in memory maps, and one process running the whole suite otherwise reaches
    the kernel's limit on them (vm.max_map_count, 65530), where LLVM fails to allocate."""
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def one_gguf_reader_per_file():
    """transformers, the reference for GGUF files, builds a `gguf.GGUFReader` three times per
    model it loads (tokenizer, config, weights), and each parses the whole vocabulary one numpy
    view per entry: ~20 s for Gemma 3's 262k tokens on a slow CPU. The reader is read-only, so
    one per file (and size and mtime: tests write GGUFs into fresh paths) serves every load."""
    try:
        import gguf
    except ImportError:         # no GGUF reference tests either
        yield
        return

    readers, make = {}, gguf.GGUFReader

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = make


@pytest.fixture(autouse=True)
def ieee_float32_dots_on_a_gpu():
    """On a GPU, float32 dots as IEEE float32, as on the CPU (JAX's default there is TF32), so
    that the float32 tolerances against HF and NumPy mean the same on every device."""
    if not ON_GPU:
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer (tests/tiny_model.py)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """An offline engine on the tiny model with TINY_ENGINE_ARGS (one per test module)."""
    from jaxllm import LLM

    return LLM(tiny_model_dir, **TINY_ENGINE_ARGS)


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """`jaxllm serve` on the tiny model (tests/live_server.py), shared by the server tests, with
    the offline `LLM` over the same model as `server.offline`, the reference for outputs."""
    from live_server import start_server

    live = start_server(tiny_model_dir, str(tmp_path_factory.mktemp("server")), *SERVER_FLAGS,
                        offline=lambda: offline_llm(tiny_model_dir))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The same weights in HF transformers (float32), the reference implementation."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()




def make_batch(chunks, block_tables, *, spec, page_size: int, num_tokens: int, num_seqs: int, attention=None):
    """One step's `StepInputs` for `decoder.forward`, laid out as the runner lays them out.

    chunks: per sequence `(token_ids, start)`: its new tokens sit at positions
        `start .. start + len(token_ids) - 1` (the cache already holds positions `< start`).
    block_tables: `[len(chunks), pages_per_seq]` int32, each sequence's pages.
    Sequences of one token go first (decodes), then the rest, each sequence's tokens
    contiguous. Pads to `num_tokens` tokens (slot -1) and `num_seqs` sequences; the
    `attention` backend adds its own metadata (the `cpu` backend's rows).
    Returns `(inputs, where)`, `where[s]`: the token rows of sequence s in the batch.
    """
    order = sorted(range(len(chunks)), key=lambda s: len(chunks[s][0]) != 1)
    q_lens = np.array([len(chunks[s][0]) for s in order], np.int32)
    seq_lens = np.array([chunks[s][1] + len(chunks[s][0]) for s in order], np.int32)
    tables = np.asarray(block_tables, np.int32)[order].reshape(len(order), -1)
    total = int(q_lens.sum())
    assert total <= num_tokens and len(order) <= num_seqs

    inputs = StepInputs.zeros(num_tokens, num_seqs, tables.shape[1], len(spec.inv_freq()))
    where, t = {}, 0
    for s, table in zip(order, tables):
        ids, start = chunks[s]
        pos = np.arange(start, start + len(ids))
        inputs.token_ids[t : t + len(ids)] = ids
        inputs.positions[t : t + len(ids)] = pos
        inputs.slot_mapping[t : t + len(ids)] = table[pos // page_size] * page_size + pos % page_size
        where[s] = np.arange(t, t + len(ids))
        t += len(ids)
    n = len(order)
    inputs.block_tables[:n], inputs.seq_lens[:n] = tables, seq_lens
    inputs.query_start_loc[1:] = total
    inputs.query_start_loc[1 : n + 1] = np.cumsum(q_lens)
    inputs.num_seqs[...] = n
    inputs.rope_cos, inputs.rope_sin = decoder.rope_tables(inputs.positions, spec.inv_freq(), xp=np)
    if attention is not None:
        num_decodes = int((q_lens == 1).sum())
        rows = num_tokens // attention.prefill_row_tokens + num_seqs
        inputs.attn_metadata = attention.build_metadata(
            q_lens=q_lens, seq_lens=seq_lens, block_tables=tables, num_decodes=num_decodes,
            bucket=Bucket(num_tokens, num_seqs, rows, num_seqs))
    return inputs, where


def shuffled_block_tables(rng, seq_lens, *, page_size: int, pages_per_seq: int, num_pages: int):
    """Give each sequence its pages from a shuffled pool (non-contiguous, out of order);
    unused table entries point at pages in use (attention must mask them by kv_lens)."""
    perm = rng.permutation(num_pages)
    tables, used = np.zeros((len(seq_lens), pages_per_seq), np.int32), 0
    for s, n in enumerate(seq_lens):
        need = -(-n // page_size)
        assert need <= pages_per_seq and used + need <= num_pages
        tables[s, :need] = perm[used : used + need]
        tables[s, need:] = rng.choice(perm[:used + need], pages_per_seq - need)
        used += need
    return tables
