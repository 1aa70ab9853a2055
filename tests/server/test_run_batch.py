"""`jaxllm run-batch` on the tiny model in a fresh process: each good line's answer equals the
offline engine's (and the live server's body shape), each bad line gets its own error line, the
others are unaffected, and the exit status says some failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxllm import SamplingParams
from tests.helpers.tiny_model import tiny_engine_flags

GOOD = [
    {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0},
    },
    {
        "custom_id": "completion",
        "url": "/v1/completions",
        "method": "POST",
        "body": {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "n": 2},
    },
    {
        "custom_id": "anthropic",
        "method": "POST",
        "url": "/v1/messages",
        "body": {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0},
    },
]
BAD = [
    ("not json", None, None),
    ('{"custom_id": "url", "method": "POST", "url": "/v1/models", "body": {}}', "url", None),
    ('{"custom_id": "stream", "url": "/v1/completions", "body": {"prompt": "a", "stream": true}}', "stream", None),
    ('{"custom_id": "empty", "url": "/v1/chat/completions", "body": {"messages": []}}', "empty", 400),
    ('{"custom_id": "range", "url": "/v1/completions", "body": {"prompt": "a", "temperature": -1}}', "range", 400),
]


def test_run_batch_answers_each_line(tiny_model_dir, llm, tmp_path):
    GOOD[2]["body"]["model"] = os.path.basename(tiny_model_dir)  # (the served model's name: its folder's)
    lines = [json.dumps(GOOD[0]), BAD[0][0], json.dumps(GOOD[1]), *(b[0] for b in BAD[1:]), json.dumps(GOOD[2])]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "run-batch", "-i", str(source), "-o", str(results)]
    cmd += ["--model", tiny_model_dir, *tiny_engine_flags(), "--no-progress"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]  # (some lines failed)
    assert "3 of 8 requests answered, 5 failed" in proc.stderr
    out = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(out) == len(lines) and len({r["id"] for r in out}) == len(lines)
    by_id = {r["custom_id"]: r for r in out}

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    chat = by_id["chat"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    want = llm.chat([{"role": "user", "content": "Say hi"}], greedy, use_tqdm=False)[0].outputs[0].text
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == want
    completion = by_id["completion"]["response"]["body"]
    want = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].text
    assert [c["text"] for c in completion["choices"]] == [want, want]
    message = by_id["anthropic"]["response"]["body"]
    want = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert message["content"][0]["text"] == want[0].outputs[0].text and message["stop_reason"] == "max_tokens"

    for line, custom_id, status in BAD:
        result = next(r for r in out if r["custom_id"] == custom_id)
        assert result["error"]["message"]
        if status is None:
            assert result["response"] is None
        else:
            assert result["response"]["status_code"] == status
            assert result["response"]["body"]["error"]["message"] == result["error"]["message"]
