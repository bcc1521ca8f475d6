"""The kernel numerics of degrees of freedom: a stable DoF(λ), kernel spectra, attention-matrix ranks.

For one head, J points x_i from the union of its queries and keys (after rotary) give the kernel matrix
``G_ij = K(x_i, x_j) = exp(s x_iᵀx_j)`` (s = the attention's scaling). The paper's measure is

    DoF(λ) = tr Σ̃ (Σ̃ + λI)⁻¹,  Σ̃ = G / J.

Numerics. ``G`` has a huge diagonal (``exp(s‖x‖²)`` reaches e^40 and more on real models), so a plain
float64 eigendecomposition has absolute eigenvalue errors near ``J·ε·max G_ii`` — far above λ — and
miscounts. We factor ``G = D^½ C D^½`` with ``D = diag(exp(s‖x_i‖²))`` and the Gaussian kernel
``C_ij = exp(−s‖x_i − x_j‖²/2)`` (entries in [0, 1]), merge exactly repeated points into weights
``w`` (they add nothing but weight), and use

    DoF(λ) = n − λ Σ_i d_i⁻¹ [(C/J + λ diag(d)⁻¹)⁻¹]_ii,   d_i = w_i exp(s‖x_i‖²),

with one Cholesky factorisation per λ (``n`` = distinct points). Every quantity stays in range:
``d⁻¹`` underflows gracefully to 0 for dominant points, which then count as one full degree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dofla.errors import DoflaError

FLOAT64_EPS = torch.finfo(torch.float64).eps
SPECTRUM_POINTS = 256  # points per head for the eigenvalue-decay plot (a 256 x 256 eigvalsh is cheap)
SPECTRUM_VALUES = 64  # eigenvalues kept per head


def merge_duplicates(
    points: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly repeated rows become one row whose weight is the sum of theirs. points (N, D) -> (n, D), (n,)."""
    weights = (
        torch.ones(points.shape[0], dtype=torch.float64, device=points.device) if weights is None else weights
    )
    unique, inverse = torch.unique(points, dim=0, return_inverse=True)
    merged = torch.zeros(unique.shape[0], dtype=torch.float64, device=points.device).index_add_(
        0, inverse, weights.to(torch.float64)
    )
    return unique, merged


def degrees_of_freedom(
    points: torch.Tensor,
    *,
    scaling: float,
    lambdas: Sequence[float],
    weights: torch.Tensor | None = None,
    relative_to_diagonal: bool = False,
) -> torch.Tensor:
    """DoF(λ) = tr Σ̃(Σ̃ + λI)⁻¹ of Σ̃ = G/J, G_ij = exp(scaling x_iᵀx_j), for each λ; float64, shape (len(lambdas),).

    points (N, D); J = N (or the total weight). ``relative_to_diagonal`` multiplies each λ by
    ``max_i G_ii / J`` (the ``dof_trace`` measure). Stable for any norms and for repeated points.
    """
    if any(lam <= 0 for lam in lambdas):
        raise DoflaError(f"every lambda must be positive, got {list(lambdas)}.")
    x, w = merge_duplicates(points.to(torch.float64), weights)
    total = float(w.sum())  # J
    norms = (x * x).sum(-1)  # (n,)
    log_diag = scaling * norms  # (n,): log of exp(s‖x‖²)
    squared = (norms[:, None] + norms[None, :] - 2.0 * (x @ x.T)).clamp_min_(0.0)  # ‖x_i − x_j‖², (n, n)
    gaussian = torch.exp(-0.5 * scaling * squared)  # (n, n) in [0, 1]
    gaussian.diagonal().fill_(1.0)
    log_d = log_diag + torch.log(w)  # d_i = w_i exp(s‖x_i‖²)
    # dof_trace: λ·max_i G_ii / J, kept in log space (max G_ii may exceed the float64 range).
    log_scale = float(log_diag.max()) - math.log(total) if relative_to_diagonal else 0.0
    results = []
    for lam in lambdas:
        log_lam = math.log(lam) + log_scale
        inverse_d_lam = torch.exp(log_lam - log_d)  # λ d_i⁻¹, (n,)
        system = gaussian / total + torch.diag(inverse_d_lam)
        inverse_diagonal = _inverse_diagonal(system)
        dof = x.shape[0] - float((inverse_d_lam * inverse_diagonal).sum())
        results.append(min(max(dof, 0.0), float(x.shape[0])))
    return torch.tensor(results, dtype=torch.float64)


