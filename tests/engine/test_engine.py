"""The engine end to end: greedy parity with HF transformers, invariance to batching,
chunking and preemption, seeded sampling, stop conditions, abort, bad input, no recompiles."""

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxllm import LLM, SamplingParams
from jaxllm.runner.compile import no_compile_guard

from tests.helpers.hf_reference import from_gguf
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, WARM_ENGINE_ARGS

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In 1492, a sailor from Genoa crossed the ocean and found a continent that",
    "Q: What is two plus two? A:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning",
]


def hf_greedy(model, prompt_ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_hf(llm, hf_model):
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == llm.get_tokenizer().encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, out.prompt_token_ids, 12), prompt
        assert out.outputs[0].finish_reason == "length"


def test_packed_weights_match_hf_and_xla_dots(llm, hf_model, tiny_model_dir):
    # The default engine packs every float32 matrix for the C++ GEMM (all of the tiny model's
    # split into 16-column panels); without packing the same weights go through XLA's dots.
    from jaxllm.models.linear import PackedWeight
    from jaxllm.quantization.weights import LAYER_MATRICES

    params = llm.engine.runner.params
    assert all(
        isinstance(layer[name], PackedWeight) for layer in params["layers"] for name in LAYER_MATRICES if name in layer
    )
    assert isinstance(params["embed"], PackedWeight)  # tied: the LM head too
    plain = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, packed_weights=False)
    assert not isinstance(plain.engine.runner.params["embed"], PackedWeight)
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    packed_out, plain_out = (engine.generate(PROMPTS, sampling, use_tqdm=False) for engine in (llm, plain))
    for a, b in zip(packed_out, plain_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(hf_model, a.prompt_token_ids, 12)
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            np.testing.assert_allclose(
                [lp.logprob for lp in lp_a.values()], [lp.logprob for lp in lp_b.values()], atol=1e-4
            )


def test_bf16_weights_packed_where_the_cpu_has_bf16_dots(tiny_model_dir):
    # With AVX512_BF16 the bf16 matrices are packed for the C++ bf16 GEMM; elsewhere they stay
    # with XLA's bf16 dot. Either way the tokens and log-probs are those of XLA's dots (the
    # same bf16 products, f32 sums in another order). The other order can round an activation
    # to the neighbouring bf16 value before the next GEMM (2^-8 of it), which moves a log-prob
    # by a few 1e-3: 3.7e-3 on a Xeon with AMX, where XLA's dots sum in AMX tiles.
    from jaxllm.kernels import native
    from jaxllm.models.linear import PackedWeight
    from jaxllm.quantization.weights import LAYER_MATRICES

    args = dict(TINY_ENGINE_ARGS, dtype="bfloat16")
    packed, plain = LLM(tiny_model_dir, **args), LLM(tiny_model_dir, **args, packed_weights=False)
    params = packed.engine.runner.params
    if native.has_bf16_dots():
        assert isinstance(params["embed"], PackedWeight) and params["embed"].panels.ndim == 4
        assert all(
            isinstance(layer[name], PackedWeight) and layer[name].panels.dtype == jax.numpy.bfloat16
            for layer in params["layers"]
            for name in LAYER_MATRICES
            if name in layer
        )
    else:
        assert not isinstance(params["embed"], PackedWeight)
    assert not isinstance(plain.engine.runner.params["embed"], PackedWeight)
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    for a, b in zip(*(engine.generate(PROMPTS, sampling, use_tqdm=False) for engine in (packed, plain))):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            np.testing.assert_allclose(
                [lp.logprob for lp in lp_a.values()], [lp.logprob for lp in lp_b.values()], atol=1e-2
            )


def test_outputs_independent_of_batch_and_order(llm):
    batched = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    alone = [token_ids(llm.generate([p], greedy(), use_tqdm=False))[0] for p in PROMPTS[:2]]
    reverse = token_ids(llm.generate(PROMPTS[::-1], greedy(), use_tqdm=False))[::-1]
    assert alone == batched[:2]
    assert reverse == batched


def test_chunked_prefill_and_preemption_give_same_outputs(llm, tiny_model_dir):
    reference = token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False))
    # Tiny token budget: every prompt is split over several steps.
    chunked = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "max_num_batched_tokens": 8, "max_num_seqs": 8})
    assert token_ids(chunked.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference
    # A pool too small for all sequences at once: the newest are preempted and recomputed.
    small = LLM(tiny_model_dir, **{**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16, "block_size": 4})
    assert token_ids(small.generate(PROMPTS, greedy(24), use_tqdm=False)) == reference
    assert small.engine.stats.num_preemptions > 0
    assert small.engine.kv_cache_manager.num_used_pages == 0


def test_priority_scheduling_gives_the_same_outputs(llm, tiny_model_dir):
    """scheduling_policy="priority" with mixed priorities on a pool that forces preemptions:
    the urgent requests preempt the others, and every output is the FCFS engine's."""
    reference = token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False))
    args = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16, "block_size": 4, "scheduling_policy": "priority"}
    urgent = LLM(tiny_model_dir, **args)
    priorities = [len(PROMPTS) - i for i in range(len(PROMPTS))]  # the last prompt first
    assert token_ids(urgent.generate(PROMPTS, greedy(24), use_tqdm=False, priority=priorities)) == reference
    assert urgent.engine.stats.num_preemptions > 0 and urgent.engine.kv_cache_manager.num_used_pages == 0
    with pytest.raises(ValueError, match="priority=1 needs scheduling_policy='priority'"):
        llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        urgent.generate(PROMPTS[:1], greedy(2), use_tqdm=False, priority=[1, 2])
    assert not llm.engine.has_unfinished_requests() and not urgent.engine.has_unfinished_requests()


