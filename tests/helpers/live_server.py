"""`jaxllm serve` as a subprocess on loopback, for the server tests: `start_server(...)` runs one
(optionally through tests/helpers/fault_server.py, which injects delays and failures into the model
runner) and returns a `LiveServer` once its "ready" line is printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.tiny_model import tiny_engine_flags


API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
READY_TIMEOUT_S = 600
HERE = os.path.dirname(os.path.abspath(__file__))
# The shared live server's limits (the `server` fixture's; the hardening tests probe them; the
# defaults are larger).
SERVER_FLAGS = (
    "--max-request-body-bytes",
    "1MiB",
    "--max-logprobs",
    "10",
    "--request-read-timeout",
    "3",
    "--max-prompts-per-request",
    "64",
    "--max-stop-strings",
    "8",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)


class LiveServer:
    def __init__(self, proc: subprocess.Popen, url: str, model: str, log_path: str, offline=None):
        self.proc, self.url, self.model, self.log_path, self.offline = proc, url, model, log_path, offline
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def post(self, path: str, body, headers=AUTH, timeout=60) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(
            self.url + path,
            content=content,
            timeout=timeout,
            headers={"Content-Type": "application/json", **(headers or {})},
        )

    def metrics(self) -> dict:
        """{(sample name, sorted label items without model_name): value}."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def assert_healthy(self) -> None:
        assert httpx.get(self.url + "/health", timeout=30).status_code == 200

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    model_dir: str, work_dir: str, *flags: str, faults: list[str] = (), offline=None, env: dict | None = None
) -> LiveServer:
    """Start `jaxllm serve` on the tiny model with an API key on a free port; `faults` (flags of
    tests/helpers/fault_server.py) run it through the fault injector. `offline`, the reference engine
    (or a function making it, called while the server warms up), becomes `.offline`; `env`
    adds to the environment."""
    log_path = os.path.join(work_dir, "server.log")
    log = open(log_path, "w")
    # The test process's caches (C++ kernels, converted weights, compiled steps): a server on the
    # settings an in-process engine already compiled starts in seconds.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    entry = [os.path.join(HERE, "fault_server.py"), *faults, "--"] if faults else ["-m", "jaxllm.entrypoints.cli"]
    cmd = [
        sys.executable,
        *entry,
        "serve",
        "--model",
        model_dir,
        *tiny_engine_flags(),
        "--port",
        "0",
        "--api-key",
        API_KEY,
        "--uvicorn-log-level",
        "warning",
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    log.close()
    found: dict[str, str] = {}

    def watch_stdout():
        for line in proc.stdout:
            if line.startswith("jaxllm: ready at ") and "url" not in found:
                found["url"] = line.split()[3].removesuffix("/v1")

    threading.Thread(target=watch_stdout, daemon=True).start()
    if callable(offline):
        offline = offline()  # built while the server warms up
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "url" not in found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log_path) as f:
                raise RuntimeError(f"jaxllm serve did not get ready (exit code {proc.poll()}):\n{f.read()[-4000:]}")
        time.sleep(0.2)
    return LiveServer(proc, found["url"], os.path.basename(model_dir), log_path, offline)