def _inverse_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    """diag(A⁻¹) of a symmetric positive-definite A by Cholesky; eigendecomposition if A is numerically singular."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) == 0:
        identity = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
        inverse_factor = torch.linalg.solve_triangular(factor, identity, upper=False)  # L⁻¹
        return inverse_factor.square().sum(0)
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp_min(FLOAT64_EPS * float(values.abs().max()))
    return (vectors.square() / values).sum(-1)


def kernel_spectrum(points: torch.Tensor, scaling: float, count: int = SPECTRUM_VALUES) -> torch.Tensor:
    """The ``count`` largest eigenvalues of G = exp(scaling XXᵀ) relative to the largest, descending, float64.

    points (N, D). G is formed as exp(scaling XXᵀ − max) so it never overflows; the ratios are unchanged.
    Ratios below about N·ε (float64) are rounding noise and come out as that noise or 0.
    """
    x = points.to(torch.float64)
    logits = scaling * (x @ x.T)  # (N, N)
    values = torch.linalg.eigvalsh(torch.exp(logits - logits.max())).flip(0).clamp_min(0.0)
    return values[:count] / values[0]


def plain_eigen_noise_floor(points: torch.Tensor, scaling: float) -> float:
    """Absolute eigenvalue error of a plain float64 eigendecomposition of G/J: about J·ε·μ_max.

    μ_max is bounded by the largest row sum of G/J (computed in log space, so it never overflows to
    inf before the final exp; values beyond float64 are reported as inf). points (N, D).
    """
    x = points.to(torch.float64)
    log_row_sums = torch.logsumexp(scaling * (x @ x.T), dim=-1)  # (N,): log Σ_j G_ij
    log_mu_max = float(log_row_sums.max()) - math.log(x.shape[0])
    return x.shape[0] * FLOAT64_EPS * math.exp(min(log_mu_max, 709.0))


def energy_rank(energy: torch.Tensor, lambdas: Sequence[float]) -> torch.Tensor:
    """``Σ_k σ_k² / (σ_k² + λσ_1²)`` per λ from squared singular values (..., T), descending: (..., len(lambdas))."""
    top = energy[..., :1]
    return torch.stack([(energy / (energy + lam * top)).sum(-1) for lam in lambdas], dim=-1)


def attention_rank(probabilities: torch.Tensor, lambdas: Sequence[float]) -> torch.Tensor:
    """DoF of attention-probability matrices with λ relative to σ₁²: (..., T, T) -> (..., len(lambdas)) float64."""
    return energy_rank(torch.linalg.svdvals(probabilities.to(torch.float64)).square(), lambdas)


def lambda_key(lam: float) -> str:
    """How a λ is written in results and reports: '2^-4' for powers of two, else like '0.03'."""
    exponent = math.log2(lam)
    return f"2^{exponent:g}" if abs(exponent - round(exponent)) < 1e-12 else f"{lam:g}"


def parse_lambda(text: str) -> float:
    """'2^-4', '0.0625' or '1e-2' -> float; non-positive values are refused."""
    try:
        value = 2.0 ** float(text.split("^", 1)[1]) if "^" in text else float(text)
    except (ValueError, IndexError):
        raise DoflaError(f"cannot read lambda {text!r}; write it like 2^-4 or 0.0625.") from None
    if value <= 0:
        raise DoflaError(f"lambda must be positive, got {text}.")
    return value