def test_swap_preemption_gives_the_same_outputs_as_recompute(llm, tiny_model_dir):
    greedy_ref = token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False))
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True) for i in range(5)]
    seeded_ref = token_ids(llm.generate(PROMPTS, seeded, use_tqdm=False))
    small = LLM(
        tiny_model_dir,
        **{
            **TINY_ENGINE_ARGS,
            "num_gpu_blocks_override": 16,
            "block_size": 4,
            "preemption_mode": "swap",
            "swap_space": 0.01,
        },
    )
    kv = small.engine.kv_cache_manager
    assert token_ids(small.generate(PROMPTS, greedy(24), use_tqdm=False)) == greedy_ref
    assert token_ids(small.generate(PROMPTS, seeded, use_tqdm=False)) == seeded_ref
    assert small.engine.stats.num_preemptions > 0 and kv.num_swapped_out > 0
    assert kv.num_used_pages == 0 and len(kv.free_swap_slots) == kv.num_swap_pages


@pytest.mark.parametrize("lose_cache", [False, True])
def test_a_failing_step_fails_only_its_requests(llm, monkeypatch, caplog, lose_cache):
    """Fault injection: one step raises (after destroying the donated KV cache, as a failed
    XLA execution would); its requests end with "error", the engine serves the next ones."""
    engine = llm.engine
    reference = token_ids(llm.generate(PROMPTS, greedy(10), use_tqdm=False))
    runner = engine.runner
    real_call = runner.call

    def failing_call(*args):
        if lose_cache:
            for x in jax.tree_util.tree_leaves(runner.kv_cache):
                x.delete()
        raise RuntimeError("injected step failure")

    engine.add_request("doomed-0", PROMPTS[0], greedy(10))
    engine.add_request("doomed-1", PROMPTS[1], greedy(10))
    engine.step()  # both running
    monkeypatch.setattr(runner, "call", failing_call)
    with caplog.at_level("ERROR", logger="jaxllm"):
        outputs = engine.step()
    monkeypatch.setattr(runner, "call", real_call)
    assert "injected step failure" in caplog.text
    assert {o.request_id: o.outputs[0].finish_reason for o in outputs} == {"doomed-0": "error", "doomed-1": "error"}
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_used_pages == 0
    assert engine.stats.finished["error"] >= 2
    assert token_ids(llm.generate(PROMPTS, greedy(10), use_tqdm=False)) == reference


