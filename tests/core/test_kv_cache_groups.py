"""Sliding-window KV cache groups (core/kv_cache_manager.py): pages that slide out of every
window of a request are released, in one group (every layer windowed) or in the windowed
group of a model that mixes windowed and global layers (Gemma 3); prefix hits, forks and
drafts stay correct; and end to end a hybrid model generates what HF transformers does while
its windowed layers hold window-sized KV."""

import numpy as np
import pytest

from jaxllm import LLM, BeamSearchParams, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.engine_config import resolve_config
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request

from tests.helpers.hf_reference import build_hf_model, hf_beam_search

BS, WINDOW = 4, 6


def _request(tokens, name="r"):
    return Request(name, list(tokens), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


def _run(kv, req, n):
    """Allocate and 'compute' n tokens of req, as the scheduler and engine do."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_full_pages(req)


def _no_leaks(kv):
    for g in kv.groups:
        for page in g.pages:
            assert (page.page_id in g.free_pages) == (page.ref_cnt == 0)


def _window_pages(chunk):
    """The most pages a query chunk of `chunk` tokens reads in a window of WINDOW tokens."""
    return -(-(WINDOW - 1 + chunk) // BS) + 1


@pytest.mark.parametrize("windows", [(WINDOW,), (0, WINDOW)])
def test_pages_before_the_window_are_released(windows):
    kv = KVCacheManager(64, BS, windows=windows)
    req = _request(range(100, 140))
    held = []
    for chunk in (8, 8, 8, 8, 8):  # a 40-token prompt in chunks, then decodes
        _run(kv, req, chunk)
        held.append([len(g.held(req)) for g in kv.groups])
    for token in range(10):
        req.output_token_ids.append(token)
        _run(kv, req, 1)
        held.append([len(g.held(req)) for g in kv.groups])
    window = kv.groups[-1]
    assert all(h[-1] <= _window_pages(8) for h in held)
    # Decoding: the window's pages and the one being written, every step.
    assert held[-1][-1] <= _window_pages(1) < len(req.page_tables[-1])
    assert len(req.page_tables[-1]) == -(-req.num_computed_tokens // BS)  # tables keep their ids
    assert req.num_released_pages[-1] == len(req.page_tables[-1]) - held[-1][-1]
    if len(windows) == 2:  # the global group keeps all
        assert held[-1][0] == len(req.page_ids) == -(-req.num_computed_tokens // BS)
    released = req.page_tables[-1][: req.num_released_pages[-1]]
    assert all(window.pages[b].ref_cnt == 0 and b in window.free_pages for b in released)
    assert kv.request_usage(req) == (sum(h for h in held[-1]), 0)
    _no_leaks(kv)
    kv.free(req)
    assert kv.num_used_pages == 0
    _no_leaks(kv)


def test_prefix_hits_need_every_group_and_take_only_the_window():
    kv = KVCacheManager([32, 32], BS, windows=(0, WINDOW))
    prompt = list(range(200, 230))  # 30 tokens: 7 full pages
    first = _request(prompt, "first")
    for _ in range(4):
        _run(kv, first, min(8, 30 - first.num_computed_tokens))
    tables = [list(t) for t in first.page_tables]
    kv.free(first)
    second = _request(prompt + [1, 2], "second")
    computed = kv.get_computed_pages(second)
    assert [len(c) for c in computed] == [7, 7] and computed == [t[:7] for t in tables]
    assert kv.allocate_slots(second, 32 - 28, computed)
    second.num_computed_tokens = 28
    # The global group takes every hit; the window group only those the next query reads.
    glob, window = kv.groups
    assert all(glob.pages[b].ref_cnt == 1 for b in second.page_tables[0][:7])
    take_from = (28 - WINDOW + 1) // BS
    assert second.num_released_pages[1] == take_from
    assert [window.pages[b].ref_cnt for b in second.page_tables[1][:7]] == [0] * take_from + [1] * (7 - take_from)
    assert kv.prefix_hits == 28
    kv.free(second)
    # A hit in the global group alone is no hit: evict one window page of the prefix.
    victim = computed[1][2]
    del window.free_pages[victim]
    window._evict(window.pages[victim])
    window.free_pages[victim] = None
    assert [len(c) for c in kv.get_computed_pages(_request(prompt + [3], "third"))] == [2, 2]
    _no_leaks(kv)


def test_fork_and_trim_with_released_pages():
    kv = KVCacheManager(64, BS, windows=(0, WINDOW))
    parent = _request(range(300, 322), "parent")  # 22 tokens
    for _ in range(3):
        _run(kv, parent, min(8, 22 - parent.num_computed_tokens))
    parent.output_token_ids.append(5)
    _run(kv, parent, 1)  # releases the early window pages
    assert parent.num_released_pages[1] > 0
    child = _request(parent.prompt_token_ids, "child")
    child.output_token_ids = list(parent.output_token_ids)
    kv.fork(parent, child)
    assert child.page_tables == parent.page_tables and child.num_released_pages == parent.num_released_pages
    for r, tok in ((parent, 6), (child, 7)):  # both write the shared last page
        r.output_token_ids.append(tok)
        assert kv.allocate_slots(r, 1)
    copies = kv.take_pending_copies()
    assert [len(src) for src, _ in copies] == [1, 1]  # a copy in each group
    # Drafts: pages held for tokens that were rejected go back; released ones stay released.
    assert kv.allocate_slots(parent, 1 + 8)
    kv.trim(parent, parent.num_tokens)
    assert len(parent.page_tables[1]) == len(parent.page_ids) == -(-parent.num_tokens // BS)
    for r in (parent, child):
        kv.free(r)
    assert kv.num_used_pages == 0
    _no_leaks(kv)


def test_config_gives_the_windowed_layers_their_own_smaller_pool(tmp_path):
    from jaxllm.models.registry import model_config_from_hf
    import json

    build_hf_model("gemma3", tmp_path, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    cfg = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    cache = resolve_config(
        EngineArgs(
            kv_cache_memory=8 << 20,
            max_model_len=128,
            max_num_batched_tokens=32,
            max_num_seqs=8,
            block_size=4,
            dtype="float32",
        ),
        cfg,
        "m",
    ).cache  # 4-byte pages below
    assert cache.group_windows == (0, WINDOW)
    # Pools in the proportion one max_model_len request holds: 32 pages global, a window and a
    # chunk windowed; 2 layers each, the whole budget spent.
    assert cache.num_pages / cache.num_window_pages == pytest.approx(32 / _window_pages(32), rel=0.01)
    layer_page = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 4
    used = 2 * layer_page * (cache.num_pages + cache.num_window_pages)
    assert (8 << 20) - 4 * layer_page < used <= 8 << 20
    # No window group: windows that span the context, or a draft model reading every page.
    for extra in (dict(max_model_len=WINDOW), dict(speculative_config={"model": "x", "num_speculative_tokens": 2})):
        args = dict(kv_cache_memory=8 << 20, max_model_len=128, block_size=4) | extra
        cache = resolve_config(EngineArgs(**args), cfg, "m").cache
        assert cache.group_windows == (0,) and not cache.num_window_pages


def test_hybrid_model_generates_what_hf_does_with_window_sized_kv(tmp_path):
    """Gemma 3 (tiny, window 6, windowed and global layers in turn): long prompts in chunks,
    decoding past the window, a small pool that preempts, ngram drafts, then beams (pages
    copied on write in both groups); the windowed layers' pages never exceed a window and a
    chunk per request."""
    torch = pytest.importorskip("torch")
    hf = build_hf_model("gemma3", tmp_path / "model")
    hf.generation_config.eos_token_id = None
    llm = LLM(
        str(tmp_path / "model"),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_memory=64 << 10,
        block_size=BS,
        params_cache_dir=str(tmp_path / "c"),
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
        warmup=False,
    )
    kv = llm.engine.kv_cache_manager
    assert [g.window for g in kv.groups] == [0, WINDOW] and kv.groups[1].num_pages < kv.groups[0].num_pages
    peak = {"window": 0, "global": 0}
    step = llm.engine.engine_core.step

    def watched():
        out = step()
        for r in llm.engine.engine_core.scheduler.running:
            peak["window"] = max(peak["window"], len(kv.groups[1].held(r)))
            peak["global"] = max(peak["global"], len(kv.groups[0].held(r)))
        return out

    llm.engine.engine_core.step = watched
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (70, 45, 90, 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
    assert llm.engine.stats.num_preemptions > 0  # the pool is small: requests were recomputed
    assert peak["window"] <= _window_pages(16) + 2 < peak["global"]  # + 2: the drafts' pages
    assert kv.num_used_pages == 0
    _no_leaks(kv)
    llm.engine.engine_core.step = step
    beams = llm.beam_search([prompts[1]], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))[0]
    expected = hf_beam_search(hf, prompts[1], width=3, max_tokens=8, eos=None, early_stopping=False, length_penalty=1.0)
    assert [s.output_token_ids for s in beams.sequences] == [tokens for tokens, _ in expected]
    assert kv.num_copies > 0 and kv.num_used_pages == 0
