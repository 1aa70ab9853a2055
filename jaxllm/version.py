"""jaxllm's version (pyproject.toml reads it from here), importable from every layer."""

__version__ = "0.1.0"
