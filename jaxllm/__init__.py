"""jaxllm: LLM inference and serving in JAX (PagedAttention, continuous batching)."""

from jaxllm.config import EngineArgs
from jaxllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
from jaxllm.version import __version__


def __getattr__(name):
    # The engine pulls in the model loader (transformers): import it on first use.
    if name == "LLM":
        from jaxllm.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from jaxllm.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name == "LLMEngine":
        from jaxllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


__all__ = [
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "LLM",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
