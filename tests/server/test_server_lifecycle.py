"""The server's life, each test with its own `jaxllm serve` process run through
tests/helpers/fault_server.py (slow steps, injected failures):

- a full queue answers 429 with Retry-After; SIGTERM drains: running requests finish, streams
  still open at --shutdown-timeout end with an error event and [DONE], and the exit status is 0;
- a failing step fails only its own requests (an error event, no exception text) and the server
  goes on serving;
- an engine that cannot recover fails every open request, and the process exits non-zero.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.helpers.live_server import AUTH, LiveServer, start_server


class Stream(threading.Thread):
    """One streamed /v1/completions request read on a thread: its status, SSE events and [DONE]."""

    def __init__(self, server: LiveServer, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.status, self.events, self.done, self.error = None, [], False, None
        self.started = threading.Event()
        self.start()

    def run(self):
        body = {
            "model": self.server.model,
            "prompt": "Tell me a story",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", self.server.url + "/v1/completions", json=body, headers=AUTH, timeout=120
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.started.set()

    @property
    def text_events(self) -> list[dict]:
        return [e for e in self.events if "choices" in e]

    @property
    def error_events(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]


def test_full_queue_then_sigterm_drains_and_exits_zero(tiny_model_dir, tmp_path):
    server = start_server(
        tiny_model_dir,
        str(tmp_path),
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
        "--shutdown-timeout",
        "6",
        faults=["--step-delay", "0.05"],
    )
    try:
        # 3 s and 20 s of steps: the short one still runs when the queue is full (on a busy
        # machine a 0.5 s one could end first and let the queued one in) and ends in the grace.
        short, long = Stream(server, 60), Stream(server, 400)
        for s in (short, long):
            assert s.started.wait(60) and s.status == 200
        queued = Stream(server, 400)  # waits for a free row
        time.sleep(0.3)
        refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] and refused.json()["error"]["code"] == 429

        server.proc.send_signal(signal.SIGTERM)
        for s in (short, long, queued):
            s.join(60)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    # Finished inside the grace period: every token, then [DONE].
    assert short.done and not short.error_events
    assert short.text_events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in short.text_events) >= 1
    # Still running at --shutdown-timeout: ended with an error event (503) and [DONE], not cut.
    for s in (long, queued):
        assert s.status == 200 and s.done, (s.status, s.events[-2:])
        assert [e["code"] for e in s.error_events] == [503]
        assert "shutting down" in s.error_events[0]["message"]
    assert "Traceback" not in server.log()


def test_failed_step_fails_only_its_requests(tiny_model_dir, tmp_path):
    # This server also trusts requests' chat templates (rendered sandboxed, still bounded).
    server = start_server(
        tiny_model_dir,
        str(tmp_path),
        "--trust-request-chat-template",
        faults=["--fail-at-step", "5", "--step-delay", "0.02"],
    )
    try:
        victim = Stream(server, 100)
        victim.join(60)
        assert victim.status == 200 and victim.done
        errors = victim.error_events
        assert len(errors) == 1 and errors[0]["code"] == 500
        assert "injected" not in errors[0]["message"]  # no exception text to the client
        server.assert_healthy()
        after = server.client.completions.create(model=server.model, prompt="hi", max_tokens=5, temperature=0)
        assert after.choices[0].finish_reason == "length"

        own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        chat = server.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello there"}], "chat_template": own, "max_tokens": 2},
        )
        assert chat.status_code == 200, chat.text
        expected = server.post("/tokenize", {"prompt": "hello there", "add_special_tokens": False}).json()["count"]
        assert chat.json()["usage"]["prompt_tokens"] == expected
        spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        hostile = server.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": spin}
        )
        assert hostile.status_code == 400 and hostile.json()["error"]["param"] == "messages"
        server.assert_healthy()
    finally:
        assert server.stop() == 0
    log = server.log()
    assert log.count("Traceback") == 1 and log.count("RuntimeError: injected fault") == 1  # logged once


def test_unrecoverable_engine_fails_every_request_and_exits_nonzero(tiny_model_dir, tmp_path):
    server = start_server(
        tiny_model_dir, str(tmp_path), faults=["--fail-at-step", "8", "--unrecoverable", "--step-delay", "0.05"]
    )
    try:
        stream = Stream(server, 200)
        assert stream.started.wait(60)
        plain = {}

        def plain_request():
            plain["response"] = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 200, "ignore_eos": True})

        thread = threading.Thread(target=plain_request, daemon=True)
        thread.start()
        stream.join(60)
        thread.join(60)
        assert server.proc.wait(60) == 1
    finally:
        server.stop()
    assert stream.done and [e["code"] for e in stream.error_events] == [503]
    assert plain["response"].status_code == 503
    assert "engine has stopped" in plain["response"].json()["error"]["message"]
    assert "cannot recover" in server.log()
