"""Prometheus metrics for the server, named as vLLM's (`vllm:x` -> `jaxllm:x`) so that existing
dashboards port over by changing the prefix, and the server's log lines about the work.

Gauges and counters are read from the engine at scrape time (the engine keeps the counts;
nothing is double-booked here). Latency histograms are observed by the server as each
request's outputs stream past, from the engine's own timestamps (`RequestOutput.metrics`,
time.monotonic() taken on the engine thread); the same pass logs one line per finished
request. `StatLogger` logs the engine's throughput, queue and KV cache every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.entrypoints import tracing

from jaxllm.outputs import RequestOutput

logger = logging.getLogger("jaxllm.server")

PREFIX = "jaxllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCounters:
    """Collector that reports the engine's cumulative counters as Prometheus counters."""

    def __init__(self, engine, labels: dict[str, str]):
        self.engine = engine
        self.labels = labels

    def _counter(self, name: str, doc: str, value: float, **extra: str) -> CounterMetricFamily:
        labels = {**self.labels, **extra}
        family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    def collect(self):
        engine = self.engine
        stats, (queries, hits) = engine.stats, engine.prefix_cache_tokens
        yield self._counter("prompt_tokens", "Prefill tokens processed.", stats.prompt_tokens)
        yield self._counter("generation_tokens", "Generation tokens processed.", stats.generation_tokens)
        yield self._counter("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield self._counter("weight_updates", "Weight updates taken (update_weights).", engine.num_weight_updates)
        version = GaugeMetricFamily(
            PREFIX + "weight_version_info", "The weight version serving (always 1).", labels=[*self.labels, "version"]
        )
        version.add_metric([*self.labels.values(), str(engine.weight_version)], 1)
        yield version
        yield self._counter("prefix_cache_queries", "Prefix cache queries, in tokens.", queries)
        yield self._counter("prefix_cache_hits", "Prefix cache hits, in tokens.", hits)
        yield self._counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", stats.num_draft_tokens
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.", stats.num_accepted_tokens
        )
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Count of finished requests, by finish reason.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason, count in sorted(dict(stats.finished).items()):  # dict(): the engine thread may add a key
            success.add_metric([*self.labels.values(), reason], count)
        yield success
        if engine.config.lora is not None:  # vLLM's: the adapters in use, as labels (value 1)
            running, waiting = engine.lora_adapters_in_use()
            names = [*self.labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"]
            info = GaugeMetricFamily(PREFIX + "lora_requests_info", "LoRA adapters in use (always 1).", labels=names)
            info.add_metric(
                [*self.labels.values(), ",".join(running), ",".join(waiting), str(engine.config.lora.max_loras)], 1
            )
            yield info


class ServerMetrics:
    """All of one server's metrics, in a registry of its own (so several apps, or tests, can
    live in one process)."""

    def __init__(self, engine, model_name: str, tracer=None):
        disable_created_metrics()  # no `_created` series (process-wide; vLLM does the same)
        self.tracer = tracer  # (entrypoints/tracing.py's RequestTracer, with --otlp-traces-endpoint)
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def gauge(name: str, doc: str, read) -> None:
            Gauge(PREFIX + name, doc, names, registry=self.registry).labels(**labels).set_function(read)

        gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            lambda: engine.num_running_requests,
        )
        gauge(
            "num_requests_waiting", "Number of requests waiting to be processed.", lambda: engine.num_waiting_requests
        )
        gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: engine.kv_cache_usage)
        gauge("engine_sleep_level", "0 awake; 1 KV pool freed; 2 weights dropped too.", lambda: engine.sleep_level)
        self.registry.register(_EngineCounters(engine, labels))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.", REQUEST_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent waiting in the queue, in seconds.", REQUEST_BUCKETS
        )

    async def track(
        self, outputs: AsyncIterator[RequestOutput], log: bool = True, params=None
    ) -> AsyncIterator[RequestOutput]:
        """Pass one request's outputs through, observing its latencies, and (`log`) log a line
        when it ends, and with a tracer record its spans (`params`: its sampling parameters).
        Expects one output per engine step (output_kind "delta" or "cumulative"), so the gap
        between two outputs' `last_token_time` is an inter-token latency."""
        last_token_time, last, ended = None, None, None
        trace_parent = tracing.current_context() if self.tracer is not None else None
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    times = out.metrics or {}
                    now = times.get("last_token_time")
                    if last_token_time is not None and now is not None and now > last_token_time:
                        self.inter_token_latency.observe(now - last_token_time)
                    last_token_time, last = now, out
                    if out.finished and "abort" not in out.finish_reasons:
                        self._observe_finished(times)
                    yield out
        except (GeneratorExit, asyncio.CancelledError):
            ended = "client gone"
            raise
        except Exception:
            ended = "failed"
            raise
        finally:
            if log and last is not None:
                log_request(last, ended)
            if self.tracer is not None and last is not None:
                self.tracer.record(last, params, trace_parent, ended)

    def _observe_finished(self, times: dict) -> None:
        arrival = times.get("arrival_time")
        if arrival is None:
            return
        if times.get("first_token_time") is not None:
            self.time_to_first_token.observe(times["first_token_time"] - arrival)
        if times.get("scheduled_time") is not None:
            self.request_queue_time.observe(times["scheduled_time"] - arrival)
        if times.get("last_token_time") is not None:
            self.e2e_request_latency.observe(times["last_token_time"] - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def log_request(out: RequestOutput, ended: str | None = None) -> None:
    """One INFO line for a request that ended: id, tokens, TTFT, end-to-end time and finish
    reason (`ended` says why a request that did not finish stopped)."""
    times = out.metrics or {}
    arrival, first, last = times.get("arrival_time"), times.get("first_token_time"), times.get("last_token_time")
    reasons = sorted({r for r in out.finish_reasons if r}) if out.finished else []
    seconds = lambda t: f"{t - arrival:.3f} s" if arrival is not None and t else "-"  # noqa: E731
    logger.info(
        "request %s: %d prompt tokens (%d cached), %d output tokens, TTFT %s, e2e %s, finish %s",
        out.request_id,
        len(out.prompt_token_ids),
        out.num_cached_tokens,
        times.get("num_generation_tokens", 0),
        seconds(first),
        seconds(last or time.monotonic()),
        ",".join(reasons) or ended or "unfinished",
    )


class StatLogger:
    """Logs the engine's state every `interval` seconds while it has work (or had some since
    the last line), as vLLM does: prompt and generation throughput, running and waiting
    requests, KV cache usage and the prefix cache hit rate over the interval."""

    def __init__(self, engine, interval: float):
        self.engine, self.interval = engine, interval
        self._last = self._read()

    def _read(self) -> tuple[float, int, int, int, int]:
        stats, (queries, hits) = self.engine.stats, self.engine.prefix_cache_tokens
        return time.monotonic(), stats.prompt_tokens, stats.generation_tokens, queries, hits

    def log(self) -> None:
        """One line, unless the engine was idle throughout the interval."""
        engine = self.engine
        now = self._read()
        seconds, prompt, generation, queries, hits = (b - a for a, b in zip(self._last, now))
        seconds = max(seconds, 1e-9)
        self._last = now
        running, waiting = engine.num_running_requests, engine.num_waiting_requests
        if not (prompt or generation or running or waiting):
            return
        logger.info(
            "engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
            "prefix cache hit rate %.1f%%",
            prompt / seconds,
            generation / seconds,
            running,
            waiting,
            100 * engine.kv_cache_usage,
            100 * hits / queries if queries else 0.0,
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log()
