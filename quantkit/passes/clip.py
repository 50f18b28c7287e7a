"""Weight clipping search (QServe B.2.4, Eq. 10): a clip ratio per group that minimizes the output error.

Candidates scale both ends of the range, widened to hold 0 (`compute_qparams`' clip_ratio): ratio in
{1, 1 - step, ..., min_ratio}. For every linear but q_proj and k_proj the objective is the layer output error of
each (row, group), measured exactly with the calibration Hessian block of that group: d_g^T H_gg d_g with
d = w - fake_quant(w; ratio) (for per-channel quantization this is the row's full output MSE). For q_proj and
k_proj, whose errors matter only through the softmax, one ratio per tensor minimizes the output MSE of the
attention module (softmax and o_proj included, as QServe's code does) on a few calibration sequences. The chosen
ratios are stored in `work.clip` and used by the weight quantizer that follows (RTN, or GPTQ's static parameters
or dynamic groups); recipes whose quantizer forms other groups (Atom's order, act-order with dynamic groups) or
none are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit import memory
from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass
from quantkit.quantizers import QuantSpec, fake_quantize, qparams_by_clip, quantize_dequantize


@dataclass(frozen=True)
class ClipConfig:
    min_ratio: float = 0.5
    step: float = 0.02
    attention_min_ratio: float = 0.6  # q_proj / k_proj: coarser per-tensor grid on the block output
    attention_step: float = 0.05
    attention_samples: int = 4  # calibration sequences for the q/k objective

    def __post_init__(self) -> None:
        for lo, step in ((self.min_ratio, self.step), (self.attention_min_ratio, self.attention_step)):
            if not 0.0 < lo <= 1.0 or not 0.0 < step < 1.0:
                raise ValueError(f"clip grids need 0 < min_ratio <= 1 and 0 < step < 1, got {lo}, {step}")
        if self.attention_samples < 1:
            raise ValueError(f"attention_samples must be at least 1, got {self.attention_samples}")


def _grid(lo: float, step: float) -> list[float]:
    count = round((1.0 - lo) / step)
    return [1.0 - i * step for i in range(count + 1)]


def hessian_clip_search(
    w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, ratios: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) the ratio minimizing d_g^T H_gg d_g; returns (ratios [N, G], errors [N, G])."""
    n, k = w.shape
    gs = spec.columns_per_group(k)
    groups = k // gs
    blocks = torch.stack([hessian[g * gs:(g + 1) * gs, g * gs:(g + 1) * gs] for g in range(groups)])
    best_ratio = torch.ones(n, groups, device=w.device)
    best_err = None
    by_clip = qparams_by_clip(w, spec, dtype)  # the groups' ranges once, for every ratio
    for ratio in ratios:
        qp = by_clip(ratio)
        d = (w - quantize_dequantize(w, qp, spec)).reshape(n, groups, gs)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio, best_err


@register
class Clip(Pass):
    name = "clip"
    Config = ClipConfig

    def run(self, work: LayerWork) -> None:
        a = work.adapter
        attention = {a.q_proj, a.k_proj}
        ratios = _grid(self.config.min_ratio, self.config.step)
        for name, spec in work.specs.items():
            if spec.granularity == "tensor" or name in attention:
                continue
            w = work.weight(name).detach().float()
            hessian = work.hessian(name)  # the first call collects every role's: not in the search's scope
            with memory.reused_temporaries():  # each ratio builds the same temporaries
                best, _ = hessian_clip_search(w, hessian, spec, work.scale_dtype, ratios)
            work.clip[name] = best
            work.metrics[f"{name}.clip_mean"] = float(best.mean())
        searched = sorted(attention & set(work.specs))
        if searched:  # both searches leave the weights as they found them: one reference serves both
            reference = work.attention_output(self.config.attention_samples)
        for name in searched:
            with memory.reused_temporaries():
                work.clip[name] = self._attention_ratio(work, name, reference)
            work.metrics[f"{name}.clip"] = float(work.clip[name])

    def _attention_ratio(self, work: LayerWork, name: str, reference: torch.Tensor) -> float:
        """Per-tensor ratio of q_proj or k_proj minimizing the attention module's output MSE against `reference`
        (other weights in FP; the module with softmax and o_proj, as QServe's code reads Eq. 10's "block")."""
        samples = self.config.attention_samples
        module = work.module(name)
        original = module.weight.data.clone()
        spec = work.specs[name]
        best, best_err = 1.0, None
        try:
            for ratio in _grid(self.config.attention_min_ratio, self.config.attention_step):
                module.weight.data = fake_quantize(original.float(), spec, work.scale_dtype, ratio).to(original.dtype)
                err = float((work.attention_output(samples) - reference).pow(2).sum())
                if best_err is None or err < best_err:
                    best, best_err = ratio, err
        finally:
            module.weight.data = original
        return best


__all__ = ["Clip", "ClipConfig", "hessian_clip_search"]
