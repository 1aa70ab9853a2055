"""Calibration: the largest |x| each input channel of each layer matrix sees while the float
model reads a text (W8A8's activation smoothing, quantization/smoothing.py).

The model runs one window of tokens at a time as one sequence from position 0, a layer at a
time (one compiled layer per kind of layer), with dense causal attention and no pages; each
layer matrix is wrapped in an `Observed` weight, whose `apply` records the per-channel maxima
of its input. 969 tokens of the shipped text take about 5 s on the default model (2 vCPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import decoder, linear, training
from jaxllm.quantization import smoothing
from jaxllm.models.step_inputs import StepInputs

CALIBRATION_TEXT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quantization", "data", "calibration.txt"
)
# The matrices whose inputs are observed (those W8A8 quantizes; MoE experts are not).
OBSERVED = ("wqkv", "wo", "w_gate_up", "w_up", "w_down")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Observed:
    """A layer matrix under calibration: a linear weight (models/linear.py) whose `apply` keeps
    in `maxima[key]` the largest |x| it has seen in each input channel (under a trace, the
    traced value, which the traced function returns), then applies `weight`."""

    weight: object
    key: object
    maxima: dict

    def apply(self, x, *, axis=None, rows=None, swiglu=False):
        seen = jnp.max(jnp.abs(x.reshape(-1, x.shape[-1]).astype(jnp.float32)), axis=0)
        self.maxima[self.key] = jnp.maximum(self.maxima[self.key], seen) if self.key in self.maxima else seen
        return linear.apply(self.weight, x, axis=axis, rows=rows, swiglu=swiglu)

    input_dtype = jnp.float32  # x observed as the float model computes it


def activation_maxima(params, cfg: decoder.ModelConfig, windows: list[list[int]]) -> dict:
    """{(layer, name): max |x| [in] float32} over every token of `windows` (lists of token ids,
    each run as one sequence from position 0) for the OBSERVED matrices of `params` (one
    device, no shard layout, float weights)."""
    maxima: dict = {}
    # One compiled layer per kind of layer (window, RoPE table, MoE: `decoder.first_of_kind`) and
    # window length.
    inv_freq = cfg.inv_freq()
    for ids in windows:
        n = len(ids)
        if n == 0:
            continue
        positions = np.arange(n, dtype=np.int32)
        cos, sin = decoder.rope_tables(positions, inv_freq, np)
        inputs = StepInputs(
            token_ids=np.asarray(ids, np.int32),
            positions=positions,
            slot_mapping=positions,
            page_tables=np.zeros((1, 1), np.int32),
            query_start_loc=np.asarray([0, n], np.int32),
            seq_lens=np.asarray([n], np.int32),
            num_seqs=np.asarray(1, np.int32),
            logits_indices=np.asarray([n - 1], np.int32),
            rope_cos=cos,
            rope_sin=sin,
            attn_metadata={},
        )
        x = decoder.embed(params, inputs.token_ids, inputs.positions, cfg)
        for i, layer in enumerate(params["layers"]):
            x, seen = _observed_layer(layer, x, inputs, cfg=cfg, index=decoder.first_of_kind(cfg, i))
            for name, m in seen.items():
                m = np.asarray(m)
                maxima[(i, name)] = np.maximum(maxima[(i, name)], m) if (i, name) in maxima else m
    return maxima


@functools.partial(jax.jit, static_argnames=("cfg", "index"))
def _observed_layer(layer, x, inputs, *, cfg, index):
    """Decoder layer `index`'s kind on x, with its OBSERVED matrices' input maxima {name: [in]}."""
    seen: dict = {}
    layer = {name: Observed(w, name, seen) if name in OBSERVED else w for name, w in layer.items()}
    x, _, _ = decoder.decoder_layer(layer, None, None, x, inputs, cfg, index=index, attention=training.DENSE_ATTENTION)
    return x, seen


def text_windows(tokenizer, text: str | None = None, window: int = 512) -> list[list[int]]:
    """`text` (default: the calibration text jaxllm ships) as windows of `window` token ids."""
    if text is None:
        with open(CALIBRATION_TEXT, encoding="utf-8") as f:
            text = f.read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[i : i + window] for i in range(0, len(ids), window)]


def smooth_for_w8a8(params, cfg: decoder.ModelConfig, tokenizer, alpha: float = smoothing.ALPHA) -> bool:
    """Smooth `params` (in place) for W8A8 from the activations of the shipped calibration
    text; without a tokenizer, leave them as they are (and say so). Returns whether it smoothed."""
    if tokenizer is None:
        logger.warning(
            "w8a8: this model has no tokenizer to read the calibration text; activations are not "
            "smoothed (expect a larger accuracy loss)"
        )
        return False
    smoothing.smooth(params, cfg, activation_maxima(params, cfg, text_windows(tokenizer)), alpha)
    return True
