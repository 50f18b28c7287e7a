"""SqueezeLLM non-uniform quantization with Any-Precision incremental upscaling (the `squeezellm` quantizer).

Per output row: a sensitivity-weighted 1-D k-means with 2^min_bits centroids (the seed), the weights being the
diagonal Fisher information of each weight (`quantkit.fisher`, computed by the engine before the first block);
then every cluster is split in two, one bit at a time, up to `bits`, so the `bits`-wide codes prefix into every
narrower width's (`quantkit.nonuniform`). With min_bits == bits it is plain (dense-only) SqueezeLLM. The spec
comes from `weights: {granularity: channel, codebook: true, bits: P, min_bits: s}`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.nonuniform import any_precision
from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass, QuantizedLinear
from quantkit.quantizers import QParams


@dataclass(frozen=True)
class SqueezeLLMConfig:
    max_iter: int = 50  # Lloyd iterations of the seed clustering (it stops earlier once no border moves)
    restarts: int = 7  # weighted k-means++ starts of the seed beside the quantile start; the best per row is kept

    def __post_init__(self) -> None:
        if self.max_iter < 1:
            raise ValueError(f"max_iter must be at least 1, got {self.max_iter}")
        if self.restarts < 0:
            raise ValueError(f"restarts must be at least 0, got {self.restarts}")


@register
class SqueezeLLM(Pass):
    name = "squeezellm"
    Config = SqueezeLLMConfig
    quantizes = True
    needs_fisher = True

    def quantize(self, work: LayerWork, names: list[str]) -> None:
        for name in names:
            spec = work.specs[name]
            if not spec.codebook:
                raise ValueError(f"{name}: squeezellm needs codebook weights (weights.codebook: true, per channel)")
            w = work.weight(name).detach().float()
            codes, luts = any_precision(w, work.fisher[name], spec.min_bits or spec.bits, spec.bits,
                                        self.config.max_iter, self.config.restarts)
            # fp16 tables whatever the checkpoint's dtype: the anyprec format and kernel read fp16 (bf16 would lose
            # three bits of every centroid, and its small values are not all fp16 values)
            lut = torch.cat([luts[b].half().float() for b in sorted(luts)], dim=1)
            offset = 1 << (spec.bits - 1)
            qp = QParams(scale=None, zero=None, group_size=w.shape[1], lut=lut, code_offset=offset)
            work.results[name] = QuantizedLinear((codes - offset).to(torch.int8), qp, spec)
