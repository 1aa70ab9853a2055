"""What the scheduler asks of a proposer: drafts for a batch of running requests."""

from __future__ import annotations

import numpy as np


class Proposer:
    """Fills `Request.spec_token_ids`. A proposer that drafts one request at a time needs only
    `propose(tokens, room) -> drafts`; a model-based one overrides `propose_batch`."""

    num_speculative_tokens: int

    def propose(self, tokens: np.ndarray, room: int) -> list[int]:
        raise NotImplementedError

    def warmup(self, progress: bool, background: bool) -> float:
        """Compile what the proposer runs (a draft model's steps); seconds taken."""
        return 0.0

    def propose_batch(self, requests: list, rooms: list[int]) -> None:
        """Drafts for each request: at most num_speculative_tokens and `rooms[i]` of them (the
        scheduler has allocated KV pages for that many past the request's tokens)."""
        for request, room in zip(requests, rooms):
            request.spec_token_ids = self.propose(np.asarray(request.all_token_ids), room)
