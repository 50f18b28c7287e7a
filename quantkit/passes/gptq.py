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
from quantkit.quantizers import (
    OUTLIER_SPEC,
    QParams,
    QuantSpec,
    compute_qparams,
    normal_spec,
    quantize_column,
    search_qparams,
)


@dataclass(frozen=True)
class GPTQConfig:
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = True
    static_groups: bool = True
    observer: str = "minmax"  # "minmax" or "mse" (per-group clipping search before the column sweep)
    max_damp: float = 10.0

    @property
    def dynamic_groups(self) -> bool:
        """Whether groups form along the activation order as the sweep reaches them (act-order without static
        groups): their members are not the weight's own column ranges, so a format stores them with g_idx."""
        return self.act_order and not self.static_groups

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

    def quantize(self, work: LayerWork, names: list[str]) -> None:
        """Quantize `names`, factoring each role's Hessian once for all its linears; the Hessians are consumed
        (factored in place, then dropped from `work`) to keep one K x K buffer pair alive at a time."""
        by_role: dict[str, list[str]] = {}
        for name in names:
            by_role.setdefault(work.linears[name], []).append(name)
        for role, members in by_role.items():
            work.hessian(members[0])  # collected on first use
            # Atom's groups along their order (act-order would put the outliers on the least active columns)
            factor = factor_hessian(work.hessians.pop(role), self.config, consume=True, order=work.group_order(role))
            for name in members:
                w = work.weight(name).detach().float()
                result, loss = gptq_with_factor(w, factor, work.specs[name], self.config, work.scale_dtype,
                                                clip=work.clip.get(name))
                work.results[name] = result
                work.metrics[f"{name}.gptq_loss"] = loss
            if factor.damp != self.config.damp:
                work.notes.append(f"{', '.join(members)}: Cholesky failed at damp {self.config.damp:g}, "
                                  f"used {factor.damp:g}")


def _group_clip(clip: torch.Tensor | float | None, group: int) -> torch.Tensor | float | None:
    """Group `group`'s clip ratios [N, 1] from a clipping search's [N, G] (a per-tensor float, or None, as it is)."""
    return clip[:, group:group + 1] if isinstance(clip, torch.Tensor) else clip


def _qparams(w: torch.Tensor, spec: QuantSpec, config: GPTQConfig, scale_dtype: torch.dtype,
             clip: torch.Tensor | float | None = None) -> QParams:
    """The observer's parameters of `w`, or those of a clipping search's ratios where it ran."""
    if clip is not None:
        return compute_qparams(w, spec, scale_dtype, clip_ratio=clip)
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


@dataclass
class HessianFactor:
    """What GPTQ needs from a Hessian, shared by every linear that reads the same input: the upper Cholesky
    factor of (H + damp I)^-1 in visiting order, that order (act-order) or None, the dead (never active) input
    columns, and the damping used (relative to mean diag H)."""

    upper: torch.Tensor
    perm: torch.Tensor | None
    dead: torch.Tensor
    damp: float
    ordered: bool = False  # `perm` is a given column order (Atom), whose groups form along it during the sweep


def factor_hessian(h: torch.Tensor, config: GPTQConfig, consume: bool = False, order: torch.Tensor | None = None
                   ) -> HessianFactor:
    """Factor H [K, K] for GPTQ, visiting columns in `order` when given (else act-order or natural). With
    `consume`, H's own buffer becomes the factor: on the CPU nothing else of size K x K is allocated (the down_proj
    Hessian of a 70B model is 3.3 GB in float32)."""
    if not consume:
        h = h.clone()
    diag = h.diagonal()
    dead = diag == 0
    diag[dead] = 1.0
    perm = None
    if order is not None:
        perm = order.to(h.device)
    elif config.act_order:
        perm = torch.argsort(diag, descending=True, stable=True)
    if perm is not None:
        _permute_symmetric_(h, perm)
    upper, damp = _inverse_cholesky(h, config)
    return HessianFactor(upper, perm, dead, damp, ordered=order is not None)


