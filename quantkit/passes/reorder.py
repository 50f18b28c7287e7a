"""Activation-aware channel reordering (QServe B.2.3): channels of similar salience share a quantization group.

The salience of an input channel is max|X| over the calibration tokens. The o_proj and down_proj inputs are
sorted by it (ascending), and the permutation is absorbed offline into the producers' rows, so nothing changes
at run time: o_proj columns with v_proj rows (and bias), one permutation per KV head applied within every head
of its group so GQA stays consistent (salience max-pooled over the group's query heads); down_proj columns with
gate_proj and up_proj rows. The residual stream is never reordered. Only useful with group quantization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass, check_output_targets


def _permute_rows(module: torch.nn.Linear, perm: torch.Tensor) -> None:
    module.weight.data = module.weight.data[perm].contiguous()
    if module.bias is not None:
        module.bias.data = module.bias.data[perm].contiguous()


def _permute_columns(module: torch.nn.Linear, perm: torch.Tensor) -> None:
    module.weight.data = module.weight.data[:, perm].contiguous()


@dataclass(frozen=True)
class ReorderConfig:
    targets: list[str] = field(default_factory=lambda: ["o", "down"])

    def __post_init__(self) -> None:
        check_output_targets(self.targets)


@register
class Reorder(Pass):
    name = "reorder"
    Config = ReorderConfig
    transforms = True

    def run(self, work: LayerWork) -> None:
        a = work.adapter
        names = [a.linears[t][0] for t in self.config.targets]
        salience = work.input_absmax(names)
        if a.o_proj in names:
            _, kv_heads, d = work.head_dims()
            o_salience = salience[a.o_proj]
            pairs = work.kv_channels().to(o_salience.device)  # each o_proj column's v_proj row
            per_kv = o_salience.new_zeros(kv_heads * d).scatter_reduce(
                0, pairs, o_salience, "amax", include_self=False).reshape(kv_heads, d)
            within = torch.argsort(per_kv, dim=1, stable=True)  # [H_kv, D]: each KV head's channel order
            v_perm = (within + torch.arange(kv_heads, device=within.device)[:, None] * d).reshape(-1)
            # each query head takes its KV head's order, within its own columns
            columns = torch.arange(pairs.numel(), device=pairs.device)
            o_perm = columns - columns % d + within.reshape(-1)[pairs]
            _permute_columns(work.module(a.o_proj), o_perm)
            _permute_rows(work.module(a.v_proj), v_perm)
        if a.down_proj in names:
            perm = torch.argsort(salience[a.down_proj], stable=True)
            _permute_columns(work.module(a.down_proj), perm)
            _permute_rows(work.module(a.gate_proj), perm)
            _permute_rows(work.module(a.up_proj), perm)
