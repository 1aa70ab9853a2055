"""Speculative decoding (n-gram proposals verified in the step): the proposer on hand-made
sequences, rejection sampling against the exact target distribution, and the engine's
outputs with speculation equal to those without it."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.runner import input_batch, sampler
from jaxllm.runner.compile import Bucket, CompilationCounter
from jaxllm.spec_decode.ngram import propose_ngram

from tests.helpers.oracle_proposer import OracleProposer
from tests.helpers.sampling_reference import LOGITS, V, reference_probs, state
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, WARM_ENGINE_ARGS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expect",
    [
        ([1, 2, 3, 4, 1, 2], 1, 3, 3, [3, 4, 1]),  # "1 2" seen before: what followed it
        ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, 2, 2, [7, 2]),  # the most recent of two matches
        ([5, 1, 2, 3, 6, 0, 2, 3, 8, 1, 2, 3], 1, 3, 2, [6, 0]),  # the longest n wins over a nearer short match
        ([1, 2, 3, 4], 1, 3, 3, []),  # nothing repeats
        ([7, 7, 7], 1, 2, 4, [7]),  # a match near the end proposes what there is
        ([4, 5, 4], 2, 3, 2, []),  # only a 1-gram repeats, below min_n
    ],
)
def test_ngram_proposals(tokens, min_n, max_n, k, expect):
    assert propose_ngram(np.asarray(tokens), min_n, max_n, k).tolist() == expect


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, top_k=6), dict(top_p=0.8)])
@pytest.mark.parametrize("draft", [0, 3, 11])
def test_rejection_sampling_keeps_the_target_distribution(kw, draft):
    # Every row proposes `draft`: accepted with its target probability, else a token drawn from
    # the rest; the tokens' frequencies must be the target's whatever the draft.
    S = 6000
    st = dataclasses.replace(state(S, **kw), draft_tokens=np.full(S, draft, np.int32))
    st.flags[input_batch.FLAG_DRAFTS] = True
    tokens, *_ = jax.jit(sampler.sample)(np.tile(LOGITS, (S, 1)), st)
    freq = np.bincount(np.asarray(tokens), minlength=V) / S
    expect = reference_probs(LOGITS, **kw)
    assert np.all(freq[expect == 0] == 0), "a token outside the kept set was sampled"
    tolerance = 4 * np.sqrt(expect * (1 - expect) / S) + 1e-3
    assert np.all(np.abs(freq - expect) <= tolerance), (freq, expect)


def test_greedy_rows_accept_only_the_argmax():
    S = 4
    st = dataclasses.replace(state(S, temperature=0.0), draft_tokens=np.array([0, 1, -1, 5], np.int32))
    st.flags[input_batch.FLAG_DRAFTS] = True
    tokens, *_ = jax.jit(sampler.sample)(np.tile(LOGITS, (S, 1)), st)
    assert np.asarray(tokens).tolist() == [0] * S


PROMPTS = [
    "The capital of France is",
    "one two three four five six seven one two three four five six seven",
    "In 1492, a sailor from Genoa crossed the ocean and found a continent that",
    "abc abc abc abc abc",
]


def greedy(max_tokens=32, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir):
    return LLM(tiny_model_dir, **WARM_ENGINE_ARGS, speculative_config=NGRAM)  # the compile count below


def test_greedy_with_speculation_equals_without(llm, spec_llm, monkeypatch):
    params = greedy(logprobs=2)
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = spec_llm.engine.stats
    drafts0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
    # Real n-gram drafts (here mostly rejected), then oracle drafts, alone (one sequence per
    # step) and together (several per step).
    speculative = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(
        spec_llm.engine.scheduler,
        "proposer",
        OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids for o in plain]),
    )
    with CompilationCounter() as compiles:
        speculative += [spec_llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
        speculative += spec_llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(speculative, plain * 3):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            np.testing.assert_allclose(
                [x.logprob for x in lp_a.values()], [x.logprob for x in lp_b.values()], atol=1e-4
            )
    drafted, accepted = stats.num_draft_tokens - drafts0, stats.num_accepted_tokens - accepted0
    assert compiles.count == 0  # every verification shape was compiled at start-up
    assert 0.15 * drafted < accepted < drafted  # drafts fully, partly and not at all accepted
    assert spec_llm.engine.kv_cache_manager.num_used_pages == 0


def test_speculation_with_stops_chunks_preemption_and_sampling(llm, tiny_model_dir, monkeypatch):
    reference = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    oracle = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids for o in reference])
    # Small pool and small token budget: prompts chunked, sequences preempted mid-speculation.
    small = LLM(
        tiny_model_dir,
        **{**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16, "block_size": 4, "max_num_batched_tokens": 16},
        speculative_config=NGRAM,
    )
    monkeypatch.setattr(small.engine.scheduler, "proposer", oracle)
    outs = small.generate(PROMPTS, greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert small.engine.stats.num_preemptions > 0 and small.engine.stats.num_accepted_tokens > 0
    # max_tokens and stop tokens cut a step's accepted tokens short.
    full = reference[0].outputs[0].token_ids
    cut = small.generate(PROMPTS[:1], greedy(24, stop_token_ids=[full[9]]), use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == full[: full.index(full[9]) + 1] and cut.finish_reason == "stop"
    short = small.generate(PROMPTS[:1], greedy(5), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == full[:5] and short.finish_reason == "length"
    # A stop string found mid-step: the text and tokens end where they end without speculation.
    text = reference[2].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expect = llm.generate(PROMPTS[2:3], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    got = small.generate(PROMPTS[2:3], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (expect.text, expect.token_ids, "stop")
    # Seeded sampling with drafts stays reproducible, and n > 1 works.
    seeded = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    a, b = (small.generate(PROMPTS, seeded, use_tqdm=False) for _ in range(2))
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 24 for o in a for c in o.outputs)
    assert small.engine.kv_cache_manager.num_used_pages == 0


def test_draft_model_speculation(llm, tiny_model_dir, tmp_path):
    # The target itself as its draft: every greedy draft is right. A different (1-layer) random
    # model, quantized on load as the config asks: drafts mostly wrong. Either way the outputs
    # are the target's; a small token budget and pool make the draft catch up over prompt
    # chunks and after preemptions. With every draft accepted the draft catches up on two
    # tokens a round (its last draft and the target's), in its own 2-token buckets; its next
    # drafts decode the one before still on the device (steps dispatched ahead of its tokens).
    from jaxllm.quantization import QuantizedWeight
    from tests.helpers.tiny_model import build_tiny_model

    reference = llm.generate(PROMPTS, greedy(24, logprobs=1), use_tqdm=False)
    other = build_tiny_model(str(tmp_path / "draft"), num_layers=1)
    for draft, small in ((tiny_model_dir, False), (other, True)):
        args = {**TINY_ENGINE_ARGS, "max_num_batched_tokens": 16} if small else TINY_ENGINE_ARGS
        if small:
            args = {**args, "num_gpu_blocks_override": 24, "block_size": 4}
        config = {"model": draft, "num_speculative_tokens": 3, **({"quantization": "int4"} if small else {})}
        engine = LLM(tiny_model_dir, **args, speculative_config=config)
        runner = engine.engine.scheduler.proposer.runner
        used, call = [], runner.call
        runner.call = lambda bucket, *a: used.append(bucket) or call(bucket, *a)
        chained, dispatch = [], runner.dispatch
        runner.dispatch = lambda out, ahead=None, prev=None: (
            chained.append(ahead is not None) or dispatch(out, ahead, prev)
        )
        draft_wqkv = runner.params["layers"][0]["wqkv"]
        assert isinstance(draft_wqkv, QuantizedWeight) == small and engine.engine.config.quantization is None
        # (codes quantized on load factor their scales in a draft: its numbers only pick drafts)
        assert not small or draft_wqkv.factored == (draft_wqkv.layout == "panels")
        outs = engine.generate(PROMPTS, greedy(24, logprobs=1), use_tqdm=False)
        alone = engine.generate(PROMPTS[:1], greedy(24, logprobs=1), use_tqdm=False)
        for a, b in zip(outs + alone, reference + reference[:1]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        stats = engine.engine.stats
        if not small:
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # its own drafts: all accepted
            assert 0 < chained.count(True) < len(chained)
            catch_up = Bucket(2, 1, 1, 1)  # (the target's 2-token buckets verify: all_logits)
            assert catch_up in runner.buckets and catch_up not in engine.engine.runner.buckets
            runner.steps.get(catch_up)  # compiled now (the steps take the smallest ready bucket)
            used.clear()
            assert engine.generate(PROMPTS[:1], greedy(24, logprobs=1), use_tqdm=False)[0].outputs[0].token_ids == (
                reference[0].outputs[0].token_ids
            )
            assert used.count(catch_up) > 1
        else:
            assert stats.num_draft_tokens > 0 and stats.num_preemptions > 0
        assert engine.engine.kv_cache_manager.num_used_pages == 0
    with pytest.raises(ValueError, match="vocabulary"):
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(other)
        cfg.vocab_size = 1000
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "small-vocab")
        LLM(
            tiny_model_dir,
            **TINY_ENGINE_ARGS,
            speculative_config={"model": str(tmp_path / "small-vocab"), "num_speculative_tokens": 2},
        )


def test_a_draft_below_the_confidence_threshold_ends_its_round(llm, tiny_model_dir):
    # The target as its own draft: a draft's probability under the draft is the target's for that
    # token, which the run without speculation reports (its logprobs). With a threshold a round's
    # drafts end at its first draft below it, and the step dispatched ahead of reading that draft
    # adds one more; the outputs stay the target's.
    params = greedy(24, logprobs=1)
    reference = {p: llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in PROMPTS}
    probs = {p: [np.exp(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs)] for p, o in reference.items()}
    # The threshold in the widest gap between the middle half of those probabilities (so that
    # the draft's own rounding cannot move a draft across it).
    ps = np.sort(np.concatenate(list(probs.values())))
    mid = ps[len(ps) // 4 : 3 * len(ps) // 4 + 1]
    gap = int(np.argmax(mid[1:] / mid[:-1]))
    assert mid[gap + 1] / mid[gap] > 1.02
    threshold = float(np.sqrt(mid[gap] * mid[gap + 1]))
    config = {"model": tiny_model_dir, "num_speculative_tokens": 4, "draft_confidence_threshold": threshold}
    engine = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, speculative_config=config)
    proposer = engine.engine.scheduler.proposer
    rounds, propose = [], proposer.propose_batch

    def record(requests, rooms):
        propose(requests, rooms)
        rounds.extend((len(r.output_token_ids), room, len(r.spec_token_ids)) for r, room in zip(requests, rooms))

    proposer.propose_batch = record
    stopped = 0
    for prompt in PROMPTS:
        rounds.clear()
        assert engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == reference[prompt].token_ids
        for n, room, made in rounds:
            wanted = min(room, 4)
            low = [j for j in range(wanted) if probs[prompt][n + j] < threshold]
            assert made == (min(wanted, low[0] + 2) if low else wanted), (prompt, n, probs[prompt][n : n + wanted])
            stopped += bool(low) and low[0] + 2 < wanted
    assert stopped > 0  # some round ended early
    assert engine.engine.stats.num_accepted_tokens == engine.engine.stats.num_draft_tokens > 0


@pytest.mark.slow
def test_ngram_speculation_on_the_default_model():
    # A prompt the real model continues by repeating it: n-gram drafts get accepted, and the
    # greedy output is the same as without speculation.
    prompt = (
        "Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes, "
        "oranges, melons, figs.\nAnswer: apples, pears, plums, cherries, grapes, lemons"
    )
    params = greedy(48)
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)  # as test_engine's
    plain = LLM(None, **args).generate([prompt], params, use_tqdm=False)[0]
    speculative = LLM(None, **args, speculative_config={**NGRAM, "prompt_lookup_min": 2})
    out = speculative.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert speculative.engine.stats.num_accepted_tokens > 0.5 * speculative.engine.stats.num_draft_tokens > 0


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int4"}, "n-gram has none"),
        ({"model": "x", "num_speculative_tokens": 2, "quantization": "int3"}, "quantization must be one of"),
        ({"model": "x", "num_speculative_tokens": 2, "draft_confidence_threshold": 1.0}, "confidence"),
        ({"model": "x", "num_speculative_tokens": 2, "draft_confidence_threshold": "0.5"}, "confidence"),
        ({**NGRAM, "draft_confidence_threshold": 0.5}, "confidence"),
    ],
)
def test_bad_speculative_configs_rejected(tiny_model_dir, config, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dir, **TINY_ENGINE_ARGS, speculative_config=config)


def test_a_draft_quantization_by_another_name_is_the_canonical_method():
    from jaxllm.speculative_config import SpeculativeConfig

    config = {"model": "small", "num_speculative_tokens": 2}
    assert SpeculativeConfig.parse({**config, "quantization": "int8"}).quantization == "w8a8"  # as EngineArgs has it
    assert SpeculativeConfig.parse({**config, "quantization": "int4"}).quantization == "int4"
    assert SpeculativeConfig.parse(config).quantization is None


def test_streaming_with_speculation(tiny_model_dir, llm):
    # Several tokens per step reach a delta stream together, in order.
    import asyncio

    from jaxllm import AsyncLLM

    reference = llm.generate([PROMPTS[0]], greedy(24), use_tqdm=False)[0]
    expected = reference.outputs[0]
    engine = AsyncLLM(**{**TINY_ENGINE_ARGS, "model": tiny_model_dir}, speculative_config=NGRAM)
    engine.engine.scheduler.proposer = OracleProposer([reference.prompt_token_ids + expected.token_ids])

    async def main():
        return [o.outputs[0] async for o in engine.generate(PROMPTS[0], greedy(24), "s", output_kind="delta")]

    try:
        deltas = asyncio.run(main())
        assert [t for d in deltas for t in d.token_ids] == expected.token_ids
        assert "".join(d.text for d in deltas) == expected.text
        assert any(len(d.token_ids) > 1 for d in deltas)
        assert engine.engine.kv_cache_manager.num_used_pages == 0
    finally:
        engine.shutdown()
