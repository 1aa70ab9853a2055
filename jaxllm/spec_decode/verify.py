"""After a verification step: which drafts each request keeps."""

from __future__ import annotations

import numpy as np


def accepted_counts(tokens: np.ndarray, first: np.ndarray, count: np.ndarray, scheduled) -> np.ndarray:
    """How many of each request's sampled rows it keeps: with drafts, row j's token is kept
    while row j - 1's equalled draft j (the sampler returns the draft exactly when it accepts
    it), so a request keeps its accepted drafts and one token more."""
    count = count.copy()
    for i in np.flatnonzero(count > 1):
        drafts = scheduled[i][0].spec_token_ids
        j = 0
        while j < count[i] - 1 and tokens[first[i] + j] == drafts[j]:
            j += 1
        count[i] = j + 1
    return count
