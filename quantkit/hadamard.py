"""Deterministic Hadamard matrices of any order we can build: Sylvester, Paley I/II, and their Kronecker products.

QoQ rotates the residual stream by the scaled Hadamard H_n / sqrt(n) of the hidden size. Powers of two use
Sylvester's construction; other widths (576 = 12 * 12 * 4, 896 = 28 * 32, 3584 = 28 * 128, 5120 = 20 * 256, ...)
use Kronecker products of Paley matrices (orders q + 1 for a prime q = 3 mod 4, and 2(q + 1) for a prime
q = 1 mod 4) with a Sylvester factor. Everything is integer (+-1) and exactly reproducible across runs.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import scipy.linalg
import torch


class HadamardError(ValueError):
    """No Hadamard matrix of the requested order can be built by the constructions we know."""


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) over GF(q), chi the quadratic character (0 on the diagonal)."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.int64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for a prime q = 3 (mod 4): H = I + S with S the skew conference matrix."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(q + 1, dtype=torch.int64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for a prime q = 1 (mod 4), from the symmetric conference matrix C."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    plus = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    minus = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    eye = torch.eye(q + 1, dtype=torch.int64)
    return torch.kron(c, plus) + torch.kron(eye, minus)


@cache
def _base(order: int) -> torch.Tensor | None:
    """A non-Sylvester Hadamard matrix of exactly `order` from one Paley construction, if one applies."""
    if _is_prime(order - 1) and (order - 1) % 4 == 3:
        return _paley1(order - 1)
    if order % 2 == 0 and _is_prime(order // 2 - 1) and (order // 2 - 1) % 4 == 1:
        return _paley2(order // 2 - 1)
    return None


@cache
def _build(n: int) -> torch.Tensor | None:
    if n & (n - 1) == 0:
        return torch.from_numpy(scipy.linalg.hadamard(n, dtype=np.int64))  # Sylvester's construction
    for d in range(n, 2, -1):  # largest Paley factor first keeps the Sylvester part big
        if n % d == 0 and (base := _base(d)) is not None and (rest := _build(n // d)) is not None:
            return torch.kron(base, rest)
    return None


def hadamard(n: int) -> torch.Tensor:
    """An n x n matrix of +-1 with H H^T = n I (int64), or HadamardError naming the order."""
    if n < 1 or (n > 2 and n % 4):
        raise HadamardError(f"no Hadamard matrix of order {n}: orders above 2 are multiples of 4")
    h = _build(n)
    if h is None:
        raise HadamardError(
            f"cannot build a Hadamard matrix of order {n} from Sylvester and Paley constructions; "
            "turn the rotation off for this model (--set passes.rotate.enabled=false)"
        )
    return h.clone()


def rotation(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthogonal scaled Hadamard H_n / sqrt(n)."""
    return hadamard(n).to(dtype) / torch.tensor(float(n), dtype=torch.float64).sqrt().to(dtype)