def _permute_symmetric_(h: torch.Tensor, perm: torch.Tensor, block: int = 256) -> None:
    """h <- h[perm][:, perm] in place: rows by following the permutation's cycles (one row of scratch), then
    the columns of each block of rows (a block of scratch). Off the CPU, with a full temporary."""
    if h.device.type != "cpu":
        h.copy_(h.index_select(0, perm).index_select(1, perm))
        return
    order = perm.tolist()
    seen = [False] * len(order)
    for start, target in enumerate(order):
        if seen[start] or target == start:
            continue
        saved = h[start].clone()
        j = start
        while order[j] != start:  # new row j = old row order[j], along the cycle through `start`
            seen[j] = True
            h[j] = h[order[j]]
            j = order[j]
        seen[j] = True
        h[j] = saved
    for start in range(0, h.shape[0], block):
        h[start:start + block] = h[start:start + block].index_select(1, perm)


def _inverse_cholesky(h: torch.Tensor, config: GPTQConfig) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp I)^-1, escalating the damping tenfold until it factorizes; overwrites
    `h`. On the CPU (float32) LAPACK computes it inside h's own buffer; elsewhere torch does, out of place."""
    attempt = _attempt_lapack if h.device.type == "cpu" and h.dtype == torch.float32 else _attempt_torch
    diag = h.diagonal().clone()
    mean_diag = diag.mean().item()
    damp = config.damp
    while True:
        h.diagonal().copy_(diag + damp * mean_diag)
        upper = attempt(h)
        if upper is not None:
            return upper, damp
        if damp * 10 > config.max_damp:
            raise RuntimeError(f"GPTQ: Hessian not positive definite even with damping {damp:g}")
        damp *= 10


def _attempt_lapack(h: torch.Tensor) -> torch.Tensor | None:
    """The factor as a view of h's buffer (scipy LAPACK: potrf, potri, potrf), or None with h's off-diagonal
    restored. LAPACK works on the upper triangle of the column-major view of `h`, which is `h`'s lower
    triangle; `h`'s upper triangle keeps H for a retry until the last step succeeds."""
    from scipy.linalg import lapack

    a = h.numpy().T  # column-major view of the same buffer (H is symmetric)
    c, info = lapack.spotrf(a, lower=0, overwrite_a=1, clean=0)
    if info == 0:
        c, info = lapack.spotri(c, lower=0, overwrite_c=1)
    if info == 0:
        c, info = lapack.spotrf(c, lower=0, overwrite_a=1, clean=0)
    if info == 0:
        return _zero_lower_(torch.from_numpy(c))  # shares h's buffer unless LAPACK had to copy
    upper_h = torch.triu(h, 1)
    h.copy_(upper_h + upper_h.T)  # rare: restore H from the untouched triangle (the caller resets the diagonal)
    return None


