"""Starts of the engine in fresh processes under each state its caches can be in: cold, warm,
params garbled, compiled steps damaged. Two processes start at once in each state, on the same
cache folders (so they also race for every entry); both must answer exactly as the in-process
engine does, and leave the caches whole. (A params entry cut short and a damaged C++ library
are rebuilt by the same paths: tests/models/test_loader.py, tests/engine/test_cache_faults.py.)"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from jaxllm import SamplingParams
from jaxllm.models import loader
from tests.helpers.tiny_model import tiny_engine_flags

PROMPT = "Once upon a time"


def _start_twice(tiny_model_dir: str, caches: str, env: dict | None = None) -> list[str]:
    """Two `jaxllm generate` processes started at once: their outputs (each must exit 0)."""
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "generate", "--model", tiny_model_dir, *tiny_engine_flags()]
    cmd += [
        "--params-cache-dir",
        os.path.join(caches, "params"),
        "--compilation-cache-dir",
        os.path.join(caches, "xla"),
    ]
    cmd += ["--temperature", "0", "--max-tokens", "8", PROMPT]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in "ab"]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out.strip() for out, _ in outs]


def _whole(caches: str) -> None:
    params = os.path.join(caches, "params")
    assert [e for e in os.listdir(params) if ".tmp" in e] == []
    assert all(os.path.isfile(os.path.join(params, e, "meta.json")) for e in os.listdir(params))


@pytest.mark.multiprocess
def test_every_cache_state_starts_and_answers(tiny_model_dir, llm, tmp_path):
    want = PROMPT + llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    caches = str(tmp_path)

    def params_file():
        (path,) = glob.glob(os.path.join(caches, "params", "*", "params", loader.PARAMS_FILE))
        return path

    def garble_params():  # (at its own size: found when it is read)
        with open(params_file(), "r+b") as f:
            f.write(b"\xff" * 8)

    def damage_steps():
        steps = glob.glob(os.path.join(caches, "xla", "**", "step-*.bin"), recursive=True)
        assert steps
        for path in steps:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                f.write(b"\x00\x01\x02\x03")

    for state, prepare in [
        ("cold", lambda: None),
        ("warm", lambda: None),
        ("params garbled", garble_params),
        ("compiled steps damaged", damage_steps),
    ]:
        prepare()
        assert _start_twice(tiny_model_dir, caches) == [want, want], state
        _whole(caches)
