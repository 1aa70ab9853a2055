"""OpenAI-compatible HTTP server: `api_server` (FastAPI app, `jaxllm serve`), the handlers by route
group (`serving_completion`, `serving_chat`, `serving_tokenization`, over `serving_engine` and
`serving_utils`), and `protocol` (request and response bodies)."""
