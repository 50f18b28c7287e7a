"""Any-Precision LLM checkpoint (`anyprec`): one artifact that serves every width from the seed to the parent.

Per quantized linear `<module>`: `qweight` int32 [P, N, K/32], the parent codes as bitplanes, most significant
plane first, in the warp-coalesced column order of `anyprec_layout` (a b-bit model reads planes 0..b-1); and
`lut{b}` fp16 [N, 2^b] for every width b from the seed to the parent, each row's centroids in ascending order.
`config.json` gets `quantization_config: {quant_method: anyprec, seed_precision, parent_precision, group_count:
1}`, and the top-level `anyprec` entry the authors' loader (any-precision-llm's
`AnyPrecisionForCausalLM.from_quantized`) reads: the same widths and group count, and `arch_config`, where the
blocks sit (`model_name`, `layers_name`) and which linears of each block to build as `AnyPrecisionLinear`
(`module_names`, the quantized ones; the rest load as plain linears from their `weight`). Shapes: K a
multiple of 32 (a word holds 32 columns of a plane) and N of 4, the widths quantkit's kernels are tested at (its first
GEMV ran four rows a block; today's run 8 channels a block on CUDA cores and 16 on tensor cores, and guard channels
past N). The authors' kernel needs N a multiple of 16 for 2 to 8 rows of input.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from quantkit.formats.anyprec_layout import pack_planes, unpack_planes
from quantkit.formats.base import ExportError, Packer, stored_exactly
from quantkit.quantizers import QParams, QuantizedLinear, QuantSpec, lut_width

_LUT = re.compile(r"lut([1-8])")


class AnyPrecisionPacker(Packer):
    name = "anyprec"
    quant_method = "anyprec"
    float16_only = "any-precision-llm's AnyPrecisionLinear and kernels take float16 only"

    def check_recipe(self) -> None:
        """The authors' loader builds float16 models only (its tables are float16 whatever the model's dtype)."""
        self.require_fp16()

    def owns(self, key: str) -> bool:
        return key == "qweight" or _LUT.fullmatch(key) is not None

    def check(self, module: str, spec: QuantSpec, shape: tuple[int, int]) -> None:
        """Codebook weights per channel; K a multiple of 32 and N of 4 (module docstring)."""
        if not spec.codebook:
            raise ExportError(f"{module}: anyprec stores lookup-table weights (weights: {{granularity: channel, "
                              "codebook: true}}); use the squeezellm quantizer")
        n, k = shape
        if k % 32 or n % 4:
            raise ExportError(f"{module}: shape [N={n}, K={k}] does not fit anyprec's bitplanes (K must be a multiple "
                              "of 32, N of 4); use --set export.format=quantkit for a simulation artifact")

    def pack(self, q: QuantizedLinear) -> dict[str, torch.Tensor]:
        """`qweight` bitplanes of the parent codes and one fp16 `lut{b}` per width."""
        spec, qp = q.spec, q.qparams
        if qp.lut is None:
            raise ExportError("anyprec export needs lookup tables (the squeezellm quantizer)")
        codes = q.codes.detach().cpu().numpy().astype(np.int64) + qp.code_offset
        out = {"qweight": torch.from_numpy(pack_planes(codes, spec.bits))}
        for bits in range(spec.min_bits or spec.bits, spec.bits + 1):
            lut = lut_width(qp.lut, spec, bits)
            if not bool(torch.isfinite(lut).all()):
                raise ExportError(f"anyprec stores lut{bits} in float16, but the centroids are not all finite")
            out[f"lut{bits}"] = stored_exactly(lut, torch.float16, "anyprec", f"lut{bits}").contiguous()
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedLinear:
        """Exact inverse of `pack`: parent codes (signed domain) and every width's table, concatenated."""
        planes = tensors["qweight"].numpy()
        codes = unpack_planes(planes).astype(np.int64)
        widths = sorted(int(_LUT.fullmatch(k).group(1)) for k in tensors if _LUT.fullmatch(k))
        if planes.shape[0] != spec.bits or widths != list(range(spec.min_bits or spec.bits, spec.bits + 1)):
            raise ExportError(f"anyprec tensors hold {planes.shape[0]} planes and tables {widths}, the spec asks for "
                              f"widths {spec.min_bits or spec.bits}..{spec.bits}")
        lut = torch.cat([tensors[f"lut{b}"].float() for b in widths], dim=1)
        offset = 1 << (spec.bits - 1)
        qp = QParams(scale=None, zero=None, group_size=codes.shape[1], lut=lut, code_offset=offset)
        return QuantizedLinear(torch.from_numpy(codes - offset).to(torch.int8), qp, spec)

    def quantization_config(self, specs: dict[str, QuantSpec]) -> dict[str, Any]:
        widths = {(s.min_bits or s.bits, s.bits) for s in specs.values()}
        if len(widths) != 1:
            raise ExportError(f"anyprec checkpoints use one seed and parent width for every linear; got {widths}")
        seed, parent = widths.pop()
        return {"quant_method": self.quant_method, "seed_precision": seed, "parent_precision": parent, "group_count": 1}

    def config_entries(self, specs: dict[str, QuantSpec], layers_prefix: str,
                       linears: dict[str, tuple[str, ...]]) -> dict[str, Any]:
        """The `anyprec` entry: the loader takes `model_name` and `layers_name` as attribute paths from the causal
        LM to its block list, and replaces exactly the `module_names` of every block."""
        config = self.quantization_config(specs)
        model_name, _, layers_name = layers_prefix.rpartition(".")
        arch = {"model_name": model_name, "layers_name": layers_name,
                "module_names": [name for names in linears.values() for name in names]}
        return {"anyprec": {key: config[key] for key in ("seed_precision", "parent_precision", "group_count")}
                | {"arch_config": arch}}

    def notes(self, specs: dict[str, QuantSpec]) -> list[str]:
        return ["export format anyprec: safetensors, read by quantkit (eval --bits B picks the width) and by the "
                "any-precision-llm loader (AnyPrecisionForCausalLM.from_quantized; its CUDA kernels take float16)"]
