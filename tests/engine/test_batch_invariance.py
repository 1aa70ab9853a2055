"""`batch_invariant=True`: a request's tokens and logprobs are bit-identical whatever shares its
steps, however its prompt is chunked and whether its prefix comes from the prefix cache, in bf16
(where the GEMMs' AMX and `vdpbf16ps` paths sum in different orders) and in float32. The
reference is the same engine code run one request at a time, unchunked and uncached."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.kernels import native
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, build_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")
BUILD_PATHS = native.kernel_paths() if native.available() else ()

PREFIX = [(37 * i + 11) % 40000 + 100 for i in range(150)]  # a shared 150-token "system prompt"
PROMPTS = [PREFIX + [(101 * i + 7 * j) % 40000 + 100 for j in range(3 + 5 * i)] for i in range(8)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, detokenize=False),
    SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True, logprobs=2, detokenize=False),
]


@pytest.fixture(scope="module")
def wide_heads_dir(tmp_path_factory) -> str:
    """The tiny model's shape with head_dim 64 (2 heads over hidden 128): the attention kernel's
    AVX2 path, where head_dim 16 takes the portable one."""
    return build_tiny_model(str(tmp_path_factory.mktemp("wide") / "tiny-llama-hd64"), hidden_size=128, num_heads=2)


def run(llm: LLM, prompts, one_at_a_time: bool) -> list[tuple]:
    """(token ids, every reported logprob) per (prompt, params)."""
    jobs = [({"prompt_token_ids": p}, params) for p in prompts for params in PARAMS]
    if one_at_a_time:
        outs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in jobs]
    else:
        outs = llm.generate([prompt for prompt, _ in jobs], [params for _, params in jobs], use_tqdm=False)
    return [
        (
            tuple(o.outputs[0].token_ids),
            tuple(lp.logprob for entry in o.outputs[0].logprobs for lp in entry.values()),
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    "model,dtype,amx",
    [
        ("head_dim_16", "bfloat16", True),
        ("head_dim_64", "bfloat16", True),
        ("head_dim_64", "bfloat16", False),
        ("head_dim_16", "float32", False),
    ],
    ids=["hd16-bf16-amx-if-any", "hd64-bf16-amx-if-any", "hd64-bf16-avx512", "hd16-f32"],
)
def test_tokens_and_logprobs_do_not_depend_on_batch_chunks_or_cache(
    tiny_model_dir, wide_heads_dir, model, dtype, amx, monkeypatch
):
    model_dir = tiny_model_dir if model == "head_dim_16" else wide_heads_dir
    if dtype == "bfloat16" and not native.has_bf16_dots():
        pytest.skip("no AVX512_BF16: bf16 runs through XLA's dots, which the mode refuses")
    if not amx:  # what a CPU without AMX runs: the plan then pins `vdpbf16ps` (avx512)
        monkeypatch.setattr(native, "kernel_paths", lambda: tuple(p for p in BUILD_PATHS if p != "amx"))
    args = {**TINY_ENGINE_ARGS, "dtype": dtype, "batch_invariant": True}
    alone = LLM(model_dir, **{**args, "enable_prefix_caching": False, "max_num_batched_tokens": 256})
    assert alone.engine.runner.attention.path != "auto"
    pinned = {"float32": "auto", "bfloat16": "amx" if amx and "amx" in BUILD_PATHS else "avx512"}[dtype]
    assert alone.engine.runner.params["layers"][0]["wqkv"].path == pinned
    want = run(alone, PROMPTS, one_at_a_time=True)
    del alone
    # Together (neighbours in every step), in chunks of at most 48 tokens (prompt tiles of other
    # sizes than alone), with the shared prefix cached.
    together = LLM(model_dir, **{**args, "max_num_batched_tokens": 48})
    got = run(together, PROMPTS, one_at_a_time=False)
    assert together.engine.prefix_cache_tokens[1] > 0  # hits happened
    assert got == want
    # And in reverse order, the cache warm: other neighbours, other chunk boundaries.
    reverse = run(together, PROMPTS[::-1], one_at_a_time=False)
    expected = [want[2 * i + j] for i in reversed(range(len(PROMPTS))) for j in range(len(PARAMS))]
    assert reverse == expected


def test_the_mode_is_refused_where_it_cannot_hold(tiny_model_dir):
    with pytest.raises(ValueError, match="batch_invariant needs the C\\+\\+ GEMMs"):
        LLM(tiny_model_dir, **TINY_ENGINE_ARGS, batch_invariant=True, packed_weights=False)
    with pytest.raises(ValueError, match="native attention backend"):
        LLM(tiny_model_dir, **TINY_ENGINE_ARGS, batch_invariant=True, attention_backend="reference")
