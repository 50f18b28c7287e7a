"""quantkit's own simulation artifact: exactly what the quantizer computed, loadable only by quantkit.

Tensors per linear, named relative to the module:
- `weight_codes` int8 [N, K]: the signed codes, natural column order;
- `weight_<field>` for every QParams tensor field that is set, in the dtype quantkit holds it (no rounding):
  `weight_scale` fp32 [N or 1, G], `weight_zero` int32 [N, G], `weight_szero` fp32 [N, G], `weight_s1` fp32
  [N, 1], `weight_s2` fp32 [N, G] (integers), `weight_code_lo` / `weight_code_hi` int32 [N, G],
  `weight_offset` fp32 [N, G] (LiquidQuant's group minimum, integers);
- `weight_g_idx` [K] (the column -> group map) when the columns were permuted;
- `weight_meta` int64 [4]: (layout version 1, group_size, protect or -1 when unset, code_offset).
No inference engine reads this format; it exists for research and for shapes or schemes no engine format
expresses.
"""

from __future__ import annotations

from typing import Any

import torch

from quantkit.formats.base import ExportError, Packer
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec

VERSION = 1
NOTE = "simulation artifact; no inference engine loads it"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `t` that shares no storage with it (safe to save under its own name)."""
    return t.detach().to("cpu", copy=True).contiguous()


class NativePacker(Packer):
    name = "quantkit"
    quant_method = "quantkit"

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """Every spec and shape the quantizer handles can be stored."""

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        """`weight_codes`, one `weight_<field>` per set QParams tensor, `weight_g_idx` if any, and `weight_meta`."""
        spec, qp = q.spec, q.qparams
        if spec.progressive and (qp.s1 is None or qp.s2 is None or qp.code_lo is None or qp.code_hi is None):
            raise ExportError("quantkit export: a progressive linear lacks its s1/s2/code-bound parameters")
        if spec.zero_form == "scaled" and qp.szero is None:
            raise ExportError("quantkit export: a scaled-zero linear lacks its szero parameter")
        out = {"weight_codes": _cpu(q.codes)}
        for field in QParams.TENSORS:
            value = getattr(qp, field)
            if value is not None:
                out[f"weight_{field}"] = _cpu(value)
        if q.g_idx is not None:
            out["weight_g_idx"] = _cpu(q.g_idx)
        protect = -1 if qp.protect is None else qp.protect
        out["weight_meta"] = torch.tensor([VERSION, qp.group_size, protect, qp.code_offset], dtype=torch.int64)
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`."""
        meta = [int(v) for v in tensors["weight_meta"].tolist()]
        if len(meta) != 4 or meta[0] != VERSION:
            raise ExportError(f"quantkit artifact: unknown weight_meta layout {meta} (expected version {VERSION})")
        _, group_size, protect, code_offset = meta
        fields = {f: tensors.get(f"weight_{f}") for f in QParams.TENSORS}
        qp = QParams(group_size=group_size, protect=None if protect < 0 else protect, code_offset=code_offset,
                     **fields)
        return QuantizedLinear(tensors["weight_codes"], qp, spec, tensors.get("weight_g_idx"))

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        """Marks the checkpoint as quantkit-only so no engine mistakes it for a format it loads."""
        return {"quant_method": self.quant_method, "note": NOTE}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        """The artifact is for quantkit's simulation only."""
        return [f"export format quantkit: {NOTE} (quantkit's own loader reads it)"]
