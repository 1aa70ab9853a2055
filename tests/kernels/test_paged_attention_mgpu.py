"""The Mosaic GPU ragged paged attention kernel against the jnp oracle, and the GPU backend choice.

Numerics run in Mosaic GPU's interpret mode on CPU (simulated shared memory, TMA copies and
barriers), compiled where a GPU is the default backend; the GPU lowering is checked by lowering
for `cuda` without a GPU, which runs Mosaic GPU's own lowering (layouts, MMA shapes,
shared-memory tiling) in Python.
"""

from __future__ import annotations

import functools
import logging
import types

import jax
import jax.numpy as jnp
import pytest

from jaxllm import attention
from jaxllm.kernels.paged_attention_mgpu import ragged_paged_attention_mgpu, unsupported

from tests.helpers import ROOT
from tests.helpers.attention_batches import MIXED, assert_matches_reference, make_batch
from tests.helpers.cuda_lowering import INTERPRET, arg, gpu_mesh, lower_for_cuda

TOL = 3e-2  # bf16 pages, q and softmax weights rounded to bf16 before the MMAs (as Triton's)


def check(args, **kwargs):
    out = ragged_paged_attention_mgpu(*args, interpret=INTERPRET, **kwargs)
    options = {k: v for k, v in kwargs.items() if k in ("sliding_window", "logits_soft_cap", "sm_scale")}
    return assert_matches_reference(out, args, TOL, **options)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,page_size", [(9, 3, 16), (8, 2, 32), (4, 4, 8)])
def test_mixed_prefill_and_decode(num_q_heads, num_kv_heads, page_size):
    """Decodes, chunks continuing a prefix, a chunk over two query tiles, padding rows (NaN and
    1e30) and stale cache slots (1e4): GQA groups of 3 (padded to 4), 4 and 1."""
    args = make_batch(
        0,
        **MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        pages_per_seq=64 // page_size + 1,
        cache_dtype="uint16",
    )
    check(args)


def test_long_contexts_wrap_the_copy_ring():
    """Contexts of up to 10 key blocks through a ring of 2 slots: every slot is refilled."""
    args = make_batch(
        1, q_lens=[1, 3, 40], kv_lens=[600, 97, 300], page_size=16, pages_per_seq=38, cache_dtype="bfloat16"
    )
    check(args, stages=2)


def test_page_table_rows_longer_than_one_copy():
    """Rows of 300 pages (an engine's max_model_len / page_size often passes 256, TMA's limit per
    copy) arrive in chunks; the long sequence's last keys sit on pages past the first chunk."""
    args = make_batch(3, q_lens=[1, 2], kv_lens=[2200, 9], page_size=8, pages_per_seq=300, cache_dtype="uint16")
    check(args, stages=2)


def test_sliding_window_and_soft_cap():
    """The window starts the key loop past the first blocks; the cap bends the scores."""
    args = make_batch(
        2, q_lens=[1, 30, 2], kv_lens=[300, 200, 33], page_size=16, pages_per_seq=20, cache_dtype="uint16"
    )
    check(args, sliding_window=70, logits_soft_cap=5.0, stages=2)


def test_refuses_what_it_cannot_read():
    f32 = make_batch(0, [1], [5])
    with pytest.raises(ValueError, match="float32 cache"):
        ragged_paged_attention_mgpu(*f32)
    assert unsupported((1, 8, 128), jnp.uint16, 16) is None
    assert "int8" in unsupported((1, 8, 128), jnp.int8, 16)
    assert "head_dim 48" in unsupported((1, 8, 48), jnp.bfloat16, 16)
    assert "page_size 12" in unsupported((1, 8, 64), jnp.bfloat16, 12)


def lower_kernel(num_q_heads, num_kv_heads, head_dim, page_size=16, mesh_devices=1, **kwargs):
    """The kernel lowered for `cuda` (optionally per shard of a `mesh_devices`-way tensor-parallel
    `shard_map`, as jaxllm/parallel.py runs it) on a 256-token step over 64 sequences."""
    from jax.sharding import PartitionSpec as P

    mesh = gpu_mesh(mesh_devices)
    sharded = mesh if mesh_devices > 1 else None
    q_spec, kv_spec = P(None, "model"), P("model")
    num_tokens, num_seqs_max, pages_per_seq = 256, 64, 128
    pages = arg((num_kv_heads, 2048, page_size, head_dim), jnp.uint16, sharded, kv_spec)
    args = (
        arg((num_tokens, num_q_heads, head_dim), jnp.bfloat16, sharded, q_spec),
        pages,
        pages,
        arg((num_seqs_max,), jnp.int32),
        arg((num_seqs_max, pages_per_seq), jnp.int32),
        arg((num_seqs_max + 1,), jnp.int32),
        arg((), jnp.int32),
    )
    f = functools.partial(ragged_paged_attention_mgpu, **kwargs)
    if mesh_devices > 1:
        f = jax.shard_map(
            f, mesh=mesh, check_vma=False, in_specs=(q_spec, kv_spec, kv_spec, P(), P(), P(), P()), out_specs=q_spec
        )
    return lower_for_cuda(f, *args, mesh=mesh)


