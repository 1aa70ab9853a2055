"""SmoothQuant-style activation smoothing for W8A8 (`quantization="w8a8"` on float weights).

A per-token int8 scale is set by a token's largest channel, and a few input channels of a
layer matrix carry most of the activation range (here: the attention and MLP inputs of
SmolLM2-135M), so per-token codes flatten the other channels. For an input channel j with
activation range a_j = max |x_j| (from calibration, weights/calibration.py) and weight range
w_j = max_n |W[j, n]|, smoothing divides x_j and multiplies W's row j by

    s_j = a_j ** alpha / w_j ** (1 - alpha)          (alpha = 0.5: both ranges become sqrt(a_j w_j))

which leaves x @ W unchanged in exact arithmetic. The division is folded into whatever
produces x, so no op is added to the step:

| matrix             | x is                     | 1 / s folded into                                      |
|--------------------|--------------------------|--------------------------------------------------------|
| wqkv               | attn_norm(h)             | attn_norm's weight (and bias)                          |
| w_gate_up / w_up   | mlp_norm(h)              | mlp_norm's weight (and bias)                           |
| w_down (gated MLP) | act(gate) * up           | up's columns of w_gate_up (and their bias)             |
| wo                 | attention's output       | V's columns of wqkv (and bias): one s per KV head's    |
|                    |                          | channel, shared by the query heads that read it        |

MoE layers' MLPs and ungated w_down (act(up) is not linear in up) are left as they are.
On the default model (perplexity on the shipped public-domain text, bf16 23.86-23.88, W8A8
without smoothing 26.17 (+9.6%)), calibrated on the separate text `quantization/data/calibration.txt`.
One W8A8 run is one draw of the rounding: any change in the last bit of a float part (the norm
kernel, its output times 1 +- 1e-6) moves the perplexity by up to 1%, so alpha was chosen on
the mean of such draws (2026-11-27; the first choice, 0.7, came from single runs): alpha 0.5:
24.44-24.66, mean 24.57 (4 draws); 0.6: 23.95-24.28, mean 24.11 (+1.1%, 8 draws); 0.7:
24.09-24.58, mean 24.26 (10); 0.8: 24.53-24.67, mean 24.59 (4). Chosen on that same perplexity
text, so the figure is a little optimistic for other text.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

ALPHA = 0.6


def factors(x_max: np.ndarray, w_max: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """s [in] float32 from the input channels' activation and weight ranges; 1 where either
    range is zero (a channel never used), and clipped to [1e-3, 1e3]."""
    x_max, w_max = np.asarray(x_max, np.float64), np.asarray(w_max, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = x_max**alpha / w_max ** (1.0 - alpha)
    s = np.where((x_max > 0) & (w_max > 0) & np.isfinite(s), s, 1.0)
    return np.clip(s, 1e-3, 1e3).astype(np.float32)


def _rows_max(w) -> np.ndarray:
    return np.abs(np.asarray(w, np.float32)).max(axis=1)


def smooth(params, cfg, maxima: dict, alpha: float = ALPHA) -> None:
    """Fold smoothing factors into the float params tree (one device, no shard layout), in
    place (each changed entry replaced by a new float32 array). `maxima`: {(layer, name):
    max |x| [in]} from `weights.calibration.activation_maxima`."""
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    for i, layer in enumerate(params["layers"]):

        def fold_norm(norm: str, matrix: str):
            s = factors(maxima[(i, matrix)], _rows_max(layer[matrix]), alpha)
            layer[norm] = f32(layer[norm]) / s
            if norm + "_bias" in layer:
                layer[norm + "_bias"] = f32(layer[norm + "_bias"]) / s
            layer[matrix] = f32(layer[matrix]) * s[:, None]

        def fold_columns(matrix: str, bias: str, start: int, s: np.ndarray):
            cols = slice(start, start + s.size)
            for name in (matrix, bias):
                if name in layer:
                    w = f32(layer[name]).copy()
                    w[..., cols] /= s
                    layer[name] = w

        if (i, "wqkv") in maxima:
            # wo first: its factors are folded into V's columns, before wqkv's rows are scaled.
            if (i, "wo") in maxima:
                heads, hd = cfg.num_kv_heads, cfg.head_dim
                group = cfg.num_heads // heads
                per_kv = lambda a: np.asarray(a).reshape(heads, group, hd).max(axis=1)  # noqa: E731
                s = factors(per_kv(maxima[(i, "wo")]), per_kv(_rows_max(layer["wo"])), alpha).reshape(-1)
                fold_columns("wqkv", "bqkv", cfg.q_size + cfg.kv_size, s)
                layer["wo"] = f32(layer["wo"]) * np.repeat(s.reshape(heads, 1, hd), group, axis=1).reshape(-1, 1)
            fold_norm("attn_norm", "wqkv")
        if cfg.is_moe(i):
            continue
        if cfg.gated_mlp and (i, "w_down") in maxima and "w_gate_up" in layer:
            s = factors(maxima[(i, "w_down")], _rows_max(layer["w_down"]), alpha)
            fold_columns("w_gate_up", "b_gate_up", cfg.intermediate_size, s)
            layer["w_down"] = f32(layer["w_down"]) * s[:, None]
        for matrix in ("w_gate_up", "w_up"):
            if (i, matrix) in maxima:
                fold_norm("mlp_norm", matrix)
    logger.info("W8A8: activations smoothed (alpha %.2f) over %d layers", alpha, len(params["layers"]))