def test_a_failing_step_recomputes_the_requests_it_did_not_hold(llm, monkeypatch):
    """Requests that were running but not in the failed step lose their KV with the cache and
    are recomputed: they still finish with the tokens they would have had."""
    engine = llm.engine
    reference = token_ids(llm.generate(PROMPTS[:2], greedy(10), use_tqdm=False))
    runner = engine.runner
    # Steps one at a time: with async scheduling the survivor's next step would already be in flight.
    monkeypatch.setattr(engine.engine_core, "async_scheduling", False)
    engine.add_request("survivor", PROMPTS[0], greedy(10))
    for _ in range(3):
        engine.step()
    survivor = engine.scheduler.requests["survivor"]
    engine.add_request("doomed", PROMPTS[1], greedy(10))
    real_schedule = engine.scheduler.schedule

    def schedule_without_survivor():  # the survivor sits this step out (as under a full budget)
        out = real_schedule()
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not survivor]
        return out

    def failing_call(*args):
        for x in jax.tree_util.tree_leaves(runner.kv_cache):
            x.delete()
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_without_survivor)
    monkeypatch.setattr(runner, "call", failing_call)
    outputs = engine.step()
    monkeypatch.undo()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("doomed", "error")]
    assert survivor.status.value == "preempted" and survivor.num_computed_tokens == 0
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert finished["survivor"] == reference[0]
    assert engine.kv_cache_manager.num_used_pages == 0


def test_seeded_sampling_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True)
    mixed = llm.generate(PROMPTS[1:3] + [PROMPTS[0]], [others, others, params], use_tqdm=False)[2]
    assert mixed.outputs[0].token_ids == alone
    unseeded = llm.generate(
        [PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_choices_and_logprobs(llm):
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for token, entry in zip(c.token_ids, c.logprobs):
            assert token in entry
            ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
            assert len(ranked) == 3 and all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), abs=1e-3
        )


def test_stop_token_ids_min_tokens_and_stop_strings(llm):
    base = llm.generate([PROMPTS[2]], greedy(16), use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = llm.generate([PROMPTS[2]], greedy(16, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens holds the stop token back: generation continues past it.
    out = llm.generate([PROMPTS[2]], greedy(16, stop_token_ids=[stop_tok], min_tokens=first + 2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > first + 1
    # A stop string made of the tail of one token and the head of the next.
    text = base.text
    cut = len(llm.get_tokenizer().decode(base.token_ids[:4], skip_special_tokens=True))
    stop = text[cut - 2 : cut + 2]
    if len(stop.strip()) == 4 and text.find(stop) == cut - 2:
        out = llm.generate([PROMPTS[2]], greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.text == text[: cut - 2] and out.finish_reason == "stop" and out.stop_reason == stop
        out = llm.generate([PROMPTS[2]], greedy(16, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[
            0
        ].outputs[0]
        assert out.text == text[: cut + 2]


def test_abort_frees_every_page(llm):
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", p, greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_used_pages > 0
    engine.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_used_pages == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(n=0),
        dict(max_tokens=0),
        dict(top_k=-5),
        dict(min_p=2),
        dict(logprobs=99),
        dict(min_tokens=5, max_tokens=2),
        dict(repetition_penalty=0),
    ],
)
def test_bad_sampling_params_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_top_k_past_the_vocabulary_keeps_it_all(llm):
    base = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    whole = token_ids(llm.generate(PROMPTS[:2], SamplingParams(**base), use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS[:2], SamplingParams(top_k=2**31, **base), use_tqdm=False)) == whole


def test_bad_requests_rejected_and_others_unaffected(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(10, 10 + 600)), greedy())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [10**7], greedy())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], greedy())
    assert not engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_no_recompilation_after_warmup(tiny_model_dir):
    llm = LLM(tiny_model_dir, **WARM_ENGINE_ARGS)  # fresh: the first requests after warm-up count too
    params = [
        greedy(3),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=20, logprobs=2),
        SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=7),
        greedy(30),
        SamplingParams(temperature=0.5, min_p=0.1, seed=3, max_tokens=12, n=2),
    ]
    with no_compile_guard():
        llm.generate(PROMPTS, params, use_tqdm=False)
        llm.generate([PROMPTS[0] * 8, "Hi"], greedy(5), use_tqdm=False)


