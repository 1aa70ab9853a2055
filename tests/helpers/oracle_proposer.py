"""A speculative-decoding proposer that drafts from known continuations, for tests."""

from __future__ import annotations

from jaxllm.spec_decode.proposer import Proposer


class OracleProposer(Proposer):
    """Drafts from known continuations (a tiny random model never repeats itself, so n-gram
    drafts would all be rejected): the true next tokens, with every `wrong_every`-th draft
    position replaced by a wrong token (the next id, modulo `vocab`), so steps accept all, some
    or none of their drafts."""

    def __init__(self, sequences, k=4, wrong_every=3, vocab=1000):
        self.sequences, self.k, self.wrong_every, self.vocab, self.calls = sequences, k, wrong_every, vocab, 0
        self.num_speculative_tokens = k

    def propose(self, tokens, k):
        self.calls += 1
        tokens = tokens.tolist()
        for seq in self.sequences:
            if seq[: len(tokens)] == tokens:
                drafts = seq[len(tokens) : len(tokens) + min(k, self.k)]
                cut = self.calls % self.wrong_every
                return [t if j != cut else (t + 1) % self.vocab for j, t in enumerate(drafts)]
        return []
