"""`kill -9` of `jaxllm serve`: at points of its start (importing, loading and converting the
weights, writing the params cache, compiling and saving steps) and in the middle of a stream.
The next start on the same caches is clean (nothing half-written is read or left behind) and
answers as the offline engine does; the killed stream's client sees a broken connection, never
an answer reported as complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from jaxllm import SamplingParams
from tests.helpers.live_server import start_server
from tests.helpers.tiny_model import tiny_engine_flags

PROMPT = "Once upon a time"


def _greedy(live, max_tokens: int = 8) -> str:
    return (
        live.client.completions.create(model=live.model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
    )


@pytest.mark.multiprocess
def test_killed_while_starting_or_streaming_the_next_start_is_clean(tiny_model_dir, tmp_path, server):
    caches = ["--params-cache-dir", str(tmp_path / "params"), "--compilation-cache-dir", str(tmp_path / "xla")]
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", "--model", tiny_model_dir, *tiny_engine_flags()]
    cmd += ["--port", "0", *caches]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    for delay in (0.5, 2.0, 3.5, 5.0, 7.0):  # (import, load, convert and write, compile and save)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    want = server.offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    want = want[0].outputs[0].text
    # What a kill during the params write leaves (the kills above may or may not have hit one).
    (tmp_path / "params" / "tiny-llama-float32-0123456789abcdef.tmp99999" / "params").mkdir(parents=True)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    live = start_server(tiny_model_dir, str(tmp_path / "first"), *caches)
    try:
        assert _greedy(live) == want
        stream = live.client.completions.create(
            model=live.model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = []
        with pytest.raises((openai.APIError, ConnectionError, OSError)):
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 5:
                    live.proc.send_signal(signal.SIGKILL)
        assert chunks and all(c.choices[0].finish_reason is None for c in chunks)  # (never "complete")
    finally:
        live.stop()
    again = start_server(tiny_model_dir, str(tmp_path / "second"), *caches)
    try:
        assert _greedy(again) == want
    finally:
        again.stop()
    params = tmp_path / "params"
    assert [e for e in os.listdir(params) if ".tmp" in e] == []  # (leftovers of the killed writers removed)
    assert all(os.path.isfile(params / e / "meta.json") for e in os.listdir(params))
