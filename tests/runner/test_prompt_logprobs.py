"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against HF transformers' log-softmax over
the same prompt: whole and chunked prompts, prefix-cache hits, preemption, `n > 1`."""

import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams

from tests.helpers.tiny_model import TINY_ENGINE_ARGS

PROMPTS = [
    "The capital of France is",
    "In 1492, a sailor from Genoa crossed the ocean and found a continent that nobody in Europe had heard of",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning walked",
]


def hf_prompt_logprobs(model, prompt_ids):
    """[P - 1, vocab] log-softmax of HF's logits predicting prompt tokens 1.."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).numpy()


def check(out, hf_model, k):
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    ref = hf_prompt_logprobs(hf_model, ids)
    for p, (token, entry) in enumerate(zip(ids[1:], out.prompt_logprobs[1:])):
        row = ref[p]
        assert entry[token].logprob == pytest.approx(row[token], abs=2e-4)
        # Rank: 1 + the tokens HF puts above it; only tokens within float32 noise of it may
        # land on the other side (`near` counts them; usually none or a few).
        hf_rank = 1 + int((row > row[token]).sum())
        near = int((np.abs(row - row[token]) <= 2e-4).sum()) - 1
        assert abs(entry[token].rank - hf_rank) <= near, (entry[token].rank, hf_rank, near)
        top = {t: lp for t, lp in entry.items() if lp.rank <= k}  # the k best (the prompt token may be one)
        assert len(top) == k
        np.testing.assert_allclose(
            sorted((lp.logprob for lp in top.values()), reverse=True), np.sort(row)[::-1][:k], atol=2e-4
        )
        assert set(top) <= set(np.argsort(-row)[: k + 1].tolist())
        assert entry[token].decoded_token is not None


def test_prompt_logprobs_match_hf(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, logprobs=2)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        check(out, hf_model, 3)
        assert len(out.outputs[0].token_ids) == 4


def test_prompt_logprobs_over_chunks_cache_hits_and_preemption(llm, hf_model, tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=2, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    # Chunks of 8 tokens: each prompt's logprobs come from several steps.
    chunked = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "max_num_batched_tokens": 8, "max_num_seqs": 8})
    # A pool too small for all at once: the newest are preempted and recomputed.
    small = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16, "block_size": 4})
    for engine in (chunked, small):
        engine.generate(PROMPTS, plain, use_tqdm=False)  # the prompts' pages now sit in the prefix cache
        outs = engine.generate(PROMPTS, params, use_tqdm=False)
        for out, ref in zip(outs, reference):
            check(out, hf_model, 2)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert small.engine.stats.num_preemptions > 0
    assert small.engine.kv_cache_manager.num_used_pages == 0


def test_prompt_logprobs_with_n_choices_and_a_one_token_prompt(llm, hf_model):
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1), use_tqdm=False
    )[0]
    check(out, hf_model, 1)
    assert len(out.outputs) == 3
    one = llm.generate([[1]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_rejected(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
