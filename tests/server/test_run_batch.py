"""`jaxllm run-batch` on the tiny model in a fresh process: each good line's answer equals the
offline engine's (and the live server's body shape), each bad line gets its own error line, the
others are unaffected, the exit status says some failed, and the progress bar on stderr counts
every line (none with --no-progress)."""

from __future__ import annotations

import json
import os
import re
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
    cmd += ["--model", tiny_model_dir, *tiny_engine_flags()]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]  # (some lines failed)
    assert "3 of 8 requests answered, 5 failed" in proc.stderr
    assert re.search(r"requests: 100%\|[^\r\n]*\| 8/8 ", proc.stderr), proc.stderr[-1000:]  # (the bar's last state)
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


def test_the_progress_bar_counts_every_line_unless_turned_off(llm, capsys):
    """In-process, as `run-batch` runs: the bar (on stderr) ends at lines/lines, failed lines
    counted; with progress off (--no-progress) no bar is drawn."""
    import asyncio
    import io

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app
    from jaxllm.entrypoints.openai.server_args import ServerArgs
    from jaxllm.entrypoints.run_batch import run_batch

    body = {"prompt": "Once upon a time", "max_tokens": 2}
    lines = [json.dumps({"custom_id": str(i), "url": "/v1/completions", "body": body}) for i in range(4)] + ["bad"]
    async_llm = AsyncLLM(engine=llm.engine)
    try:
        app = build_app(async_llm, ServerArgs(disable_log_stats=True))
        for progress in (True, False):
            sink = io.StringIO()
            assert asyncio.run(run_batch(app, lines, sink, 2, progress=progress)) == 1
            assert len(sink.getvalue().splitlines()) == 5
            stderr = capsys.readouterr().err
            if progress:
                assert re.search(r"requests: 100%\|[^\r\n]*\| 5/5 ", stderr), stderr
            else:  # (request log lines may go to stderr, where an earlier test set logging up)
                assert "requests:" not in stderr and "5/5" not in stderr, stderr
    finally:
        async_llm.shutdown()


def test_run_batch_embeds_on_a_pooling_engine(embedding_server):
    """/v1/embeddings lines through `run_batch` over an in-process app on the MiniLM engine: the
    embeddings equal the offline engine's; a chat line there gets the pooling engine's 400."""
    import asyncio
    import io

    import numpy as np

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app
    from jaxllm.entrypoints.openai.server_args import ServerArgs
    from jaxllm.entrypoints.run_batch import run_batch

    offline = embedding_server.offline
    texts = ["a cat sat on the mat", "stock markets fell"]
    lines = [
        json.dumps({"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": texts}}),
        json.dumps(
            {
                "custom_id": "chat",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}]},
            }
        ),
    ]
    async_llm = AsyncLLM(engine=offline.engine)
    try:
        sink = io.StringIO()
        failed = asyncio.run(run_batch(build_app(async_llm, ServerArgs()), lines, sink, 4, progress=False))
    finally:
        async_llm.shutdown()
    out = {r["custom_id"]: r for r in map(json.loads, sink.getvalue().splitlines())}
    assert failed == 1 and out["chat"]["response"]["status_code"] == 400
    got = [d["embedding"] for d in out["embed"]["response"]["body"]["data"]]
    want = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
