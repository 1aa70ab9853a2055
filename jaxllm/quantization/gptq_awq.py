"""AWQ and GPTQ checkpoints: their packed int32 tensors as `QuantizedRows`, so the weights run
as they were quantized (weight-only, 4-bit codes with a scale and zero per group of input rows).

A quantized Linear `<prefix>` stores, in place of `<prefix>.weight [out, in]`:

- GPTQ (AutoGPTQ / GPTQModel, `quant_method: "gptq"`, 4 or 8 bits): `qweight` int32
  [in * bits / 32, out], input row i * (32 / bits) + j in bits [j * bits, (j + 1) * bits) of
  word i; `qzeros` int32 [G, out * bits / 32], packed the same way along `out`; `scales` f16
  [G, out]; `g_idx` int32 [in], each input row's group. w = scale * (q - zero), where the
  stored zero is zero - 1 (`checkpoint_format: "gptq"`, not "gptq_v2"). With act-order
  (`desc_act`) the groups are not contiguous rows: the rows are sorted by group (`perm`).
- AWQ (AutoAWQ's GEMM layout, `quant_method: "awq"`, 4 bits): `qweight` int32 [in, out / 8],
  eight outputs a word in the order 0, 2, 4, 6, 1, 3, 5, 7; `qzeros` int32 [G, out / 8], the
  same way; `scales` f16 [G, out]. w = scale * (q - zero).

Here w = code * scale + offset with offset = -scale * zero (f32: exact); 8-bit codes are
stored as q - 128, signed.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxllm.quantization.checkpoint import QuantizedRows

_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # word nibble j holds output 8c + _AWQ_ORDER[j]


def checkpoint_quantization(config: dict) -> dict | None:
    """An HF config's `quantization_config`, checked: {"method", "bits", "group_size", "v2"},
    or None for a float checkpoint. Raises ValueError for a method or layout not supported."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4 or not qc.get("zero_point", True):
            raise ValueError(
                f"AWQ checkpoints are supported in the 4-bit GEMM layout with zero points, not "
                f"version={version!r}, bits={bits}, zero_point={qc.get('zero_point')}"
            )
    elif method == "gptq":
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints are supported with 4 or 8 bits, not {bits}")
    else:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported (awq, gptq; or a GGUF)")
    return {
        "method": method,
        "bits": bits,
        "group_size": group,
        "v2": str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2",
    }


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32 / bits fields (low bits first), spread along `axis`."""
    per = 32 // bits
    w = np.asarray(words).view(np.uint32)
    fields = (w[..., None] >> (bits * np.arange(per, dtype=np.uint32))) & np.uint32((1 << bits) - 1)
    fields = np.moveaxis(fields, -1, axis + 1) if axis == 0 else fields
    shape = list(w.shape)
    shape[axis] *= per
    return fields.reshape(shape).astype(np.int32)


def quantized_linear(read: Callable[[str], np.ndarray | None], qc: dict, shape: tuple[int, int]) -> QuantizedRows:
    """The Linear of `shape` [out, in] from its tensors (`read(".qweight")` etc.; None for a
    tensor the checkpoint lacks) as QuantizedRows."""
    out, k = shape
    bits = qc["bits"]
    t = {suffix: read(suffix) for suffix in (".qweight", ".qzeros", ".scales", ".g_idx")}
    missing = [suffix for suffix in (".qweight", ".qzeros", ".scales") if t[suffix] is None]
    if missing:
        raise ValueError(f"a quantized Linear of shape {shape} has no {', '.join(missing)}")
    scales = np.asarray(t[".scales"], np.float32)  # [G, out]
    if qc["method"] == "awq":
        q = _unpack(t[".qweight"], 4, 1).reshape(k, out // 8, 8)[..., np.argsort(_AWQ_ORDER)].reshape(k, out)
        zeros = _unpack(t[".qzeros"], 4, 1).reshape(-1, out // 8, 8)[..., np.argsort(_AWQ_ORDER)].reshape(-1, out)
    else:
        q = _unpack(t[".qweight"], bits, 0)  # [in, out]
        zeros = _unpack(t[".qzeros"], bits, 1) + (0 if qc["v2"] else 1)
    groups = scales.shape[0]
    if q.shape != (k, out) or zeros.shape != (groups, out) or k % groups:
        raise ValueError(
            f"quantized Linear of shape {shape}: qweight unpacks to {q.shape}, qzeros to "
            f"{zeros.shape}, scales are {scales.shape}"
        )
    perm = None
    if qc["method"] == "gptq":
        contiguous = np.arange(k) // (k // groups)
        # Absent in some checkpoints: contiguous groups.
        g_idx = contiguous if t[".g_idx"] is None else np.asarray(t[".g_idx"], np.int64)
        if not np.array_equal(g_idx, contiguous):  # act-order: sort the rows by group
            perm = np.argsort(g_idx, kind="stable").astype(np.int32)
            if not np.array_equal(g_idx[perm], contiguous):
                raise ValueError("GPTQ g_idx does not give every group the same number of rows")
            q = q[perm]
    codes = q.T  # [out, in]
    if bits == 8:
        codes, zeros = codes - 128, zeros - 128
    offset = -scales * zeros
    codes = np.ascontiguousarray(codes, np.int8 if bits == 8 else np.uint8)
    return QuantizedRows(codes, np.ascontiguousarray(scales.T), np.ascontiguousarray(offset.T), bits, perm)
