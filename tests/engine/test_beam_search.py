"""Beam search: the same beams and scores as HF transformers' `generate(num_beams=...)`
(early_stopping True / False / "never", several length penalties, EOS inside the beams), pages
shared between beams with copy-on-write exactly where beams diverge inside a page, and a
small pool."""

import pytest

from jaxllm import LLM, BeamSearchParams, SamplingParams

from tests.helpers.hf_reference import hf_beam_search
from tests.helpers.tiny_model import TINY_ENGINE_ARGS

PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city",
    "Q: What is two plus two? A:",
    "Once upon a time, in a small village by the sea",
]
SMALL_POOL = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16, "block_size": 4}


@pytest.fixture(scope="module")
def eos(llm):
    """An EOS id that some beams do produce: the 4th token of the first prompt's best beam
    (the random model's own EOS never comes up)."""
    out = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True))[0]
    return out.sequences[0].output_token_ids[3]


@pytest.fixture
def with_eos(llm, eos):
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = (eos,)
    yield eos
    llm.engine.eos_token_ids = saved


@pytest.mark.parametrize(
    "width,early_stopping,length_penalty",
    [
        (4, False, 1.0),
        (4, True, 1.0),
        (4, "never", 1.0),
        (4, False, 0.0),
        (4, True, -0.5),
        (4, "never", 2.0),
        (2, False, 1.0),
        (3, True, 0.5),
    ],
)
def test_matches_hf_beam_search(llm, hf_model, with_eos, width, early_stopping, length_penalty):
    params = BeamSearchParams(
        beam_width=width, max_tokens=10, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm.beam_search(PROMPTS, params)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outputs):
        prompt_ids = tokenizer.encode(prompt)
        expected = hf_beam_search(
            hf_model,
            prompt_ids,
            width=width,
            max_tokens=10,
            eos=with_eos,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
        )
        assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in expected], prompt
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in expected], abs=1e-4)
        for seq in out.sequences:
            assert seq.tokens[: len(prompt_ids)] == prompt_ids
            n = len(seq.output_token_ids)
            assert seq.score == pytest.approx(seq.cum_logprob / n**length_penalty, rel=1e-6)
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == with_eos else "length")
            assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
    assert llm.engine.kv_cache_manager.num_used_pages == 0


def test_eos_ends_beams(llm, with_eos):
    """The chosen EOS really ends some hypotheses early (so the test above covers that path)."""
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.0))[0]
    assert any(s.finish_reason == "stop" and len(s.output_token_ids) < 10 for s in out.sequences)
    ignored = llm.beam_search(
        PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.0, ignore_eos=True)
    )[0]
    assert all(len(s.output_token_ids) == 10 for s in ignored.sequences)


def test_width_one_without_eos_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    assert [b.sequences[0].output_token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


def test_beams_share_pages_and_copy_exactly_when_they_diverge_inside_a_page(llm, monkeypatch):
    engine = llm.engine
    kv = engine.kv_cache_manager
    bs = kv.page_size
    forks_mid_page, forks_at_boundary = [], []
    real_fork = kv.fork

    def fork(parent, child):
        (forks_mid_page if parent.num_computed_tokens % bs else forks_at_boundary).append(parent.num_computed_tokens)
        real_fork(parent, child)

    peak = {"used": 0, "unshared": 0, "max_ref": 0}

    def check_sharing():
        """After every step: a page held by several beams is at the same place in each of their
        page tables and holds the same tokens for all of them; its ref count is its holders."""
        holders: dict[int, list] = {}
        for req in engine.scheduler.running:
            for j, page_id in enumerate(req.page_ids):
                holders.setdefault(page_id, []).append((j, req))
        for page_id, held in holders.items():
            assert kv.groups[0].pages[page_id].ref_cnt == len(held)
            assert len({j for j, _ in held}) == 1
            j = held[0][0]
            end = min(r.num_computed_tokens for _, r in held)
            assert len({tuple(r.all_token_ids[j * bs : min(end, (j + 1) * bs)]) for _, r in held}) == 1
        peak["used"] = max(peak["used"], kv.num_used_pages)
        peak["unshared"] = max(peak["unshared"], sum(len(r.page_ids) for r in engine.scheduler.running))
        peak["max_ref"] = max([peak["max_ref"]] + [kv.groups[0].pages[b].ref_cnt for b in holders])

    real_step = engine.engine_core.step

    def step():
        outputs = real_step()
        check_sharing()
        return outputs

    monkeypatch.setattr(kv, "fork", fork)
    monkeypatch.setattr(engine.engine_core, "step", step)
    copies0 = kv.num_copies
    # Prompt lengths around page boundaries, 20 tokens: forks land mid-page and on boundaries.
    prompts = [list(range(1000, 1000 + n)) for n in (bs - 3, bs, 2 * bs + 5)]
    llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True))
    monkeypatch.undo()
    assert forks_mid_page and forks_at_boundary
    assert kv.num_copies - copies0 == len(forks_mid_page)
    assert peak["max_ref"] >= 4  # a prompt's pages are held by all 4 of its beams
    assert peak["used"] < peak["unshared"]
    assert kv.num_used_pages == 0 and not kv.groups[0].pending_copies


def test_small_pool_runs_prompts_as_they_fit(tiny_model_dir, hf_model):
    small = LLM(tiny_model_dir, **SMALL_POOL)  # 16 pages of 4 tokens
    tokenizer = small.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=12)
    outputs = small.beam_search(PROMPTS[:3], params)  # 2 beams x 5-6 pages: one prompt at a time
    for prompt, out in zip(PROMPTS, outputs):
        prompt_ids = tokenizer.encode(prompt)
        expected = hf_beam_search(
            hf_model,
            prompt_ids,
            width=2,
            max_tokens=12,
            eos=small.engine.eos_token_ids[0],
            early_stopping=False,
            length_penalty=1.0,
        )
        assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in expected]
    assert small.engine.kv_cache_manager.num_copies > 0
    assert small.engine.stats.num_preemptions == 0
    with pytest.raises(ValueError, match="KV pages"):
        small.beam_search(PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=12))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(beam_width=0),
        dict(beam_width=11),
        dict(max_tokens=0),
        dict(temperature=0.7),
        dict(early_stopping="sometimes"),
    ],
)
def test_bad_params_rejected(kwargs):
    with pytest.raises(ValueError):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_busy_engine_or_bad_prompt_rejected(llm):
    engine = llm.engine
    engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="idle"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4))
    engine.abort_request("busy")
    with pytest.raises(ValueError, match="vocabulary"):
        llm.beam_search([[10**7]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4))[0].sequences) == 2
