"""The executable store (runner/executables.py): a warm start loads every compiled step from
disk, runs it without compiling and gives the tokens a fresh compile gives; its keys follow what
the step depends on; bad files are recompiled; steps JAX's own cache loaded are not saved."""

import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.runner.compile import no_compile_guard
from jaxllm.runner.executables import ExecutableStore

from tests.helpers import ROOT
from tests.helpers.tiny_model import TINY_ENGINE_ARGS, WARM_ENGINE_ARGS

PROMPTS = ["Hello there", "The capital of France is", "def fibonacci(n):" * 9]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _files(directory):
    return sorted(os.listdir(os.path.join(directory, "executables")))


def test_a_warm_start_loads_every_step_and_gives_the_same_tokens(tiny_model_dir, tmp_path, caplog):
    cache = str(tmp_path)
    cold = LLM(tiny_model_dir, **WARM_ENGINE_ARGS, compilation_cache_dir=cache)
    buckets = len(cold.engine.runner.buckets)
    assert cold.engine.runner.steps.loaded == 0 and len(_files(cache)) == buckets
    expected = token_ids(cold.generate(PROMPTS, greedy(12), use_tqdm=False))
    del cold

    warm = LLM(tiny_model_dir, **WARM_ENGINE_ARGS, compilation_cache_dir=cache)  # loads in the background
    warm.engine.runner.wait_compiled()
    assert warm.engine.runner.steps.loaded == buckets
    with no_compile_guard():  # the loaded steps run as they are
        assert token_ids(warm.generate(PROMPTS, greedy(12), use_tqdm=False)) == expected
    del warm

    # Damaged files (one cut short, one with a byte flipped) are found by their checksum before
    # pickle or XLA see them: one warning line says what and what is done, and each is compiled
    # afresh and written again.
    victims = [os.path.join(cache, "executables", name) for name in _files(cache)[:2]]
    with open(victims[0], "r+b") as f:
        f.truncate(100)
    with open(victims[1], "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        again = LLM(tiny_model_dir, **WARM_ENGINE_ARGS, compilation_cache_dir=cache)
        again.engine.runner.wait_compiled()
    lines = [r.getMessage() for r in caplog.records if "compiled step" in r.getMessage()]
    assert len(lines) == 1 and "its checksum does not match (cut short or damaged)" in lines[0], lines
    assert "compiling it again and overwriting it" in lines[0]
    assert again.engine.runner.steps.loaded == buckets - 2 and again.engine.runner.steps.store.num_damaged == 2
    assert all(os.path.getsize(v) > 5000 for v in victims)
    assert token_ids(again.generate(PROMPTS, greedy(12), use_tqdm=False)) == expected


def test_only_the_steps_in_use_stay_loaded(tiny_model_dir, tmp_path):
    """A loaded step holds tens of MiB on XLA:CPU: a first start compiling in the background
    drops each step once saved but the smallest of each kind, a warm start loads only those,
    and the rest load when a demand first needs them, without compiling, giving the tokens a
    first start gives."""
    from concurrent.futures import wait

    cache, args = str(tmp_path), {**WARM_ENGINE_ARGS, "background_compile": True}
    cold = LLM(tiny_model_dir, **args, compilation_cache_dir=cache)
    steps = cold.engine.runner.steps
    wait(list(steps.pending.values()))
    firsts = set(filter(steps.first_of_kind, steps.buckets))
    assert set(steps.pending) == firsts and set(steps.stored) == set(steps.buckets) - firsts
    assert len(_files(cache)) == len(steps.buckets)
    expected = token_ids(cold.generate(PROMPTS, greedy(12), use_tqdm=False))
    del cold, steps

    warm = LLM(tiny_model_dir, **args, compilation_cache_dir=cache)
    steps = warm.engine.runner.steps
    assert set(steps.pending) == firsts and set(steps.stored) == set(steps.buckets) - firsts
    with no_compile_guard():
        assert token_ids(warm.generate(PROMPTS, greedy(12), use_tqdm=False)) == expected
        used = set(steps.ready) | set(steps.pending)
        assert used - firsts and set(steps.stored) == set(steps.buckets) - used  # loaded when first needed
        warm.engine.wait_compiled()  # loads the rest
    assert set(steps.ready) == set(steps.buckets) and not steps.stored and steps.loaded == len(steps.buckets)


def test_keys_follow_what_the_step_depends_on(tmp_path, monkeypatch):
    store = ExecutableStore(str(tmp_path), "cfg A", jax.devices()[:1])
    args = (np.zeros((4, 8), np.float32), [np.zeros(3, np.int32)])
    key = store.key("layout 1", args)
    assert store.key("layout 1", (np.ones((4, 8), np.float32), [np.ones(3, np.int32)])) == key  # values don't count
    others = [
        store.key("layout 2", args),
        store.key("layout 1", (np.zeros((4, 9), np.float32), [np.zeros(3, np.int32)])),
        store.key("layout 1", (np.zeros((4, 8), np.float16), [np.zeros(3, np.int32)])),
        store.key("layout 1", (np.zeros((4, 8), np.float32), (np.zeros(3, np.int32),))),
        store.key("layout 1", (jax.device_put(np.zeros((4, 8), np.float32)), [np.zeros(3, np.int32)])),
        ExecutableStore(str(tmp_path), "cfg B", jax.devices()[:1]).key("layout 1", args),
    ]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    others.append(ExecutableStore(str(tmp_path), "cfg A", jax.devices()[:1]).key("layout 1", args))
    assert len({key, *others}) == len(others) + 1


def test_steps_loaded_from_jax_persistent_cache_are_not_saved(tiny_model_dir, tmp_path):
    """With JAX's own cache on (as a JAX user may have it), a step it loads must not enter the
    store: re-serialized, such an executable fails to run on jax 0.10.2. Run in a subprocess,
    as turning JAX's cache on is for the whole process."""
    script = textwrap.dedent(f"""
        from jaxllm import LLM, SamplingParams
        from jaxllm.runner.compile import enable_persistent_cache
        from tests.helpers.tiny_model import WARM_ENGINE_ARGS
        enable_persistent_cache({str(tmp_path / "jax")!r})
        greedy = SamplingParams(temperature=0, max_tokens=6)
        outs = []
        for store in ("first", "second", "second"):
            llm = LLM({tiny_model_dir!r}, **WARM_ENGINE_ARGS, compilation_cache_dir={str(tmp_path)!r} + "/" + store)
            outs.append(llm.generate(["Hello there"], greedy, use_tqdm=False)[0].outputs[0].token_ids)
            print(store, llm.engine.runner.steps.loaded)
        assert outs[0] == outs[1] == outs[2], outs
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["first 0", "second 0", "second 0"]
    assert _files(str(tmp_path / "first")) and not os.path.exists(tmp_path / "second" / "executables")


def test_background_compile_gives_the_same_tokens(tiny_model_dir, tmp_path):
    cache = str(tmp_path)
    llm = LLM(tiny_model_dir, **{**WARM_ENGINE_ARGS, "background_compile": True}, compilation_cache_dir=cache)
    runner = llm.engine.runner
    assert len(runner.steps.pending) + len(runner.steps.ready) == len(runner.buckets)
    got = token_ids(llm.generate(PROMPTS, greedy(12), use_tqdm=False))
    llm.engine.wait_compiled()
    assert not runner.steps.pending and set(runner.steps.ready) == set(runner.buckets)
    with no_compile_guard():
        assert token_ids(llm.generate(PROMPTS, greedy(12), use_tqdm=False)) == got
    reference = LLM(tiny_model_dir, **WARM_ENGINE_ARGS, compilation_cache_dir="")  # compiled up front
    assert token_ids(reference.generate(PROMPTS, greedy(12), use_tqdm=False)) == got


def test_shutdown_cancels_the_shapes_not_yet_compiling(tiny_model_dir):
    """A server stopped while it compiles in the background exits without compiling the rest
    (the pool's threads are joined at exit); a cancelled shape still compiles when asked for."""
    llm = LLM(tiny_model_dir, **{**WARM_ENGINE_ARGS, "background_compile": True}, compilation_cache_dir="")
    steps = llm.engine.runner.steps
    pending = dict(steps.pending)
    llm.engine.shutdown()
    cancelled = [bucket for bucket, future in pending.items() if future.cancelled()]
    assert cancelled and len(cancelled) < len(pending) + len(steps.ready)
    assert steps.get(cancelled[0]) is steps.ready[cancelled[0]]


def test_a_dropped_engine_stops_compiling_in_the_background(tiny_model_dir):
    """An engine replaced while it compiles (a notebook cell run again) cancels the shapes not
    yet compiling: its steps hold the runner weakly, so dropping the engine frees it."""
    llm = LLM(tiny_model_dir, **{**WARM_ENGINE_ARGS, "background_compile": True}, compilation_cache_dir="")
    pending = dict(llm.engine.runner.steps.pending)
    del llm
    cancelled = [future for future in pending.values() if future.cancelled()]
    # Only the shapes the pool's threads (one per core) had started went on.
    assert cancelled and len(pending) - len(cancelled) <= len(os.sched_getaffinity(0))


def test_a_step_takes_the_smallest_ready_bucket_that_holds_it(tiny_model_dir):
    from concurrent.futures import Future

    runner = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, compilation_cache_dir="").engine.runner
    one_decode = (1, 1, 0, 1)  # tokens, decodes, prefill rows, sequences
    smallest, largest = runner.buckets[0], runner.buckets[-1]
    futures = {b: Future() for b in runner.buckets}
    runner.steps.pending = dict(futures)
    assert runner.steps.pick(one_decode) == smallest  # nothing ready: wait for its own
    runner.steps.ready = {largest: None}
    del runner.steps.pending[largest]
    assert runner.steps.pick(one_decode) == largest  # a larger ready one serves at once
    futures[runner.buckets[1]].set_result(None)
    assert runner.steps.pick(one_decode) == runner.buckets[1]  # the smallest ready one
    futures[smallest].set_result(None)
    assert runner.steps.pick(one_decode) == smallest
    assert runner.steps.pick((largest.num_tokens, 0, 1, 1)) == largest  # only the largest holds it
    runner.steps.pending = {}


def test_a_prompt_among_few_decodes_runs_in_the_small_mixed_bucket_with_the_same_results(tiny_model_dir):
    """Each mixed token count has a bucket for up to FEW_DECODES decodes beside the one for
    every decode: a prompt chunk among 3 decodes runs in the small one, and samples what the
    large one samples."""
    from jaxllm.runner.compile import FEW_DECODES

    engine = LLM(tiny_model_dir, **TINY_ENGINE_ARGS, compilation_cache_dir="").engine
    runner = engine.runner
    for i in range(3):
        engine.add_request(f"d{i}", PROMPTS[i], greedy(20))
    for _ in range(3):
        engine.step()
    engine.add_request("p", list(range(5, 45)), greedy(20))
    scheduled = engine.engine_core.scheduler.schedule().scheduled
    assert sorted(q for _, q in scheduled) == [1, 1, 1, 40]
    small = runner.steps.pick(runner.builder.demand(np.array([q for _, q in scheduled])))
    large = max(
        (b for b in runner.buckets if b.num_tokens == small.num_tokens and not b.all_logits), key=lambda b: b.num_seqs
    )
    max_num_seqs = TINY_ENGINE_ARGS["max_num_seqs"]
    assert (small.num_decode_rows, large.num_decode_rows) == (FEW_DECODES, max_num_seqs) and small.num_prefill_rows
    results = []
    for bucket in (small, large):
        _, first, _, buffers = runner.builder.prepare(scheduled, bucket)
        *out, runner.kv_cache = runner.call(bucket, *runner.builder.pack(buffers))  # (the pages are donated)
        results.append(tuple(np.asarray(x)[first] for x in out[:2]))  # each sequence's token, logprob
    assert results[0][0].tolist() == results[1][0].tolist()
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)


def test_background_compilation_starts_with_the_first_shapes_a_request_needs():
    """A request's first step is a prompt chunk, its next ones decodes: the smallest shape of
    each kind is compiled first, then the rest from the smallest."""
    from jaxllm.runner.compile import make_buckets
    from jaxllm.runner.executables import CompiledSteps

    class Jitted:  # a step that compiles at once
        def lower(self, bucket, layout):
            return self

        def compile(self):
            return "compiled"

    buckets = make_buckets(
        max_num_seqs=128,
        max_num_batched_tokens=512,
        prefill_row_tokens=32,
        max_num_prefill_seqs=8,
        num_speculative_tokens=2,
        max_spec_seqs=4,
    )
    steps = CompiledSteps(Jitted(), buckets, None, lambda bucket: (None, (bucket,)))
    steps.start(progress=False)
    submitted = list(steps.pending)  # in the order they went to the pool
    steps.wait()
    # (tokens, has prompt-chunk rows, all logits): 2 decodes, 32 tokens with chunks, 1 sequence + 1 draft
    assert {(b.num_tokens, b.num_prefill_rows > 0, b.all_logits) for b in submitted[:3]} == {
        (2, False, False),
        (32, True, False),
        (2, True, True),
    }
    rest = submitted[3:]
    assert [b.num_tokens for b in rest] == sorted(b.num_tokens for b in rest)
    assert set(steps.ready) == set(buckets)


def test_buckets_of_their_own_kind_keep_prompts_off_the_verification_shapes():
    """A verification bucket (logits for every token) holds a short prompt too, and serves it
    unless the steps keep each kind apart (`own_kind`: where verification steps take weights on
    another GEMM path, a prompt must still compute what it does without drafts)."""
    from jaxllm.runner.compile import make_buckets
    from jaxllm.runner.executables import CompiledSteps

    buckets = make_buckets(128, 512, 32, 8, num_speculative_tokens=3, max_spec_seqs=4)
    prompt, check = (9, 0, 1, 1, False), (8, 0, 2, 2, True)  # a 9-token prompt; 2 sequences, 3 drafts each
    shared = CompiledSteps(None, buckets, None, None)
    apart = CompiledSteps(None, buckets, None, None, own_kind=True)
    assert shared.pick(prompt).all_logits  # (the smallest that holds it)
    assert not apart.pick(prompt).all_logits and apart.pick(prompt).num_tokens == 32
    assert apart.pick(check) == shared.pick(check) and apart.pick(check).all_logits


def test_the_store_keeps_under_its_size_dropping_the_least_recently_used(tmp_path):
    import jax.numpy as jnp

    f = jax.jit(lambda x: x * 2 + 1)
    store = ExecutableStore(str(tmp_path), "cfg", jax.devices()[:1])
    keys = []
    for n in (3, 4, 5):
        compiled = f.lower(jnp.zeros(n)).compile()
        keys.append(store.key("layout", (jnp.zeros(n),)))
        store.save(keys[-1], compiled)
        os.utime(store._path(keys[-1]), (1000 + n, 1000 + n))  # saved in this order
    size = os.path.getsize(store._path(keys[0]))
    assert store.load(keys[0])(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]  # a load refreshes keys[0]
    store.max_bytes = int(2.5 * size)
    compiled = f.lower(jnp.zeros(6)).compile()
    store.save(store.key("layout", (jnp.zeros(6),)), compiled)
    assert [store.has(k) for k in keys] == [True, False, False] and len(os.listdir(tmp_path)) == 2


def test_a_failed_save_leaves_nothing_partial_and_a_read_only_store_only_warns(tmp_path, monkeypatch, caplog):
    """A write that fails midway (a full disk: the rename raises ENOSPC) leaves no temporary
    file and no entry; a read-only store folder only warns (once a store); entries written whole
    load back."""
    import errno

    from jaxllm.runner import executables

    compiled = jax.jit(lambda x: x * 2 + 1).lower(np.zeros(4, np.float32)).compile()
    store = ExecutableStore(str(tmp_path / "store"), "cfg", jax.devices()[:1])

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    caplog.set_level(logging.DEBUG, logger="jaxllm")
    with monkeypatch.context() as patch:
        patch.setattr(executables.os, "replace", full_disk)
        store.save("k1", compiled)
    assert os.listdir(tmp_path / "store") == [] and "No space left on device" in caplog.text
    store.save("k2", compiled)
    np.testing.assert_array_equal(store.load("k2")(np.ones(4, np.float32)), np.full(4, 3.0))

    def read_only(*_, **__):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as patch:  # (chmod does not stop root, who runs CI)
        patch.setattr(executables.tempfile, "mkstemp", read_only)
        store.save("k3", compiled)
    assert sorted(os.listdir(tmp_path / "store")) == ["step-k2.bin"] and "Read-only file system" in caplog.text
    # One warning a store (a full or read-only disk fails every step alike); the rest at debug level.
    failures = [r for r in caplog.records if "could not save" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG]