def _zero_lower_(u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Zero the strict lower triangle of `u` in place, a block of rows at a time (no K x K mask)."""
    cols = torch.arange(u.shape[1], device=u.device)
    for start in range(0, u.shape[0], block):
        rows = u[start:start + block]
        rows.masked_fill_(cols < torch.arange(start, start + rows.shape[0], device=u.device)[:, None], 0.0)
    return u


def _attempt_torch(h: torch.Tensor) -> torch.Tensor | None:
    """The factor with torch (any device), or None with h's off-diagonal restored; h holds (H + damp I)^-1 on
    the way."""
    chol, info = torch.linalg.cholesky_ex(h)
    if info != 0:
        return None
    _cholesky_inverse(chol, out=h)
    del chol
    upper, info = torch.linalg.cholesky_ex(h, upper=True)
    if info == 0:
        return upper
    h.copy_(torch.linalg.inv(h))  # rare: back to H + damp I (the caller resets the diagonal)
    return None


def _cholesky_inverse(chol: torch.Tensor, out: torch.Tensor, block: int = 256) -> torch.Tensor:
    """(L L^T)^-1 into `out` from its Cholesky factor L, as L^-T (L^-1 E) against a block of identity columns at
    a time: no K x K identity, and triangular solves never copy L (cholesky_solve copies it on every call;
    MKL's potri, behind cholesky_inverse, is ~40x slower on AMD CPUs: 14 s at K = 1536)."""
    k = chol.shape[0]
    for start in range(0, k, block):
        stop = min(start + block, k)
        rhs = torch.zeros(k, stop - start, dtype=chol.dtype, device=chol.device)
        rhs[start:stop].fill_diagonal_(1.0)
        y = torch.linalg.solve_triangular(chol, rhs, upper=False)
        out[:, start:stop] = torch.linalg.solve_triangular(chol.mT, y, upper=True)
    return out


def gptq_quantize(
    w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, config: GPTQConfig, scale_dtype: torch.dtype,
    clip: torch.Tensor | float | None = None,
) -> tuple[QuantizedLinear, float, float]:
    """Quantize `w` [N, K] with Hessian [K, K] (left unchanged); returns the result, the damping used, and
    GPTQ's loss. `clip` (per group, from a clipping search) fixes the clip ratios of the static parameters, or of
    each dynamic group as the sweep reaches it, instead of the observer."""
    factor = factor_hessian(hessian, config)
    result, loss = gptq_with_factor(w, factor, spec, config, scale_dtype, clip)
    return result, factor.damp, loss


def gptq_with_factor(
    w: torch.Tensor, factor: HessianFactor, spec: QuantSpec, config: GPTQConfig, scale_dtype: torch.dtype,
    clip: torch.Tensor | float | None = None,
) -> tuple[QuantizedLinear, float]:
    """GPTQ's column sweep of `w` [N, K] against a factored Hessian; returns the result and GPTQ's loss."""
    n, k = w.shape
    if factor.dead.any():
        w = w.clone()
        w[:, factor.dead] = 0.0
    grouped = spec.granularity == "group"
    kn = k - spec.outliers  # Atom: the last `outliers` visited columns are the INT8 outlier group
    gs = normal_spec(spec).columns_per_group(kn)
    static: QParams | None = None
    starts: dict[int, tuple[int, QuantSpec]] = {}
    if (not grouped or config.static_groups) and not (factor.ordered or spec.outliers):
        static = _qparams(w, spec, config, scale_dtype, clip)
    elif spec.progressive or spec.zero_form != "integer" or spec.requant_int8:
        raise ValueError("GPTQ with dynamic groups supports plain single-level groups only (no progressive, scaled "
                         "zero or requant_int8 weights); set static_groups=true")
    elif isinstance(clip, torch.Tensor) and (factor.perm is not None or factor.ordered or spec.outliers):
        # recipes refuse this (recipe._check_clip): per-group ratios belong to the weight's own column groups
        raise ValueError("GPTQ: per-group clip ratios need groups in the weight's column order (no act-order with "
                         "dynamic groups, no Atom order)")
    else:  # groups that begin at a visited column: width and spec (Atom's along the layer's order)
        starts = {c: (gs, replace(normal_spec(spec), granularity="channel")) for c in range(0, kn, gs)}
        if spec.outliers:
            starts[kn] = (spec.outliers, OUTLIER_SPEC)

    perm, hinv = factor.perm, factor.upper
    dev = w.device
    # [K, N] in visiting order: the sweep walks columns of w, each a contiguous row here (a copy, never `w`)
    wt = w.T.index_select(0, perm) if perm is not None else w.T.clone(memory_format=torch.contiguous_format)
    del w
    codes_t = torch.zeros(k, n, dtype=torch.int8, device=dev)
    dynamic: list[QParams] = []  # per-group params found during the sweep (dynamic groups)
    g_idx = torch.arange(k, device=dev) // gs  # group of each column, in original column order (static)
    loss = torch.zeros(n, device=dev)
    col_groups = (g_idx[perm] if perm is not None else g_idx).tolist()  # group of each permuted column (static)

    with _sweep_threads(dev):
        for i1 in range(0, k, config.block_size):
            i2 = min(i1 + config.block_size, k)
            w1 = wt[i1:i2]  # updated in place; these rows are not read again after the block
            err1 = torch.zeros(i2 - i1, n, device=dev)
            h1 = hinv[i1:i2, i1:i2].contiguous()  # the factor may be a column-major view
            for i in range(i2 - i1):
                col = i1 + i
                if static is not None:
                    params, g = static, col_groups[col] if grouped else 0
                else:
                    if col in starts:  # dynamic groups: params from the error-updated weights of this group
                        width, col_spec = starts[col]
                        span = torch.cat([w1[i:], wt[i2:]])[:width].T
                        dynamic.append(_qparams(span, col_spec, config, scale_dtype, _group_clip(clip, col // gs)))
                        visited = perm[col:col + width] if perm is not None else slice(col, col + width)
                        g_idx[visited] = len(dynamic) - 1
                    params, g = dynamic[-1], 0
                q, deq = quantize_column(w1[i], params, g, spec if static is not None else col_spec)
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
        # Atom keeps g_idx even in natural order: its outlier group is not `gs` columns wide
        natural = not spec.outliers and torch.equal(g_idx, torch.arange(k, device=dev) // gs)
        g_idx_out = None if natural else g_idx
    return QuantizedLinear(codes, qparams, spec, g_idx_out), float(loss.sum())
