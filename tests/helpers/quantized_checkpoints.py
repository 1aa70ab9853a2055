"""Quantized weights and checkpoints written by reference code: the scheme by hand
(`reference_weight`), a float checkpoint of quantized values (`fake_quantized_checkpoint`),
GGUF blocks and a GGUF of every kept block type, AWQ / GPTQ checkpoints packed as AutoAWQ and
AutoGPTQ define them."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from jaxllm.quantization import METHODS


def reference_weight(w: np.ndarray, bits: int, group: int | None) -> np.ndarray:
    """The scheme by hand: what each weight becomes (float64)."""
    k, n = w.shape
    rows = k if group is None or k % group else group
    out = np.empty((k, n))
    for g0 in range(0, k, rows):
        block = w[g0 : g0 + rows].astype(np.float64)
        if bits == 8:  # the scale kept as f32
            s = (np.abs(block).max(0) / 127).astype(np.float32).astype(np.float64)
            s[s == 0] = 1
            out[g0 : g0 + rows] = np.clip(np.round(block / s), -127, 127) * s
        else:  # the offset (the minimum) and the scale (the range / 15) kept as f16
            lo = block.min(0).astype(np.float16).astype(np.float64)
            s = ((block.max(0) - lo) / 15).astype(np.float16).astype(np.float64)
            s[s == 0] = 1
            out[g0 : g0 + rows] = np.clip(np.round((block - lo) / s), 0, 15) * s + lo
    return out


def fake_quantized_checkpoint(model_dir: str, method: str, out: str) -> str:
    """`model_dir` with every matrix (the Linear weights and the tied embedding) replaced by the
    values `method` gives it, in float32: the float engine on it is the quantized engine's
    reference. Fusing QKV and gate/up concatenates output columns, which have their own scales,
    so quantizing each HF matrix alone gives the same values."""
    import torch
    import transformers

    bits, group = METHODS[method]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:  # [out, in]; the LM head (here the embedding) is int8 under int4
                head = "embed" in name or "lm_head" in name
                b, g = (8, None) if head and method == "int4" else (bits, group)
                p.copy_(torch.from_numpy(reference_weight(p.numpy().T, b, g).T.astype(np.float32)))
    model.save_pretrained(out)
    for name in os.listdir(model_dir):
        if "token" in name or "template" in name:
            shutil.copy(os.path.join(model_dir, name), out)
    return out


PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5", "def main():"]


def gguf_blocks(rng, shape: tuple[int, int], ggml_type: int) -> np.ndarray:
    """Raw GGUF rows [out, bytes] of `ggml_type`: gguf-py's quantizer where it has one, else
    random blocks with small f16 super-block scales (the K-quants)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf.quants import quantize

    try:
        return quantize((0.3 * rng.standard_normal(shape)).astype(np.float32), ggml_type)
    except NotImplementedError:
        elems, size = GGML_QUANT_SIZES[ggml_type]
        blocks = rng.integers(0, 256, (shape[0], shape[1] // elems, size), dtype=np.uint8)
        for at in {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[ggml_type]:  # d (and dmin)
            d = rng.uniform(2e-4, 1e-3, blocks.shape[:2]).astype(np.float16)
            blocks[..., at : at + 2] = d[..., None].view(np.uint8)
        return blocks.reshape(shape[0], -1)


def write_quantized_gguf(path: str, untied: bool = False, int8_dots: bool = False) -> str:
    """A tiny 2-layer Llama GGUF (no tokenizer) whose matrices use every kept block type, fused
    parts of different types included; a Q8_0 embedding is the (tied) LM head, or `untied`: a
    Q4_K table and a Q6_K `output.weight` (Qwen2.5-Coder-1.5B's Q4_K_M types). `int8_dots`:
    untied, and Q6_K for the first layer's Q8_0 `attn_v`: every matrix of a type the int8 dot
    kernels take (quantization/gguf_blocks.py `INT8_DOT_TYPES`)."""
    untied = untied or int8_dots
    import gguf
    from gguf.constants import GGMLQuantizationType as T

    hidden, ff, heads, kv_heads, vocab = 256, 512, 4, 2, 512
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [
        ("block_count", 2),
        ("context_length", 512),
        ("embedding_length", hidden),
        ("feed_forward_length", ff),
        ("head_count", heads),
        ("head_count_kv", kv_heads),
        ("layer_norm_rms_eps", 1e-5),
        ("rope_freq_base", 10000.0),
    ]:
        getattr(writer, f"add_{add}")(value)
    rng = np.random.default_rng(1)
    layers = [
        {
            "attn_q": T.Q4_K,
            "attn_k": T.Q6_K,
            "attn_v": T.Q6_K if int8_dots else T.Q8_0,
            "attn_output": T.Q4_0,
            "ffn_gate": T.Q4_1,
            "ffn_up": T.Q5_K,
            "ffn_down": T.Q5_0,
        },
        {
            "attn_q": T.Q4_1,
            "attn_k": T.Q4_1,
            "attn_v": T.Q4_1,
            "attn_output": T.Q5_1,
            "ffn_gate": T.Q4_K,
            "ffn_up": T.Q4_K,
            "ffn_down": T.Q6_K,
        },
    ]
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ff, hidden),
        "ffn_up": (ff, hidden),
        "ffn_down": (hidden, ff),
    }
    table = T.Q4_K if untied else T.Q8_0
    writer.add_tensor("token_embd.weight", gguf_blocks(rng, (vocab, hidden), table), raw_dtype=table)
    if untied:
        writer.add_tensor("output.weight", gguf_blocks(rng, (vocab, hidden), T.Q6_K), raw_dtype=T.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i, types in enumerate(layers):
        for name, t in types.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", gguf_blocks(rng, shapes[name], t), raw_dtype=t)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_groups(w: np.ndarray, bits: int, group: int, perm: np.ndarray | None):
    """w [out, in] -> q [in, out], zeros [G, out] (integers), f16 scales [G, out], and the
    weight [out, in] they stand for; input row perm[i] (row i without perm) is in group i // group."""
    out, k = w.shape
    order = np.arange(k) if perm is None else perm
    g_idx = np.empty(k, np.int64)
    g_idx[order] = np.arange(k) // group
    top = (1 << bits) - 1
    q = np.empty((k, out), np.int64)
    zeros, scales = np.empty((k // group, out), np.int64), np.empty((k // group, out), np.float16)
    for g in range(k // group):
        rows = g_idx == g
        lo, hi = w[:, rows].min(1), w[:, rows].max(1)
        scales[g] = ((hi - lo) / top).astype(np.float16)
        s = scales[g].astype(np.float64)
        zeros[g] = np.clip(np.round(-lo / s), 0, top)
        q[rows] = np.clip(np.round(w[:, rows] / s[:, None] + zeros[g][:, None]), 0, top).T
    deq = (scales[g_idx].astype(np.float64) * (q - zeros[g_idx])).T
    return q, zeros, scales, g_idx, deq


def pack_along(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Integers -> int32 words of 32 / bits fields along `axis` (field j at bits j * bits;
    with `order`, field j holds value order[j] of each run of 32 / bits)."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((v.shape[0] // per, *v.shape[1:]), np.uint32)
    for j in range(per):
        words |= v[(order[j] if order else j) :: per] << np.uint32(bits * j)
    return np.ascontiguousarray(np.moveaxis(words, 0, axis)).view(np.int32)


def write_quantized_hf(model_dir: str, method: str, bits: int, act_order: bool, out: str, ref: str):
    """`model_dir`'s layer Linears as an AWQ / GPTQ checkpoint in `out` (group size 32), and the
    float checkpoint of the values its codes stand for in `ref`."""
    import torch
    import transformers
    from safetensors.numpy import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = np.random.default_rng(bits)
    tensors, perms = {}, {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            linear = name.startswith("model.layers.") and p.ndim == 2
            if not linear:
                tensors[name] = p.numpy().copy()
                continue
            prefix = name.removesuffix(".weight")
            # One act-order per input: q/k/v share theirs, as gate/up do (GPTQ sorts each layer's
            # input rows by its Hessian, the same matrix for Linears reading the same input).
            shared = prefix.rsplit(".", 1)[0] + ("" if prefix.endswith(("o_proj", "down_proj")) else "/in")
            if act_order and shared not in perms:
                perms[shared] = rng.permutation(p.shape[1])
            q, zeros, scales, g_idx, deq = quantize_groups(p.numpy(), bits, 32, perms.get(shared))
            p.copy_(torch.from_numpy(deq.astype(np.float32)))
            if method == "awq":
                tensors[prefix + ".qweight"] = pack_along(q, 4, 1, AWQ_ORDER)
                tensors[prefix + ".qzeros"] = pack_along(zeros, 4, 1, AWQ_ORDER)
            else:
                tensors[prefix + ".qweight"] = pack_along(q, bits, 0)
                tensors[prefix + ".qzeros"] = pack_along(zeros - 1, bits, 1)  # stored minus one
                if act_order or bits == 4:  # the 8-bit case leaves g_idx out, as some checkpoints do
                    tensors[prefix + ".g_idx"] = g_idx.astype(np.int32)
            tensors[prefix + ".scales"] = scales
    model.save_pretrained(ref)
    os.makedirs(out)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": act_order, "sym": False}
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(model_dir):
        if "token" in name or "template" in name:
            for d in (out, ref):
                shutil.copy(os.path.join(model_dir, name), d)
