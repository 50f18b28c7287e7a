"""GPTQ (Frantar et al., 2023): quantize columns in order, spreading each one's error onto the rest via H^-1.

All arithmetic in float32. Damping starts at `damp` x mean(diag H) and is escalated tenfold whenever the
Cholesky factorization fails; the damping actually used is logged per linear. Act-order visits columns by
decreasing diag(H); with static groups the group scales come from the unpermuted weight, so groups stay
contiguous and no g_idx is needed by the loader.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from quantkit.passes import register
from quantkit.passes.base import LayerWork, Pass, QuantizedLinear
from quantkit.quantizers import QParams, QuantSpec, compute_qparams, quantize_column, search_qparams


@dataclass(frozen=True)
class GPTQConfig:
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = True
    static_groups: bool = True
    observer: str = "minmax"  # "minmax" or "mse" (per-group clipping search before the column sweep)
    max_damp: float = 10.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 < self.damp <= self.max_damp:
            raise ValueError(f"damp must be in (0, max_damp], got {self.damp}")
        if self.observer not in ("minmax", "mse"):
            raise ValueError(f"observer must be 'minmax' or 'mse', got {self.observer!r}")


@register
class GPTQ(Pass):
    name = "gptq"
    Config = GPTQConfig
    quantizes = True
    needs_hessian = True

    def run(self, work: LayerWork) -> None:
        for name, spec in work.specs.items():
            w = work.weight(name).detach().float()
            result, damp, loss = gptq_quantize(w, work.hessian(name), spec, self.config, work.scale_dtype,
                                               clip=work.clip.get(name))
            work.results[name] = result
            work.metrics[f"{name}.gptq_loss"] = loss
            if damp != self.config.damp:
                work.notes.append(f"{name}: Cholesky failed at damp {self.config.damp:g}, used {damp:g}")


def _qparams(w: torch.Tensor, spec: QuantSpec, config: GPTQConfig, scale_dtype: torch.dtype) -> QParams:
    if config.observer == "mse":
        return search_qparams(w, spec, scale_dtype)
    return compute_qparams(w, spec, scale_dtype)


@contextmanager
def _sweep_threads(device: torch.device) -> Iterator[None]:
    """One CPU thread for the column sweep: its thousands of tiny ops gain nothing from OpenMP, whose per-op
    synchronization dominates them (milliseconds per op when another process shares the cores)."""
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _inverse_cholesky(h: torch.Tensor, config: GPTQConfig) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp I)^-1, escalating the damping until it factorizes."""
    mean_diag = torch.mean(torch.diag(h)).item()
    damp = config.damp
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    while True:
        chol, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if info == 0:
            # cholesky_solve, not cholesky_inverse: MKL's potri is ~40x slower on AMD CPUs (14 s at K = 1536)
            hinv = torch.cholesky_solve(eye, chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if info == 0:
                return upper, damp
        if damp * 10 > config.max_damp:
            raise RuntimeError(f"GPTQ: Hessian not positive definite even with damping {damp:g}")
        damp *= 10


def gptq_quantize(
    w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, config: GPTQConfig, scale_dtype: torch.dtype,
    clip: torch.Tensor | float | None = None,
) -> tuple[QuantizedLinear, float, float]:
    """Quantize `w` [N, K] with Hessian [K, K]; returns the result, the damping used, and GPTQ's loss.

    `clip` (per group, from a clipping search) fixes the static parameters' clip ratios instead of the observer.
    """
    w = w.clone()
    n, k = w.shape
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    gs = spec.columns_per_group(k)
    grouped = spec.granularity == "group"

    static: QParams | None = None
    if not grouped or config.static_groups:
        static = _qparams(w, spec, config, scale_dtype) if clip is None else compute_qparams(
            w, spec, scale_dtype, clip_ratio=clip)
    elif spec.progressive or spec.zero_form != "integer":
        raise ValueError("GPTQ with dynamic groups supports plain integer zeros only; set static_groups=true")

    perm = None
    if config.act_order:
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    hinv, damp = _inverse_cholesky(h, config)

    dev = w.device
    wt = w.T.contiguous()  # [K, N]: the sweep walks columns of w, each a contiguous row here
    codes_t = torch.zeros(k, n, dtype=torch.int8, device=dev)
    dynamic: list[QParams] = []  # per-group params found during the sweep (dynamic groups)
    g_idx = torch.arange(k, device=dev) // gs  # group of each column, in original column order
    loss = torch.zeros(n, device=dev)
    col_groups = (g_idx[perm] if perm is not None else g_idx).tolist()  # group of each permuted column (static)

    with _sweep_threads(dev):
        for i1 in range(0, k, config.block_size):
            i2 = min(i1 + config.block_size, k)
            w1 = wt[i1:i2]  # updated in place; these rows are not read again after the block
            err1 = torch.zeros(i2 - i1, n, device=dev)
            h1 = hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if static is not None:
                    params, g = static, col_groups[col] if grouped else 0
                else:
                    if col % gs == 0:  # dynamic groups: params from the error-updated weights of this group
                        span = torch.cat([w1[i:], wt[i2:]])[:gs].T
                        dynamic.append(_qparams(span, replace(spec, granularity="channel"), config, scale_dtype))
                        if perm is not None:
                            g_idx[perm[col:col + gs]] = len(dynamic) - 1
                    params, g = dynamic[-1], 0
                q, deq = quantize_column(w1[i], params, g, spec)
                codes_t[col] = q
                e = err1[i]
                torch.sub(w1[i], deq, out=e)
                e.div_(h1[i, i])
                w1[i:].addr_(h1[i, i:], e, alpha=-1.0)  # spread the error onto the block's later columns
            loss += (err1**2).sum(dim=0) / 2
            wt[i2:] -= hinv[i1:i2, i2:].T @ err1  # and onto every column after the block

    if perm is not None:
        codes_t = codes_t[torch.argsort(perm)]
    codes = codes_t.T.contiguous()
    if static is not None:
        qparams = static
        g_idx_out = None
    else:
        qparams = dynamic[0].map(lambda f, t: torch.cat([getattr(d, f) for d in dynamic], dim=1))
        qparams.group_size = gs
        g_idx_out = None if torch.equal(g_idx, torch.arange(k, device=dev) // gs) else g_idx
    return QuantizedLinear(codes, qparams, spec, g_idx_out), damp, float(loss.sum())
