"""Atom's outlier channel order (`outlier_order`): each role's input channels sorted by their square-sum on the
calibration inputs, ascending, so the largest `weights.outliers` come last.

The order is a full permutation (as Atom's code does), so the normal groups are also formed from channels of
similar magnitude. Nothing in the block is rewritten: the quantizer forms its groups along the order
(`work.column_order`), the result records it as g_idx, and the activation simulation groups each linear's input
the same way. An engine applies it as Atom does: fused into the RMSNorm kernels (q/k/v, gate/up), folded into the
gate/up output rows (down), or a reorder kernel (o).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass


@dataclass(frozen=True)
class OutlierOrderConfig:
    samples: int | None = None  # calibration sequences the square-sums come from (all by default)

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples <= 0:
            raise ValueError(f"samples must be positive or null, got {self.samples}")


@register
class OutlierOrder(Pass):
    name = "outlier_order"
    Config = OutlierOrderConfig

    def run(self, work: LayerWork) -> None:
        firsts: dict[str, str] = {}
        for name, role in work.linears.items():
            firsts.setdefault(role, name)
        sums: dict[str, torch.Tensor] = {}

        def hook(role: str):
            def fn(x: torch.Tensor) -> None:
                s = x.detach().float().reshape(-1, x.shape[-1]).square().sum(dim=0)
                sums[role] = s if role not in sums else sums[role] + s
            return fn

        work.forward({name: hook(role) for role, name in firsts.items()}, samples=self.config.samples)
        for role, s in sums.items():
            order = torch.argsort(s, stable=True)
            work.column_order[role] = order
            top = s[order[-1]] / s.median().clamp(min=1e-30)
            work.metrics[f"{firsts[role]}.outlier_ratio"] = float(top)
