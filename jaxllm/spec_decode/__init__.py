"""Speculative decoding: proposers of draft tokens, which the target model verifies in one step.

`SpeculativeConfig` (jaxllm/speculative_config.py) picks the method; `make_proposer` builds its proposer.
How a step verifies drafts (in the fixed-shape step, with exact rejection sampling) is in
runner/sampler.py and core/scheduler.py; ARCHITECTURE.md has the whole picture.
"""

from jaxllm.spec_decode.draft_model import DraftModelProposer
from jaxllm.spec_decode.ngram import NgramProposer
from jaxllm.spec_decode.proposer import Proposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer"]
