"""Encoders (BERT) as data on the decoder: post-layer norms, learned positions with the token
type's row, bidirectional attention. Hidden states against HF transformers' BertModel on a tiny
random checkpoint; pooling's parts against NumPy (the pooling engine's tests, against
sentence-transformers too: tests/engine/test_pooling.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import pooling, training
from jaxllm.models.loader import load_model


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


def test_a_backend_without_bidirectional_attention_says_so():
    from jaxllm.attention import get_attention_backend

    with pytest.raises(NotImplementedError, match="no bidirectional attention"):
        get_attention_backend("pallas").forward(None, None, None, None, causal=False)


def test_pooling_modes_and_configs(tmp_path):
    """CLS, last token and mean over a step's ragged rows against NumPy, also for a sequence
    computed in two chunks (its parts merged); what a sentence-transformers directory declares,
    and what is refused."""
    import json

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((12, 5)).astype(np.float32)
    starts = np.array([0, 3, 4, 9, 9], np.int32)  # sequences of 3, 1 and 5 rows, a padded one; 3 padding rows
    for mode, want in [
        ("cls", hidden[[0, 3, 4]]),
        ("last", hidden[[2, 3, 8]]),
        ("mean", np.stack([hidden[0:3].mean(0), hidden[3:4].mean(0), hidden[4:9].mean(0)])),
    ]:
        config = pooling.PoolingConfig(mode, normalize=False)
        parts = np.asarray(pooling.chunk_parts(hidden, starts, mode))
        got = [config.finish(config.merge(None, parts[s]), n) for s, n in enumerate((3, 1, 5))]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert (parts[3] == 0).all()
        # The third sequence as two chunks (rows 4-5, then 6-8), one per step.
        first = np.asarray(pooling.chunk_parts(hidden, np.array([0, 3, 4, 6], np.int32), mode))[2]
        second = np.asarray(pooling.chunk_parts(hidden[6:], np.array([0, 3], np.int32), mode))[0]
        merged = config.merge(config.merge(None, first), second)
        np.testing.assert_allclose(config.finish(merged, 5), want[2], rtol=1e-6)
    np.testing.assert_allclose(pooling.embedding(np.array([3.0, 4.0, 12.0]), True), [3 / 13, 4 / 13, 12 / 13])
    np.testing.assert_allclose(pooling.embedding(np.array([3.0, 4.0, 12.0]), True, dimensions=2), [0.6, 0.8])
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
