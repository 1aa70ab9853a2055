"""OpenTelemetry tracing (--otlp-traces-endpoint) with the SDK's in-memory exporter: one
`llm_request` span per engine request with `queue`, `prefill` and `decode` children laid end to
end inside it, token counts equal to the response's usage, TTFT within the end-to-end time, and
a `traceparent` header continuing the caller's trace; the OTLP exporter posting to a local
collector, from an app given a tracer and from `jaxllm serve --otlp-traces-endpoint`."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.entrypoints.openai.server_args import ServerArgs

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from jaxllm.entrypoints.tracing import RequestTracer  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def traced(llm):
    """(app, exporter): the server app over the tiny engine, tracing into memory."""
    exporter = InMemorySpanExporter()
    async_llm = AsyncLLM(engine=llm.engine)
    app = build_app(async_llm, ServerArgs(), tracer=RequestTracer(SimpleSpanProcessor(exporter)))
    yield app, exporter
    async_llm.shutdown()


async def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        return await client.post(path, json=body, headers=headers or {})


def _request_spans(exporter) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == "llm_request"]


def test_a_request_is_a_span_with_its_phases_in_the_callers_trace(traced):
    app, exporter = traced
    body = {"prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    response = asyncio.run(_post(app, "/v1/completions", body, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}))
    assert response.status_code == 200
    usage = response.json()["usage"]
    (span,) = _request_spans(exporter)
    assert f"{span.context.trace_id:032x}" == TRACE_ID and f"{span.parent.span_id:016x}" == PARENT_ID
    attrs = span.attributes
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 7
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (7, 0.0)
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"]
    assert attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert attrs["jaxllm.finish_reason"] == "length"
    phases = sorted(
        (s for s in exporter.get_finished_spans() if s.parent and s.parent.span_id == span.context.span_id),
        key=lambda s: s.start_time,
    )
    assert [p.name for p in phases] == ["queue", "prefill", "decode"]
    assert phases[0].start_time == span.start_time and phases[-1].end_time == span.end_time
    assert all(a.end_time == b.start_time for a, b in zip(phases, phases[1:]))
    ttft_ns = attrs["gen_ai.latency.time_to_first_token"] * 1e9
    assert phases[1].end_time - span.start_time == pytest.approx(ttft_ns, abs=2e3)


def test_without_traceparent_a_request_starts_its_own_trace_and_streams_are_traced(traced):
    app, exporter = traced
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True, "n": 2}
    response = asyncio.run(_post(app, "/v1/chat/completions", body))
    assert response.status_code == 200 and "[DONE]" in response.text
    spans = _request_spans(exporter)
    assert len(spans) == 1 and spans[0].parent is None  # (n = 2 choices: one engine request)
    assert spans[0].attributes["gen_ai.request.n"] == 2
    assert spans[0].attributes["gen_ai.usage.completion_tokens"] == 8


def test_tracing_without_the_sdk_is_refused_with_the_install_hint(monkeypatch, llm):
    import builtins

    real_import = builtins.__import__

    def no_sdk(name, *args, **kwargs):
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with pytest.raises(ValueError, match=r"jaxllm\[tracing\]"):
        RequestTracer.to_endpoint("http://localhost:4318/v1/traces")


@pytest.fixture
def collector():
    """(url, received): a local HTTP server standing in for an OTLP collector, decoding what is
    posted to it with OpenTelemetry's protobuf types into `received` as (path, request)."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format, *args):  # to the test's log, not stderr
            logging.getLogger(__name__).debug(format, *args)

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces", received
    server.shutdown()


def _received_spans(received) -> list:
    return [s for _, req in received for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def test_spans_reach_an_otlp_endpoint(llm, collector):
    """The real exporter (OTLP over HTTP/protobuf) posts the spans to a collector."""
    url, received = collector
    tracer = RequestTracer.to_endpoint(url)
    async_llm = AsyncLLM(engine=llm.engine)
    try:
        app = build_app(async_llm, ServerArgs(), tracer=tracer)
        response = asyncio.run(_post(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 3}))
        assert response.status_code == 200
        tracer.shutdown()  # (flushes the batch)
    finally:
        async_llm.shutdown()
    assert {path for path, _ in received} == {"/v1/traces"}
    assert sorted(s.name for s in _received_spans(received)) == ["decode", "llm_request", "prefill", "queue"]


def test_the_served_flag_exports_to_the_collector(tiny_model_dir, tmp_path, collector):
    """`jaxllm serve --otlp-traces-endpoint URL` (ServerArgs -> build_app in the server's own
    process): a request's spans reach the collector, in the caller's trace, under the service
    name jaxllm, with the response's token counts; stopping the server flushes the batch."""
    from tests.helpers.live_server import start_server

    url, received = collector
    live = start_server(tiny_model_dir, str(tmp_path), "--otlp-traces-endpoint", url)
    try:
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        response = live.client.completions.with_raw_response.create(
            model=live.model, prompt="Hi", max_tokens=3, extra_headers=headers
        )
        usage = response.parse().usage
    finally:
        exit_code = live.stop()  # (SIGTERM: the app's shutdown sends the spans still batched)
    assert exit_code == 0
    (request,) = [s for s in _received_spans(received) if s.name == "llm_request"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    attributes = {a.key: a.value for a in request.attributes}
    assert response.headers["x-request-id"] in attributes["gen_ai.request.id"].string_value
    assert attributes["gen_ai.usage.completion_tokens"].int_value == usage.completion_tokens == 3
    assert attributes["gen_ai.usage.prompt_tokens"].int_value == usage.prompt_tokens
    (resource,) = {
        a.value.string_value
        for _, req in received
        for rs in req.resource_spans
        for a in rs.resource.attributes
        if a.key == "service.name"
    }
    assert resource == "jaxllm"
    children = sorted(
        (s for s in _received_spans(received) if s.parent_span_id == request.span_id),
        key=lambda s: s.start_time_unix_nano,
    )
    assert [s.name for s in children] == ["queue", "prefill", "decode"]
