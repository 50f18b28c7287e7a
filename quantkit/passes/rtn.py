"""Round-to-nearest weight quantization with the recipe's spec (the baseline every method is measured against)."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass, QuantizedLinear
from quantkit.quantizers import compute_qparams, ordered_quantize, quantize


@dataclass(frozen=True)
class RTNConfig:
    pass


@register
class RTN(Pass):
    name = "rtn"
    reads_activations = False
    Config = RTNConfig
    quantizes = True

    def quantize(self, work: LayerWork, names: list[str]) -> None:
        for name in names:
            spec = work.specs[name]
            w = work.weight(name).detach().float()
            order = work.group_order(work.linears[name])
            if order is not None:  # Atom: groups along the layer's column order
                codes, qp, g_idx = ordered_quantize(w, spec, order.to(w.device), work.scale_dtype)
                work.results[name] = QuantizedLinear(codes, qp, spec, g_idx)
                continue
            qp = compute_qparams(w, spec, work.scale_dtype, clip_ratio=work.clip.get(name))
            work.results[name] = QuantizedLinear(quantize(w, qp, spec), qp, spec)