@pytest.mark.parametrize(
    "shape",
    [
        dict(num_q_heads=9, num_kv_heads=3, head_dim=64),  # the default model
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128),  # Llama-3-8B
        dict(num_q_heads=64, num_kv_heads=8, head_dim=128, mesh_devices=8),  # Llama-3-70B, TP 8
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128, sliding_window=4096, logits_soft_cap=50.0),
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, block_kv=128, stages=2),
    ],
    ids=["default_model", "llama3_8b", "llama3_70b_tp8", "window_soft_cap", "pages_64"],
)
def test_lowers_for_cuda_with_mosaic_gpu(shape):
    text = lower_kernel(**shape)
    assert "mosaic_gpu_v2" in text
    if shape.get("mesh_devices"):  # each shard: 8 query heads over its one KV head
        assert "tensor<256x8x128xbf16>" in text and "tensor<1x2048x16x128xui16>" in text


def fake_device(platform, capability=None):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def test_backend_choice_on_a_gpu(monkeypatch):
    """A Hopper GPU gets the Mosaic GPU kernel by default; Ampere and Blackwell (no warpgroup
    MMA in this kernel) get Triton; a name always wins."""
    assert attention.mosaic_gpu_capable(fake_device("gpu", "9.0"))
    for device in (fake_device("gpu", "8.0"), fake_device("gpu", "10.0"), fake_device("gpu"), fake_device("cpu")):
        assert not attention.mosaic_gpu_capable(device)
    for capability, name in (("9.0", "mosaic"), ("8.6", "pallas")):
        monkeypatch.setattr(jax, "devices", lambda platform=None, c=capability: [fake_device("gpu", c)])
        assert attention.get_attention_backend(None, "gpu").name == name
    assert attention.get_attention_backend("pallas", "gpu").name == "pallas"


def test_mosaic_backend_sends_other_caches_to_triton(monkeypatch, caplog):
    """int8 rows (not TMA-aligned) go to the Triton kernel, with one log line per reason."""
    from jaxllm import kernels

    args = make_batch(3, **MIXED, cache_dtype="int8")
    triton = functools.partial(kernels.ragged_paged_attention, interpret=INTERPRET)
    monkeypatch.setattr(kernels, "ragged_paged_attention", triton)
    backend = attention.get_attention_backend("mosaic")
    with caplog.at_level(logging.INFO, logger="jaxllm.attention"):
        out = backend.kernel(*args)
        backend.kernel(*args)
    assert_matches_reference(out, args, 2e-5)
    assert caplog.text.count("the Triton kernel serves a int8 cache") == 1


def test_gpu_benchmark_smoke(tmp_path):
    """benchmarks/gpu.py at tiny shapes (on CPU the kernels run interpreted), so that it runs on
    the first GPU: both kernels' rows, the first case against the oracle, the quantized matmul's
    rows against the dequantized weight, and the engine over the
    random checkpoint it writes, which has no tokenizer (token ids in, token ids out)."""
    import importlib.util
    import pathlib

    from jaxllm import LLM, SamplingParams
    from jaxllm.bench.datasets import random_workload

    path = pathlib.Path(ROOT) / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("gpu_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke", "--out", str(tmp_path / "gpu.json"), "--workdir", str(tmp_path)])
    rows = result["kernels"]
    assert [r["kernel"] for r in rows] == ["mosaic", "triton"] * 2
    assert not [r for r in rows if "error" in r]
    assert [r["max_abs_err"] < TOL for r in rows if "max_abs_err" in r] == [True, True]
    quant = result["quantized_matmul"]
    assert [(r["method"], "error" in r) for r in quant] == [("int8", False), ("int4", False)]
    assert all(r["max_rel_err"] < 1e-4 for r in quant)  # f32 dots over the same dequantized weight
    workload = random_workload(4, (32, 256), (32, 128), 0, bench.SMOKE["vocab"], [])
    assert result["engine"]["output_tokens"] == sum(w["max_tokens"] for w in workload)

    llm = LLM(
        str(tmp_path / "llama3-8b-shape-2l"),
        dtype="float32",
        warmup=False,
        kv_cache_memory=4 << 20,
        params_cache_dir=str(tmp_path / "params"),
    )
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer: give prompt_token_ids"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer: stop strings"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(stop=["x"]), use_tqdm=False)
