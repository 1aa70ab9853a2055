"""Automatic prefix caching and shared pages: outputs are the same with the cache on and off
(overlapping prompts, partial-page prefixes, prompts that are prefixes of each other, under
eviction and preemption, and with every hash colliding); hit counters; ref counts and
copy-on-write in the KV cache manager; `n > 1` holds the prompt's pages once."""

import pytest

import jaxllm.core.kv_cache_manager as kv_module
from jaxllm import LLM, SamplingParams
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request

from tests.helpers.tiny_model import TINY_ENGINE_ARGS

BLOCK = 16  # TINY_ENGINE_ARGS' page size
# Small pool for pressure: the same shapes as test_engine's preemption test (compile cache).
SMALL_POOL = {**TINY_ENGINE_ARGS, "num_gpu_blocks_override": 16, "block_size": 4}


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def shared_prefix_prompts():
    """Token-id prompts that overlap in every way the cache must handle."""
    system = [(7 * i + 3) % 5000 + 100 for i in range(2 * BLOCK + 5)]  # 2 full pages + 5 tokens
    q1, q2 = list(range(900, 913)), list(range(2000, 2021))
    return [
        system + q1,  # shares 2 full pages + a partial page with the next two
        system + q2,
        system[: BLOCK + 3] + q2,  # diverges inside the second page
        system,  # an exact prefix of the first two
        system[: 2 * BLOCK],  # exactly two pages: the last page is recomputed, not hit
        system + q1 + q2,  # extends the first
        system + q1,  # identical to the first
        q1 + system,  # the same pages at other positions: never hit
    ]


# Prompt tokens each of those finds cached when they run one after another.
EXPECTED_CACHED = [
    0,
    2 * BLOCK,  # the system prompt's two full pages
    BLOCK,  # diverged inside page 2
    2 * BLOCK,
    BLOCK,  # exactly two pages: the last one is recomputed for the logits
    3 * BLOCK,  # the first prompt's three full pages
    3 * BLOCK,
    0,  # same tokens at other positions
]


@pytest.fixture(scope="module")
def llm_on(tiny_model_dir):
    return LLM(tiny_model_dir, **TINY_ENGINE_ARGS)


