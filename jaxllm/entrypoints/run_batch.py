"""`jaxllm run-batch -i requests.jsonl -o results.jsonl`: a file of requests in OpenAI's batch
format, answered offline (no socket) by the server's own handlers.

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}` (also /v1/completions, /v1/messages, and /v1/embeddings on a pooling engine).
The lines run concurrently through the server app in this process (the same validation,
templates, tool calling and limits as `jaxllm serve`, over an in-process ASGI transport), so the
engine batches them; each result is written as it completes, one line per input line:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ...,
     "body": {...}}, "error": null}

A line that fails (not JSON, an unknown url, a streamed body, an invalid request) gets its own
result line with the status and the error, and the rest go on. Exit status 0 when every line
succeeded, 1 otherwise (the results file is complete either way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages")
# ServerArgs fields about sockets and HTTP connections: nothing to set without a server.
NETWORK_FIELDS = (
    "host",
    "port",
    "api_key",
    "limit_concurrency",
    "timeout_keep_alive",
    "request_read_timeout",
    "max_header_bytes",
    "shutdown_timeout",
    "uvicorn_log_level",
    "disable_playground",
    "enable_weight_updates",
)


def add_run_batch_parser(commands, formatter, cli) -> None:
    """The `run-batch` command; `cli`: the jaxllm.entrypoints.cli module (its flag helpers)."""
    from jaxllm.entrypoints.openai.server_args import ServerArgs

    parser = commands.add_parser(
        "run-batch",
        formatter_class=formatter,
        help="answer a JSONL file of requests in OpenAI's batch format",
        description=__doc__.split("\n\n", 1)[1],
        epilog="example:\n  jaxllm run-batch -i requests.jsonl -o results.jsonl --model qwen2.5-coder-0.5b",
    )
    parser.add_argument("-i", "--input-file", required=True, metavar="PATH", help="the requests ('-' for stdin)")
    parser.add_argument("-o", "--output-file", required=True, metavar="PATH", help="the results ('-' for stdout)")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight at once (default: twice --max-num-seqs)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    cli.add_engine_args(parser, serving=True)
    cli.add_dataclass_args(
        parser.add_argument_group("request handling (as `jaxllm serve`'s)"), ServerArgs, skip=NETWORK_FIELDS
    )
    parser.set_defaults(
        run=lambda args: run_batch_command(args, cli.engine_args(args), cli.from_flags(ServerArgs, args))
    )


def run_batch_command(args: argparse.Namespace, engine_args, server_args) -> int:
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app

    server_args.verify()
    source = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
    with source:
        lines = [line for line in source.read().splitlines() if line.strip()]
    print(f"jaxllm: {len(lines)} requests; loading {args.model or 'the default model'}...", file=sys.stderr, flush=True)
    llm = AsyncLLM(engine_args)
    try:
        app = build_app(llm, server_args)
        concurrency = args.max_concurrency or 2 * llm.engine.config.scheduler.max_num_seqs
        to_stdout = args.output_file == "-"
        with contextlib.nullcontext(sys.stdout) if to_stdout else open(args.output_file, "w", encoding="utf-8") as sink:
            failed = asyncio.run(run_batch(app, lines, sink, concurrency, progress=not args.no_progress))
    finally:
        llm.shutdown()
    print(f"jaxllm: {len(lines) - failed} of {len(lines)} requests answered, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def _result(custom_id, status: int | None, request_id: str | None, body, error: str | None) -> dict:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": None if error is None else {"code": str(status or "invalid_request"), "message": error},
    }


async def answer_line(client, line: str) -> dict:
    """One input line's result (never raises for a bad line)."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return _result(None, None, None, None, f"the line is not JSON: {e}")
    if not isinstance(request, dict):
        return _result(None, None, None, None, "the line is not a JSON object")
    custom_id = request.get("custom_id")
    url, body = request.get("url"), request.get("body")
    if request.get("method", "POST") != "POST" or url not in URLS:
        return _result(custom_id, None, None, None, f"method and url must be POST and one of {', '.join(URLS)}")
    if not isinstance(body, dict):
        return _result(custom_id, None, None, None, "body must be a JSON object")
    if body.get("stream"):
        return _result(custom_id, None, None, None, "stream is not supported in a batch")
    response = await client.post(url, json=body)
    try:
        answer = response.json()
    except ValueError:
        answer = {"text": response.text}
    error = None
    if response.status_code != 200:
        info = answer.get("error") if isinstance(answer, dict) else None
        error = info.get("message") if isinstance(info, dict) else response.text
    return _result(custom_id, response.status_code, response.headers.get("x-request-id"), answer, error)


async def run_batch(app, lines: list[str], sink, concurrency: int, progress: bool = True) -> int:
    """Answer `lines` through `app` (the server's FastAPI app), at most `concurrency` at a time,
    writing each result line to `sink` as it completes. Returns how many failed."""
    import httpx
    from tqdm import tqdm

    gate = asyncio.Semaphore(max(1, concurrency))
    failed = 0
    bar = tqdm(total=len(lines), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://jaxllm-batch", timeout=None) as client:

        async def one(line: str) -> None:
            nonlocal failed
            async with gate:
                result = await answer_line(client, line)
            failed += result["error"] is not None
            sink.write(json.dumps(result, ensure_ascii=False) + "\n")
            sink.flush()
            bar.update(1)

        await asyncio.gather(*(one(line) for line in lines))
    bar.close()
    return failed
