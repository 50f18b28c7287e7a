"""Function-preserving rewrites of the residual stream: RMSNorm folding and the offline Hadamard rotation.

`fold_norms` multiplies each RMSNorm weight gamma into the input columns of the linears it feeds (q/k/v after
the input norm, gate/up after the post-attention norm, lm_head after the final norm) and sets gamma = 1, so
that the residual stream can be rotated (QServe's loader also ignores norm tensors). `rotate` then applies one
orthogonal Q = H_n / sqrt(n) (deterministic scaled Hadamard of the hidden size, digest-qserve P2) offline:
embeddings E <- E Q, block input modules W <- W Q, block output modules (and biases) W <- Q^T W, lm_head
W <- W Q. RMSNorm commutes with Q because ||xQ|| = ||x||, so the FP model computes the same function.
Each pass takes its products in float64 and rounds them once to the storage dtype (a weight that fold_norms and
rotate both rewrite is rounded twice, each time within half an ulp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from quantkit.errors import QuantkitError
from quantkit.hadamard import rotation
from quantkit.models.source import ModelEdges
from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass


def _scale_columns(module: torch.nn.Linear, gamma: torch.Tensor) -> None:
    w = module.weight
    w.data = (w.data.double() * gamma.double()).to(w.dtype)


@dataclass(frozen=True)
class FoldNormsConfig:
    pass


@register
class FoldNorms(Pass):
    """Fold every RMSNorm weight into the linears that read its output; the norms become all-ones."""

    name = "fold_norms"
    reads_activations = False
    Config = FoldNormsConfig
    transforms = True

    def prepare(self, edges: ModelEdges, config: PretrainedConfig) -> None:
        gamma = edges.final_norm.double()
        edges.lm_head = (edges.lm_head.double() * gamma).to(edges.lm_head.dtype)
        edges.final_norm = torch.ones_like(edges.final_norm)

    def run(self, work: LayerWork) -> None:
        a = work.adapter
        for norm, role in ((a.input_norm, "qkv"), (a.post_attn_norm, "gate_up")):
            module = work.block.get_submodule(norm)
            for name in work.names(role):
                _scale_columns(work.module(name), module.weight.data)
            module.weight.data = torch.ones_like(module.weight.data)


@dataclass(frozen=True)
class RotateConfig:
    pass


class RotationError(QuantkitError):
    """The residual stream cannot be rotated (norms not folded, or no Hadamard matrix of the hidden size)."""


@register
class Rotate(Pass):
    """Rotate the residual stream by the scaled Hadamard of the hidden size, fused offline into the weights."""

    name = "rotate"
    reads_activations = False
    Config = RotateConfig
    transforms = True
    requires = ("fold_norms",)

    def __init__(self, config: RotateConfig):
        super().__init__(config)
        self._q: torch.Tensor | None = None

    def _rotation(self, n: int) -> torch.Tensor:
        if self._q is None or self._q.shape[0] != n:
            self._q = rotation(n)
        return self._q

    def prepare(self, edges: ModelEdges, config: PretrainedConfig) -> None:
        if not torch.all(edges.final_norm == 1):
            raise RotationError("rotate: the final norm still has weights; put fold_norms before rotate")
        q = self._rotation(edges.embed.shape[1])
        edges.embed = (edges.embed.double() @ q).to(edges.embed.dtype)
        edges.lm_head = (edges.lm_head.double() @ q).to(edges.lm_head.dtype)

    def run(self, work: LayerWork) -> None:
        a = work.adapter
        for norm in (a.input_norm, a.post_attn_norm):
            if not torch.all(work.block.get_submodule(norm).weight == 1):
                raise RotationError(f"rotate: layer {work.index} {norm} still has weights; put fold_norms first")
        q = self._rotation(work.config.hidden_size).to(work.block.get_submodule(a.input_norm).weight.device)
        for role in ("qkv", "gate_up"):
            for name in work.names(role):
                w = work.module(name).weight
                w.data = (w.data.double() @ q).to(w.dtype)
        for role in ("o", "down"):
            for name in work.names(role):
                m = work.module(name)
                m.weight.data = (q.T @ m.weight.data.double()).to(m.weight.dtype)
                if m.bias is not None:
                    m.bias.data = (q.T @ m.bias.data.double()).to(m.bias.dtype)
