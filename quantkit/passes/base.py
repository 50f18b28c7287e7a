"""What a calibration pass sees and produces: one decoder block, its calibration statistics, its results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from quantkit.quantizers import QParams, QuantSpec, dequantize


@dataclass
class QuantizedLinear:
    """Integer codes [N, K] (signed int8 domain) with their qparams; `g_idx` maps columns to groups if permuted."""

    codes: torch.Tensor
    qparams: QParams
    spec: QuantSpec
    g_idx: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.qparams, self.g_idx)

    def to(self, device: torch.device | str) -> QuantizedLinear:
        """The same result with every tensor on `device` (packers work on the CPU)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        qp = QParams(move(self.qparams.scale), move(self.qparams.zero), self.qparams.group_size)
        return QuantizedLinear(move(self.codes), qp, self.spec, move(self.g_idx))


@dataclass
class LayerWork:
    """One decoder block under calibration: the modules, per-linear specs, statistics, results and notes."""

    index: int
    block: nn.Module
    linears: dict[str, str]  # block-relative linear name -> role
    specs: dict[str, QuantSpec]
    scale_dtype: torch.dtype = torch.float16
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # role -> H = 2/n * X^T X (float32)
    results: dict[str, QuantizedLinear] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def weight(self, name: str) -> torch.Tensor:
        return self.block.get_submodule(name).weight

    def hessian(self, name: str) -> torch.Tensor:
        return self.hessians[self.linears[name]]


class Pass:
    """A calibration step registered by name; `run` transforms or quantizes one block in place."""

    name: ClassVar[str]
    Config: ClassVar[type]
    quantizes: ClassVar[bool] = False  # produces the block's quantized weights
    needs_hessian: ClassVar[bool] = False

    def __init__(self, config: Any):
        self.config = config

    def run(self, work: LayerWork) -> None:  # pragma: no cover - interface
        raise NotImplementedError
