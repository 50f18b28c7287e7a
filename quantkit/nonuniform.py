"""Non-uniform (lookup-table) quantization: SqueezeLLM's sensitivity-weighted k-means per output row, and
Any-Precision LLM's incremental upscaling, which splits every cluster in two so parent codes prefix their children.

Both work on every row of a matrix at once. A row's weights are sorted, so in one dimension each cluster is a
contiguous interval [border_j, border_j+1) of the sorted row and codes ascend with the centroids (LUTs are sorted).
Interval sums come from float64 prefix sums of f, f w and f w^2, as in the authors' flash1dkmeans.

- Seed (`kmeans_rows`): weighted Lloyd iterations (at most 50, stopping once no border moves) minimizing sum_i f_i
  (w_i - c(w_i))^2, run from the weighted quantiles of the row and from `restarts` weighted k-means++ starts (the
  authors' initialization; drawn from a fixed seed, so runs repeat), keeping per row the result of least cost.
  Lloyd only finds a local optimum, and with Fisher sensitivities, which span orders of magnitude, the start
  matters: on SmolLM2 rows with heavy-tailed sensitivities the quantile start alone ends well above the best of
  eight starts (the README's squeezellm pass gives the measured range). An interval whose weights sum to 0 takes
  its plain mean; an empty one the value at its border.
- Upscaling (`split_clusters`): per cluster the split point minimizing the 2-means cost
  sum f w^2 - S_L^2 / F_L - S_R^2 / F_R over every split of the sorted interval (the global optimum; the authors'
  binary search finds a Lloyd fixed point), the lower part getting code 2j and the upper 2j + 1. The parent's
  centroids are kept as its own LUT; only the children's are new.
Weights equal to 0 get sensitivity 0 (as the authors' code does); a row whose sensitivities are all 0 is clustered
unweighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SortedRows:
    """Rows sorted ascending with their sensitivities, and float64 prefix sums [N, K + 1] of f, f w, f w^2 (and
    of w, for intervals whose sensitivities sum to 0; an interval [lo, hi) holds hi - lo weights)."""

    values: torch.Tensor  # [N, K] float64, ascending per row
    order: torch.Tensor  # [N, K] column of each sorted value
    f: torch.Tensor
    fw: torch.Tensor
    fww: torch.Tensor
    w: torch.Tensor

    @classmethod
    def build(cls, weight: torch.Tensor, sensitivity: torch.Tensor) -> SortedRows:
        w = weight.detach().double()
        f = sensitivity.detach().double().clamp(min=0) * (w != 0)
        f = torch.where(f.sum(dim=1, keepdim=True) > 0, f, torch.ones_like(f))
        values, order = torch.sort(w, dim=1, stable=True)
        f = torch.gather(f, 1, order)

        def prefix(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(torch.cumsum(t, dim=1), (1, 0))

        return cls(values, order, prefix(f), prefix(f * values), prefix(f * values * values), prefix(values))

    def interval(self, sums: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """sum over [lo, hi) of the quantity whose prefix sums are `sums`, per row and interval."""
        return torch.gather(sums, 1, hi) - torch.gather(sums, 1, lo)

    def means(self, borders: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Weighted mean of each interval [borders_j, borders_j+1); the plain mean where the weights sum to 0,
        `previous` where the interval is empty."""
        lo, hi = borders[:, :-1], borders[:, 1:]
        weight = self.interval(self.f, lo, hi)
        count = (hi - lo).to(torch.float64)
        weighted = self.interval(self.fw, lo, hi) / weight.clamp(min=1e-300)
        plain = self.interval(self.w, lo, hi) / count.clamp(min=1)
        out = torch.where(weight > 0, weighted, plain)
        return torch.where(count > 0, out, previous)

    def cost(self, borders: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
        """Weighted squared error per row [N] of the clustering: sum over intervals of sum f (w - c)^2."""
        lo, hi = borders[:, :-1], borders[:, 1:]
        f, fw, fww = (self.interval(t, lo, hi) for t in (self.f, self.fw, self.fww))
        return (fww - 2 * centroids * fw + centroids * centroids * f).sum(dim=1)


def kmeans_rows(rows: SortedRows, clusters: int, max_iter: int = 50, restarts: int = 7, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted 1-D k-means of every row: (centroids [N, k] ascending, borders [N, k + 1] into the sorted rows),
    the least-cost of Lloyd from the weighted quantiles and from `restarts` k-means++ starts (seeded by `seed`)."""
    k = rows.values.shape[1]
    targets = rows.f[:, -1:] * (torch.arange(clusters, dtype=torch.float64) + 0.5) / clusters  # weighted quantiles
    idx = torch.searchsorted(rows.f[:, 1:].contiguous(), targets.contiguous()).clamp(max=k - 1)
    centroids, borders = _lloyd(rows, torch.gather(rows.values, 1, idx), max_iter)
    cost = rows.cost(borders, centroids)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(restarts):
        c, b = _lloyd(rows, _kmeanspp_starts(rows, clusters, generator), max_iter)
        c_cost = rows.cost(b, c)
        better = (c_cost < cost)[:, None]
        centroids, borders = torch.where(better, c, centroids), torch.where(better, b, borders)
        cost = torch.minimum(cost, c_cost)
    return centroids, borders


def _kmeanspp_starts(rows: SortedRows, clusters: int, generator: torch.Generator) -> torch.Tensor:
    """Weighted k-means++ starts per row (Arthur & Vassilvitskii, 2007), ascending: the first centroid drawn with
    probability proportional to f, each next to f times the squared distance to the nearest one drawn."""
    f = torch.diff(rows.f, dim=1).clamp(min=0)  # each sorted weight's sensitivity (every row's sum is positive)
    f_cdf = rows.f[:, 1:]
    drawn = [torch.gather(rows.values, 1, _draw(f_cdf, generator))]
    dist = (rows.values - drawn[0]).square_()
    cdf = torch.empty_like(f)
    for _ in range(clusters - 1):
        torch.cumsum(torch.mul(f, dist, out=cdf), dim=1, out=cdf)
        empty = cdf[:, -1:] <= 0  # every weighted value already drawn: any will do
        drawn.append(torch.gather(rows.values, 1, _draw(torch.where(empty, f_cdf, cdf) if empty.any() else cdf,
                                                        generator)))
        torch.minimum(dist, (rows.values - drawn[-1]).square_(), out=dist)
    return torch.cat(drawn, dim=1).sort(dim=1).values


def _draw(cdf: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row [N, 1], drawn with probability proportional to the weights whose running sums (each row
    non-decreasing, its last entry positive) are `cdf`: inverse-CDF sampling by binary search, ~5x faster per draw
    than torch.multinomial, which is what k-means++ at 256 centroids spent its time on."""
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=cdf.dtype, generator=generator) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total, so a zero tail is never drawn
    return torch.searchsorted(cdf.contiguous(), u, right=True)  # the first index whose cdf exceeds u: weight > 0


def _lloyd(rows: SortedRows, centroids: torch.Tensor, max_iter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd iterations from ascending `centroids` [N, k] until no border moves (at most `max_iter`)."""
    n, k = rows.values.shape
    borders = None
    for _ in range(max_iter):
        mid = (centroids[:, :-1] + centroids[:, 1:]) / 2
        inner = torch.searchsorted(rows.values.contiguous(), mid.contiguous(), right=True)
        new = torch.cat([torch.zeros(n, 1, dtype=torch.long), inner, torch.full((n, 1), k)], dim=1)
        if borders is not None and torch.equal(new, borders):
            break
        borders = new
        # an empty interval takes the value at its border, which keeps the centroids ascending
        at_border = torch.gather(rows.values, 1, borders[:, :-1].clamp(max=k - 1))
        centroids = rows.means(borders, at_border)
    assert borders is not None
    return centroids, borders


def split_clusters(rows: SortedRows, borders: torch.Tensor, centroids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split every cluster in two at its best point: (child centroids [N, 2k], child borders [N, 2k + 1]).
    Child 2j is the lower part of cluster j. An empty or single-valued side takes the parent's centroid (a
    single element goes to the lower child)."""
    n, k = rows.values.shape
    clusters = borders.shape[1] - 1
    positions = torch.arange(1, k + 1).expand(n, k)  # split after sorted element i - 1: left = [lo, i)
    owner = torch.searchsorted(borders[:, 1:].contiguous(), positions.contiguous() - 1, right=True)  # cluster
    lo, hi = torch.gather(borders, 1, owner), torch.gather(borders, 1, owner + 1)
    f_at, fw_at = rows.f[:, 1:], rows.fw[:, 1:]  # the prefix sums at `positions` (a gather of 1..k is a slice)
    f_l = f_at - torch.gather(rows.f, 1, lo)
    s_l = fw_at - torch.gather(rows.fw, 1, lo)
    f_r = torch.gather(rows.f, 1, hi) - f_at
    s_r = torch.gather(rows.fw, 1, hi) - fw_at
    gain = s_l * s_l / f_l.clamp(min=1e-300) + s_r * s_r / f_r.clamp(min=1e-300)  # cost = sum f w^2 - gain
    # the best split of each cluster: the largest gain, first position among ties
    best_gain = torch.full((n, clusters), -1.0, dtype=torch.float64).scatter_reduce(1, owner, gain, "amax")
    is_best = gain >= torch.gather(best_gain, 1, owner)
    first = torch.where(is_best, positions, torch.full_like(positions, k + 1))
    split = torch.full((n, clusters), k + 1, dtype=torch.long).scatter_reduce(1, owner, first, "amin")
    empty = borders[:, 1:] == borders[:, :-1]
    split = torch.where(empty, borders[:, :-1], split)
    child = torch.stack([borders[:, :-1], split], dim=2).reshape(n, 2 * clusters)
    child_borders = torch.cat([child, borders[:, -1:]], dim=1)
    parent = centroids.repeat_interleave(2, dim=1)
    return rows.means(child_borders, parent), child_borders


def codes_from_borders(rows: SortedRows, borders: torch.Tensor) -> torch.Tensor:
    """Code of every weight [N, K] (long) in original column order: the index of the interval holding it."""
    n, k = rows.values.shape
    sorted_codes = torch.searchsorted(borders[:, 1:].contiguous(), torch.arange(k).expand(n, k).contiguous(),
                                      right=True)
    return torch.empty_like(sorted_codes).scatter_(1, rows.order, sorted_codes)


def any_precision(weight: torch.Tensor, sensitivity: torch.Tensor, seed_bits: int = 3, parent_bits: int = 8,
                  max_iter: int = 50, restarts: int = 7) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """SqueezeLLM seed at `seed_bits`, upscaled one bit at a time to `parent_bits`: (parent codes [N, K] long,
    {bits: LUT [N, 2^bits] float32}) with code_b = parent_code >> (parent_bits - b) for every width."""
    if not 1 <= seed_bits <= parent_bits <= 8:
        raise ValueError(f"need 1 <= seed_bits <= parent_bits <= 8, got {seed_bits}, {parent_bits}")
    rows = SortedRows.build(weight, sensitivity)
    centroids, borders = kmeans_rows(rows, 1 << seed_bits, max_iter, restarts)
    luts = {seed_bits: centroids.float()}
    for bits in range(seed_bits + 1, parent_bits + 1):
        centroids, borders = split_clusters(rows, borders, centroids)
        luts[bits] = centroids.float()
    return codes_from_borders(rows, borders), luts
