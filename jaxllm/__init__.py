"""jaxllm: LLM inference and serving in JAX (PagedAttention, continuous batching)."""

from jaxllm.config import EngineArgs
from jaxllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxllm.lora import LoRARequest
from jaxllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import LogitsProcessor, SamplingParams, StructuredOutputsParams
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
    "LoRARequest",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLM",
    "LLMEngine",
    "Logprob",
    "LogitsProcessor",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "__version__",
]
