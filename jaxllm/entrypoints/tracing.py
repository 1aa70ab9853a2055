"""OpenTelemetry traces of the server's requests (`--otlp-traces-endpoint`), exported over OTLP.

Each engine request that ends (finished or aborted) becomes one span, `llm_request`, from its
arrival to its last token, with three children laid out on the same clock: `queue` (arrival to
first scheduled), `prefill` (to the first token) and `decode` (to the last). The attributes
follow vLLM's (OpenTelemetry's gen_ai conventions): the request id and model, its sampling
parameters, prompt / cached / completion token counts, time in queue, time to first token and
end-to-end latency. A request carrying a W3C `traceparent` header continues the caller's trace:
`RequestGuard` makes its context current for the request (`attach_request_context`), and the
span is that context's child.

The SDK and the OTLP exporter are an optional extra (`pip install jaxllm[tracing]`): a server
asked to trace without them refuses to start, saying what to install.
"""

from __future__ import annotations

import time

INSTALL_HINT = "tracing needs OpenTelemetry's SDK and OTLP exporter: pip install 'jaxllm[tracing]'"


def _exporter(endpoint: str):
    """The OTLP span exporter for `endpoint` (HTTP/protobuf; gRPC when the URL says grpc:// and
    that exporter is installed)."""
    if endpoint.startswith("grpc://"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint.removeprefix("grpc://"), insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Spans for finished engine requests, sent through `processor` (a span processor of the SDK:
    batching for OTLP, or whatever a test gives)."""

    def __init__(self, processor, service_name: str = "jaxllm"):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("jaxllm")

    @classmethod
    def to_endpoint(cls, endpoint: str) -> RequestTracer:
        try:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            return cls(BatchSpanProcessor(_exporter(endpoint)))
        except ImportError as e:
            raise ValueError(f"{INSTALL_HINT} ({e})") from None

    def record(self, out, params, parent_context, ended: str | None = None) -> None:
        """One ended request (`RequestOutput` with its times) as spans, children of
        `parent_context` (an OpenTelemetry context, or None)."""
        from opentelemetry import trace

        times = out.metrics or {}
        arrival = times.get("arrival_time")
        if arrival is None:
            return
        scheduled, first, last = (times.get(k) for k in ("scheduled_time", "first_token_time", "last_token_time"))
        end = last or time.monotonic()
        to_ns = _monotonic_to_epoch_ns()
        attributes = {
            "gen_ai.request.id": out.request_id,
            "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.cached_tokens": out.num_cached_tokens,
            "gen_ai.usage.completion_tokens": times.get("num_generation_tokens", 0),
            "gen_ai.latency.e2e": end - arrival,
            "jaxllm.finish_reason": ",".join(sorted({r for r in out.finish_reasons if r})) or ended or "unfinished",
        }
        if scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = scheduled - arrival
        if first is not None:
            attributes["gen_ai.latency.time_to_first_token"] = first - arrival
        for name in ("max_tokens", "temperature", "top_p", "n"):
            value = getattr(params, name, None)
            if value is not None:
                attributes[f"gen_ai.request.{name}"] = value
        span = self.tracer.start_span(
            "llm_request",
            context=parent_context,
            kind=trace.SpanKind.SERVER,
            start_time=to_ns(arrival),
            attributes=attributes,
        )
        child_context = trace.set_span_in_context(span, parent_context)
        phases = [("queue", arrival, scheduled), ("prefill", scheduled, first), ("decode", first, last)]
        for name, begin, finish in phases:
            if begin is not None and finish is not None:
                self.tracer.start_span(name, context=child_context, start_time=to_ns(begin)).end(end_time=to_ns(finish))
        span.end(end_time=to_ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()


def _monotonic_to_epoch_ns():
    """time.monotonic() seconds -> epoch nanoseconds, by the two clocks' offset now."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset


def attach_request_context(headers: list[tuple[bytes, bytes]]):
    """Make the caller's trace (a `traceparent` header) current for this request; the token to
    detach it with (None when the request carries none)."""
    carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    if "traceparent" not in carrier:
        return None
    from opentelemetry import context, propagate

    return context.attach(propagate.extract(carrier))


def detach_request_context(token) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)


def current_context():
    """The current OpenTelemetry context (the caller's trace, if attached)."""
    from opentelemetry import context

    return context.get_current()
