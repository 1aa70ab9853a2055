"""OpenAI-compatible HTTP server: `api_server` (FastAPI app, `jaxllm serve`) and `protocol`
(request and response bodies)."""
