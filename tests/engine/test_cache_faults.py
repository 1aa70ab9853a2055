"""Faults in jaxllm's caches: an entry a crash or a full disk left the wrong size, two processes
building one entry at once, a read-only cache, a disk that fills up mid-write, a garbled C++
library. Each case checks the answer afterwards (the params equal a fresh conversion), that one
clear line was logged, and that nothing partial was left behind."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxllm.kernels import native
from jaxllm.models import loader
from jaxllm.runner.executables import ExecutableStore

READ_ONLY = "/proc/jaxllm-cache"  # (a folder nothing can create, whoever runs the tests)


def _entry(cache_dir: str) -> str:
    (entry,) = os.listdir(cache_dir)
    return os.path.join(cache_dir, entry)


def _same_params(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_an_entry_of_the_wrong_size_is_converted_again_with_one_line(tiny_model_dir, tmp_path, caplog):
    first = loader.load_model(tiny_model_dir, cache_dir=str(tmp_path), progress=False)
    entry = _entry(str(tmp_path))
    with open(os.path.join(entry, "meta.json")) as f:
        sizes = json.load(f)["files"]
    assert sizes[os.path.join("params", loader.PARAMS_FILE)] == os.path.getsize(
        os.path.join(entry, "params", loader.PARAMS_FILE)
    )
    with open(os.path.join(entry, "params", loader.PARAMS_FILE), "ab") as f:
        f.write(b"\0")  # (the same bytes and one more: only the size tells)
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        again = loader.load_model(tiny_model_dir, cache_dir=str(tmp_path), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "unreadable" in lines[0] and "bytes" in lines[0] and "converting" in lines[0]
    _same_params(again.params, first.params)
    restored = loader.load_model(tiny_model_dir, cache_dir=str(tmp_path), progress=False)  # (rewritten whole)
    _same_params(restored.params, first.params)


LOAD = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from jaxllm.models.loader import load_model
    load_model(sys.argv[1], cache_dir=sys.argv[2], progress=False)
    print("loaded")
    """
)


@pytest.mark.multiprocess
def test_two_processes_building_one_entry_build_it_once(tiny_model_dir, tmp_path):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", LOAD, tiny_model_dir, str(tmp_path)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in "ab"]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert all(out.rstrip().endswith("loaded") for out, _ in outs)
    # One converted and wrote the entry; the other waited on the lock and restored it.
    assert sum("from the params cache" in out for out, _ in outs) == 1
    assert os.listdir(tmp_path) == [os.path.basename(_entry(str(tmp_path)))]  # (no temporary left)
    restored = loader.load_model(tiny_model_dir, cache_dir=str(tmp_path), progress=False)
    _same_params(restored.params, loader.load_model(tiny_model_dir, use_cache=False, progress=False).params)


def test_a_read_only_cache_serves_and_warns_once(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        loaded = loader.load_model(tiny_model_dir, cache_dir=READ_ONLY, progress=False)
        store = ExecutableStore(os.path.join(READ_ONLY, "executables"), "static", jax.devices()[:1])
        compiled = jax.jit(lambda x: x + 1).lower(np.zeros(3, np.float32)).compile()
        for key in ("a", "b", "c"):
            store.save(key, compiled)
    _same_params(loaded.params, loader.load_model(tiny_model_dir, use_cache=False, progress=False).params)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("params cache" in line for line in lines) == 1
    assert sum("could not save the compiled step" in line for line in lines) == 1  # (three failed)
    assert not os.path.exists(READ_ONLY)


FULL_DISK = textwrap.dedent(
    """
    import os, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG instead)
    from jaxllm.models.loader import load_model
    limit = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    loaded = load_model(sys.argv[1], cache_dir=sys.argv[2], progress=False)
    import numpy as np, jax
    print("checksum", sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(loaded.params)))
    """
)


@pytest.mark.multiprocess
def test_a_disk_that_fills_up_mid_write_leaves_nothing_partial(tiny_model_dir, tmp_path):
    """A process whose files may not grow past 64 KiB (RLIMIT_FSIZE: what a full disk does to
    a write) loads the model: the entry cannot be written, the model still loads whole, nothing
    is left in the cache."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", FULL_DISK, tiny_model_dir, str(tmp_path), str(64 << 10)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "could not write params cache" in run.stderr
    reference = loader.load_model(tiny_model_dir, use_cache=False, progress=False).params
    want = sum(float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(reference))
    assert float(run.stdout.split()[-1]) == pytest.approx(want, rel=1e-12)
    assert os.listdir(tmp_path) == []


def test_a_garbled_kernel_library_is_compiled_again(tmp_path, monkeypatch, caplog):
    """The library's SHA-256 sidecar: a garbled file is compiled again (with one warning), an
    intact one is kept; a cache that cannot be written builds in a private folder."""
    compiled = []

    def fake_compile(cxx, path):  # (the real compile takes minutes on two cores)
        compiled.append(path)
        native._write_atomically(f"{path}.sha256", native.hashlib.sha256(b"ELF").hexdigest().encode())
        native._write_atomically(path, b"ELF")

    monkeypatch.setattr(native, "_compile", fake_compile)
    path = native._build_in(str(tmp_path), "k", "c++")
    assert compiled == [path] and native._build_in(str(tmp_path), "k", "c++") == path and len(compiled) == 1
    with open(path, "r+b") as f:
        f.write(b"X")
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        assert native._build_in(str(tmp_path), "k", "c++") == path
    assert len(compiled) == 2 and "damaged" in caplog.text
    with open(path, "rb") as f:
        assert f.read() == b"ELF"
    monkeypatch.setattr(native, "_compiler", lambda: "c++")
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "c++ 1.0", ""))
    elsewhere = native.build(cache_dir=READ_ONLY)
    assert not elsewhere.startswith(READ_ONLY) and os.path.isfile(elsewhere) and "cannot keep" in caplog.text
