"""ServerArgs: the HTTP server's options, with limits that keep any one client from hurting the others.

Like `EngineArgs`, each field carries its CLI help (the `jaxllm serve` flags are built from the
fields). Names follow vLLM where vLLM has the option, and uvicorn where the option is uvicorn's.
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import option

# Paths served without the API key: nothing behind them runs the model or its tokenizer.
OPEN_PATHS = frozenset(
    {"/", "/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)


@dataclasses.dataclass
class ServerArgs:
    host: str = option("127.0.0.1", "address to listen on; 0.0.0.0 for every interface")
    port: int = option(8000, "0 picks a free port")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route that runs the model or its tokenizer "
        "(/health, /metrics and /version stay open). Default: $JAXLLM_API_KEY, else no key",
        metavar="KEY",
    )
    trust_request_chat_template: bool = option(
        False,
        "let requests bring their own `chat_template` (a Jinja template from the network is code; it is "
        "still rendered sandboxed and time-bounded)",
    )
    max_request_body_bytes: int = option(
        16 << 20, "largest request body, e.g. 16MiB; larger ones get 413", metavar="SIZE", size=True
    )
    max_prompts_per_request: int = option(256, "most prompts in one /v1/completions request", metavar="N")
    max_embedding_inputs: int = option(
        2048, "most inputs in one /v1/embeddings or /pooling request (OpenAI's limit)", metavar="N"
    )
    max_stop_strings: int = option(64, "most `stop` strings in one request", metavar="N")
    max_stream_backlog: int = option(
        4096,
        "outputs (engine steps) buffered for a streaming client that reads slower than the engine writes; "
        "a client that falls further behind (or stops reading without closing) has its request stopped",
        metavar="N",
    )
    max_waiting_requests: int = option(
        1024, "most requests queued beyond a full batch; more get 429 with Retry-After", metavar="N"
    )
    limit_concurrency: int = option(1024, "most open connections; more get 503 (uvicorn's option)", metavar="N")
    timeout_keep_alive: int = option(
        30,
        "seconds an idle keep-alive connection stays open (uvicorn's option); keep it above clients' own "
        "idle expiry (httpx and the openai client: 5 s), or a client may send a request on a connection "
        "the server is closing that moment, and get a connection error",
        metavar="SECONDS",
    )
    request_read_timeout: float = option(
        30.0,
        "seconds a client has to send a request's headers and body; slower connections are closed",
        metavar="SECONDS",
    )
    max_header_bytes: int = option(
        16 << 10, "largest request head (request line and headers)", metavar="SIZE", size=True
    )
    shutdown_timeout: float = option(
        30.0,
        "on SIGTERM, seconds running requests get to finish before their streams are ended with an error event",
        metavar="SECONDS",
    )
    enable_auto_tool_choice: bool = option(
        False,
        "let the model decide when to call tools (tool_choice 'auto', the default with tools): its output "
        "is parsed with --tool-call-parser",
    )
    tool_call_parser: str | None = option(
        None,
        "the model family's tool-call format: hermes (Hermes, Qwen), llama3_json (Llama 3.x), mistral. "
        "Default: none (tool_choice 'auto' is refused)",
        choices=("hermes", "llama3_json", "mistral"),
    )
    reasoning_parser: str | None = option(
        None,
        "split a thinking model's output into `reasoning_content` and `content` (chat completions): "
        "deepseek_r1 (DeepSeek-R1 and its distills) or qwen3 (Qwen3, QwQ); tool calls and structured output "
        "then apply to the content. Default: none",
        choices=("deepseek_r1", "qwen3"),
    )
    structured_outputs_in_reasoning: bool = option(
        False,
        "with --reasoning-parser, constrain the whole output, the reasoning included, rather than the "
        "content after it (vLLM's structured_outputs_config.enable_in_reasoning)",
    )
    disable_playground: bool = option(False, "do not serve the chat playground page at /")
    enable_weight_updates: bool = option(
        False,
        "serve POST /update_weights (new weights from a checkpoint path), POST /sleep, POST /wake_up and "
        "GET /is_sleeping, for a trainer beside the server; needs --api-key",
    )
    lora_modules: list[str] | None = option(
        None,
        "LoRA adapters to serve from the start (with --enable-lora), each NAME=PATH (a PEFT directory) or a "
        'JSON object {"name": ..., "path": ...}; a request\'s `model` NAME runs under it. Adapters are also '
        "loaded and unloaded at runtime (POST /v1/load_lora_adapter, /v1/unload_lora_adapter; needs --api-key). "
        "Default: none",
        metavar="NAME=PATH",
        nargs="+",
        type=str,
    )
    responses_store_size: int = option(
        1024,
        "responses kept in memory for /v1/responses' previous_response_id (with store, its default), the "
        "least recently used dropped; 0 keeps none",
        metavar="N",
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "send an OpenTelemetry trace of each request (spans queue, prefill, decode; token counts, TTFT) to "
        "this OTLP endpoint (HTTP/protobuf, e.g. http://localhost:4318/v1/traces; grpc://host:4317 for gRPC); "
        "a `traceparent` header continues the caller's trace. Needs jaxllm[tracing]. Default: no tracing",
        metavar="URL",
    )
    disable_log_requests: bool = option(
        False, "do not log a line per finished request (id, tokens, TTFT, end-to-end time, finish reason)"
    )
    disable_log_stats: bool = option(
        False, "do not log the engine's throughput, queue and KV cache usage every --log-stats-interval"
    )
    log_stats_interval: float = option(10.0, "seconds between two engine stats lines", metavar="SECONDS")
    uvicorn_log_level: str = option(
        "info",
        "uvicorn's log level; 'info' logs every request",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )

    def verify(self) -> None:
        for name in (
            "max_request_body_bytes",
            "max_prompts_per_request",
            "max_stop_strings",
            "max_stream_backlog",
            "limit_concurrency",
            "max_header_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_waiting_requests", "timeout_keep_alive", "responses_store_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        for name in ("request_read_timeout", "shutdown_timeout", "log_stats_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