@pytest.fixture(scope="module")
def llm_off(tiny_model_dir):
    return LLM(tiny_model_dir, **TINY_ENGINE_ARGS, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(llm_off):
    """Greedy outputs without prefix caching, one prompt at a time."""
    return [token_ids(llm_off.generate([p], greedy(12), use_tqdm=False))[0] for p in shared_prefix_prompts()]


def test_outputs_equal_with_prefix_caching_on_and_off(llm_on, llm_off, reference):
    kv = llm_on.engine.kv_cache_manager
    kv.reset_prefix_cache()
    prompts = shared_prefix_prompts()
    # One at a time: each prompt finds the earlier ones' pages cached.
    one_by_one = [llm_on.generate([p], greedy(12), use_tqdm=False)[0] for p in prompts]
    assert token_ids(one_by_one) == reference
    assert [o.num_cached_tokens for o in one_by_one] == EXPECTED_CACHED
    # All at once (later requests hit pages computed earlier in the same run), then again warm.
    assert token_ids(llm_on.generate(prompts, greedy(12), use_tqdm=False)) == reference
    assert token_ids(llm_on.generate(prompts[::-1], greedy(12), use_tqdm=False))[::-1] == reference
    assert token_ids(llm_off.generate(prompts, greedy(12), use_tqdm=False)) == reference
    assert llm_off.engine.kv_cache_manager.prefix_hits == 0
    assert kv.num_used_pages == 0


def test_hit_counters(llm_on):
    kv = llm_on.engine.kv_cache_manager
    kv.reset_prefix_cache()
    prompt = list(range(3000, 3000 + 3 * BLOCK + 2))
    q0, h0 = kv.prefix_queries, kv.prefix_hits
    llm_on.generate([prompt], greedy(4), use_tqdm=False)
    assert (kv.prefix_queries - q0, kv.prefix_hits - h0) == (len(prompt), 0)
    out = llm_on.generate([prompt + [5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert kv.prefix_queries - q0 == 2 * len(prompt) + 3
    assert kv.prefix_hits - h0 == out.num_cached_tokens == 3 * BLOCK
    # Generated tokens are cached too: a follow-up turn hits the previous answer's full pages.
    turn = out.prompt_token_ids + out.outputs[0].token_ids + [8]
    assert llm_on.generate([turn], greedy(4), use_tqdm=False)[0].num_cached_tokens == (len(turn) - 1) // BLOCK * BLOCK


def test_forced_hash_collisions_never_return_wrong_kv(llm_on, reference, monkeypatch):
    """Every page hashes alike: a hit must still be confirmed by its tokens and its parent."""
    kv = llm_on.engine.kv_cache_manager
    kv.reset_prefix_cache()
    monkeypatch.setattr(kv_module, "hash_page_tokens", lambda parent, tokens, extra_key=None: 42)
    prompts = shared_prefix_prompts()
    h0 = kv.prefix_hits
    outs = [llm_on.generate([p], greedy(12), use_tqdm=False)[0] for p in prompts]
    assert token_ids(outs) == reference
    assert set(kv.groups[0].cached) == {42} and len(kv.groups[0].cached[42]) > 10
    assert [o.num_cached_tokens for o in outs] == EXPECTED_CACHED
    assert kv.prefix_hits - h0 == sum(o.num_cached_tokens for o in outs)
    kv.reset_prefix_cache()
    assert not kv.groups[0].cached


def test_eviction_and_preemption_give_same_outputs(tiny_model_dir, llm_off):
    """16 pages of 4 tokens: cached pages are evicted (LRU) and running requests preempted."""
    base = list(range(500, 509))  # 2 full pages + 1
    prompts = [base + [600 + 10 * i + j for j in range(5)] for i in range(4)]  # 14 + 12 tokens: 7 pages
    warm = list(range(700, 714))
    expected = [token_ids(llm_off.generate([p], greedy(12), use_tqdm=False))[0] for p in [warm] + prompts]
    small = LLM(tiny_model_dir, **SMALL_POOL)
    kv = small.engine.kv_cache_manager
    assert token_ids(small.generate([warm], greedy(12), use_tqdm=False)) == expected[:1]
    probe = Request("probe", warm + expected[0][0] + [1], greedy())
    assert len(kv.get_computed_pages(probe)[0]) == 6  # 25 computed tokens: 6 full pages
    outs = small.generate(prompts * 2, greedy(12), use_tqdm=False)
    assert token_ids(outs) == expected[1:] * 2
    assert small.engine.stats.num_preemptions > 0
    assert kv.prefix_hits > 0
    assert kv.num_used_pages == 0
    # The pool could not keep everything: the warm-up prompt's pages were evicted since.
    assert len(kv.get_computed_pages(probe)[0]) < 6
    # Caching off under the same pressure gives the same outputs.
    kv.enable_prefix_caching = False
    kv.reset_prefix_cache()
    assert token_ids(small.generate(prompts * 2, greedy(12), use_tqdm=False)) == expected[1:] * 2


# ----- n > 1 -----


def test_n_samples_reproducible_and_same_with_caching_off(llm_on, llm_off):
    # top_k keeps the draw away from float noise: over the whole vocabulary, neighbouring
    # tokens hold ~1e-5 of the mass each, and KV computed in another batch shape may move the
    # inverse-CDF boundary by that much.
    prompt = shared_prefix_prompts()[0]
    params = SamplingParams(n=4, temperature=1.0, top_k=5, seed=11, max_tokens=10, ignore_eos=True)
    first = token_ids(llm_on.generate([prompt], params, use_tqdm=False))[0]
    assert len({tuple(t) for t in first}) == 4
    assert token_ids(llm_on.generate([prompt], params, use_tqdm=False))[0] == first
    others = shared_prefix_prompts()[1:3]
    mixed = llm_on.generate(others + [prompt], [greedy(), greedy(), params], use_tqdm=False)
    assert token_ids(mixed)[2] == first
    assert token_ids(llm_off.generate([prompt], params, use_tqdm=False))[0] == first


def test_n_samples_hold_the_prompt_pages_once(llm_on):
    engine = llm_on.engine
    kv = engine.kv_cache_manager
    kv.reset_prefix_cache()
    prompt = list(range(4000, 4000 + 2 * BLOCK + 7))  # 2 full pages + 7 tokens
    n, shared = 4, (len(prompt) - 1) // BLOCK
    engine.add_request("n4", prompt, SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
    for _ in range(50):
        engine.step()
        reqs = [engine.scheduler.requests.get(f"{i}_n4") for i in range(n)]
        if all(r is not None and len(r.output_token_ids) >= 2 for r in reqs):
            break
    assert all(r is not None and len(r.output_token_ids) >= 2 for r in reqs)
    tables = [r.page_ids for r in reqs]
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert all(kv.groups[0].pages[b].ref_cnt == n for b in tables[0][:shared])
    own = [b for t in tables for b in t[shared:]]
    assert len(own) == len(set(own)) and not set(own) & set(tables[0][:shared])
    assert kv.num_used_pages == shared + len(own)
    assert kv.num_used_pages < sum(kv.pages_needed(r.num_computed_tokens) for r in reqs)
    assert all(kv.request_usage(r) == (len(r.page_ids), shared) for r in reqs)
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_used_pages == 0


# ----- the cache manager alone: ref counts, fork, copy-on-write -----


def _request(n_tokens, name="r"):
    return Request(name, list(range(100, 100 + n_tokens)), greedy())


def _run(kv, req, n):
    """Allocate and 'compute' n tokens of req, as the scheduler and engine would."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_full_pages(req)


def test_prefix_queries_counted_once_per_admission():
    kv = KVCacheManager(4, 4)
    first = _request(8, "first")
    _run(kv, first, 8)
    kv.free(first)  # its 2 pages stay cached
    hog = Request("hog", list(range(500, 508)), greedy())
    _run(kv, hog, 8)  # takes the 2 uncached pages
    req = _request(10)  # first's 8 tokens + 2: hits 2 pages, needs 1 more
    for _ in range(2):
        computed = kv.get_computed_pages(req)
        assert len(computed[0]) == 2 and not kv.allocate_slots(req, 10 - 8, computed)  # blocked
    kv.free(hog)
    assert kv.allocate_slots(req, 10 - 8, kv.get_computed_pages(req))
    assert kv.prefix_queries == 8 + 8 + 10
    assert kv.prefix_hits == 8


def test_fork_shares_pages_and_copies_only_on_divergent_write():
    kv = KVCacheManager(16, 4)
    parent = _request(10)  # pages: full, full, 2/4 used
    _run(kv, parent, 10)
    child = _request(10, "child")
    kv.fork(parent, child)
    assert child.page_ids == parent.page_ids and child.num_computed_tokens == 10
    assert [kv.groups[0].pages[b].ref_cnt for b in parent.page_ids] == [2, 2, 2]
    assert kv.request_usage(child) == (3, 3)
    used = kv.num_used_pages
    # Both write their own next token into the shared, partly filled page 2.
    parent.output_token_ids.append(1)
    child.output_token_ids.append(2)
    assert kv.allocate_slots(parent, 1)
    [(src, dst)] = kv.take_pending_copies()
    assert src == [child.page_ids[2]] and dst == [parent.page_ids[2]] and kv.num_copies == 1
    assert kv.allocate_slots(child, 1)  # now the only holder: writes in place
    assert kv.take_pending_copies() == [([], [])] and kv.num_copies == 1
    assert parent.page_ids[:2] == child.page_ids[:2] and parent.page_ids[2] != child.page_ids[2]
    assert [kv.groups[0].pages[b].ref_cnt for b in child.page_ids] == [2, 2, 1]
    assert kv.num_used_pages == used + 1
    parent.num_computed_tokens += 1
    child.num_computed_tokens += 1

    # A fork at a page boundary copies nothing: each side starts a new page.
    for r in (parent, child):
        r.output_token_ids.append(3)
        _run(kv, r, 1)  # 12 tokens: 3 full pages
    grandchild = _request(12, "grandchild")
    grandchild.output_token_ids = list(child.output_token_ids)
    kv.fork(child, grandchild)
    for r, tok in ((child, 4), (grandchild, 5)):
        r.output_token_ids.append(tok)
        assert kv.allocate_slots(r, 1)
    assert kv.take_pending_copies() == [([], [])] and kv.num_copies == 1
    assert child.page_ids[:3] == grandchild.page_ids[:3] and child.page_ids[3] != grandchild.page_ids[3]

    # A fork that is dropped before writing leaves the page to the other: no copy.
    sibling = _request(13, "sibling")
    kv.fork(grandchild, sibling)
    kv.free(sibling)
    grandchild.num_computed_tokens += 1
    grandchild.output_token_ids.append(6)
    assert kv.allocate_slots(grandchild, 1) and kv.num_copies == 1

    # A queued copy into a page that is freed before the step is dropped.
    other = _request(13, "other")
    kv.fork(grandchild, other)
    other.output_token_ids.append(7)
    assert kv.allocate_slots(other, 1) and kv.groups[0].pending_copies
    kv.free(other)
    assert kv.take_pending_copies() == [([], [])]
    for r in (parent, child, grandchild):
        kv.free(r)
    assert kv.num_used_pages == 0 and all(b.ref_cnt == 0 for b in kv.groups[0].pages)


def test_copy_on_write_fails_cleanly_without_free_pages():
    kv = KVCacheManager(3, 4)
    parent = _request(6)
    _run(kv, parent, 6)  # 2 pages
    child = _request(6, "child")
    kv.fork(parent, child)
    hog = _request(4, "hog")
    _run(kv, hog, 4)  # the last free page
    parent.output_token_ids.append(1)
    assert not kv.allocate_slots(parent, 1)  # a copy needs a page: nothing changes
    assert parent.page_ids == child.page_ids and not kv.groups[0].pending_copies
    kv.free(hog)
    assert kv.allocate_slots(parent, 1) and kv.num_copies == 1


def test_reset_after_a_weight_update_forgets_held_pages_for_good():
    """`reset_prefix_cache(held=True)`: pages a running request holds were computed under the
    old weights: no later request may hit them, nor the pages that request fills afterwards,
    until they are freed and reused."""
    kv = KVCacheManager(16, 4)
    old = _request(8, "old")
    _run(kv, old, 8)  # 2 full pages, cached
    done = _request(12, "done")
    _run(kv, done, 12)
    kv.free(done)  # 3 cached free pages (2 of them shared with `old`)
    kv.reset_prefix_cache(held=True)
    assert not any(kv.groups[0].cached.values())
    # `old` goes on: its next full page is not cached either (its parents are stale).
    old.output_token_ids += [1, 2, 3, 4]
    _run(kv, old, 4)
    assert not any(kv.groups[0].cached.values())
    new = _request(8, "new")
    assert kv.get_computed_pages(new) == [[]]
    _run(kv, new, 8)  # computed under the new weights: cached again
    assert len(kv.groups[0].cached) == 2
    kv.free(old)
    assert all(not kv.groups[0].pages[p].stale for p in new.page_ids)
    again = _request(9, "again")  # (a whole-page prompt recomputes its last page)
    assert kv.get_computed_pages(again) == [new.page_ids]
