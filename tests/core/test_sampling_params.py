"""SamplingParams validation: anything accepted is finite, in range and fits the device-side
arrays; everything else is a ValueError naming the field (property-based, with hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxllm.core.request import Request
from jaxllm.runner.input_batch import InputBatch, SamplingMetadata
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

VOCAB = 1000
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**40), 10**40),
    st.sampled_from([0, 1, -1, 0.5, 2**31, 2**63, 1e308, -0.0]),
)
INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63]),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
)
FIELDS = {
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "min_p": NUMBERS,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "repetition_penalty": NUMBERS,
    "top_k": INTS,
    "n": INTS,
    "seed": INTS,
    "max_tokens": INTS,
    "min_tokens": INTS,
    "logprobs": INTS,
}


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional=FIELDS))
@example({"max_tokens": None, "min_tokens": 2**40, "top_k": 2**31, "seed": -(2**70)})
def test_accepted_params_are_sane_and_fit_the_device_arrays(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert any(name in str(e) for name in FIELDS), e
        return
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert np.isfinite(np.float32(getattr(params, name)))
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and 0 <= params.min_p <= 1
    assert params.n >= 1 and params.top_k >= -1 and params.min_tokens >= 0
    assert params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS
    # The runner's per-row arrays hold whatever was accepted (top_k clamped to the vocabulary).
    batch = InputBatch(2, 64, 4, 16, VOCAB)
    request = Request("r", [1, 2, 3], params, seed=params.seed if params.seed is not None else 7)
    request.page_ids = [0]
    rows = batch.rows_for([request])
    out = SamplingMetadata.zeros(2)
    batch.fill_sampling(out, rows, np.full((2, 64), -1, np.int32))
    assert 0 <= out.top_k[0] <= VOCAB
    assert out.top_k[0] == (min(params.top_k, VOCAB) if params.top_k > 0 else 0)
    assert np.isfinite(out.temperature[0]) and np.isfinite(out.repetition_penalty[0])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e300), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(presence_penalty=float("-inf")), "presence_penalty"),
        (dict(temperature="0.5"), "temperature"),
        (dict(top_k=1.5), "top_k"),
        (dict(n=True), "n"),
        (dict(max_tokens=2.0), "max_tokens"),
    ],
)
def test_non_finite_or_mistyped_values_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