@pytest.mark.slow
def test_greedy_matches_hf_on_default_model():
    """The real SmolLM2 GGUF, f32, against transformers' own GGUF load."""

    from jaxllm.models.loader import default_model_path

    path = default_model_path()
    llm = LLM(None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, warmup=False)
    hf = from_gguf(transformers.AutoModelForCausalLM, path)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 10)


def test_async_llm_streams_and_cancel_frees_pages(tiny_model_dir, llm):
    import asyncio

    from jaxllm import AsyncLLM

    engine = AsyncLLM(**{**TINY_ENGINE_ARGS, "model": tiny_model_dir})
    expected = llm.generate([PROMPTS[1]], greedy(8), use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        deltas = []
        async for o in engine.generate(PROMPTS[1], greedy(8), "a", output_kind="delta"):
            if not deltas:  # a second request with the same id is refused; the first goes on
                with pytest.raises(ValueError, match="already in use"):
                    await anext(engine.generate(PROMPTS[0], greedy(8), "a"))
            deltas.append(o.outputs[0].token_ids)
        seen = 0
        async for out in engine.generate(PROMPTS[0], greedy(200), "b"):
            seen += 1
            if seen == 3:
                break  # leaving the loop aborts the request
        for _ in range(100):
            if engine.engine.kv_cache_manager.num_used_pages == 0 and not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        return deltas

    try:
        deltas = asyncio.run(main())
        assert [t for d in deltas for t in d] == expected
        assert engine.engine.kv_cache_manager.num_used_pages == 0
        assert not engine.engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_progress_bar_shows_on_a_terminal_only(llm, monkeypatch, capsys):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(["Hello"], params)  # use_tqdm's default: a bar, where it can be seen
    assert "generating" not in capsys.readouterr().err  # stderr here is captured, not a terminal
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    llm.generate(["Hello"], params)
    assert "generating" in terminal.getvalue()


def test_packed_step_inputs_round_trip_on_256_byte_boundaries():
    """The step's inputs travel in one int32 and one float32 buffer; each leaf comes back equal,
    from an offset that is a multiple of 256 bytes (the Mosaic GPU kernel's TMA needs it: XLA
    passes a slice of the buffer to a custom call as it is)."""
    from jaxllm.runner.input_batch import PackedLayout

    tree = {
        "ids": np.arange(3, dtype=np.int32),
        "temps": np.linspace(0, 1, 10, dtype=np.float32).reshape(2, 5),
        "flags": np.array([True, False, True]),
        "bits": np.array([0xFFFFFFFF, 7], np.uint32),
        "tables": np.arange(130, dtype=np.int32).reshape(2, 65),
    }
    layout = PackedLayout.of(tree)
    assert all(offset * 4 % 256 == 0 for _, offset, _, _ in layout.leaves)
    ints, floats = np.zeros(layout.num_ints, np.int32), np.zeros(layout.num_floats, np.float32)
    layout.pack(tree, ints, floats)
    back = jax.jit(layout.unpack)(ints, floats)
    for name, value in tree.items():
        np.testing.assert_array_equal(np.asarray(back[name]), value)
        assert back[name].dtype == value.dtype
