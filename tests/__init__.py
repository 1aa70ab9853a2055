"""jaxllm's tests: one folder per area, shared helpers in tests/helpers (docs/testing.md)."""
