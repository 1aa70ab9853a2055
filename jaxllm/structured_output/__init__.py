"""Structured output: grammars that constrain what a request may generate.

A request's `StructuredOutputsParams` (JSON schema, regex, choice, grammar) is compiled once
per distinct constraint by a grammar backend and cached; each request then gets its own
*matcher*, a copy of the compiled one that follows its output tokens. Each step the runner asks
the matchers of the step's constrained rows for a packed bitmask of the tokens allowed next
(`fill_masks`), and the jitted step masks those rows' logits before sampling
(runner/sampler.py). The scheduler feeds each matcher the tokens its request keeps and ends
the request with "stop" once the grammar is complete.

The backend sits behind the small `GrammarBackend` interface (backend.py); jaxllm ships
llguidance's (llguidance_backend.py). benchmarks/grammar_backends.py measures it against
xgrammar (docs/structured-output.md says why llguidance).
"""

from jaxllm.structured_output.backend import GrammarBackend, Matcher
from jaxllm.structured_output.manager import StructuredOutputManager, mask_words

__all__ = ["GrammarBackend", "Matcher", "StructuredOutputManager", "mask_words"]
