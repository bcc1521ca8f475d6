"""Degrees of freedom: the stable form against high precision, known spectra, limits; allocation invariants."""

import math

import mpmath
import pytest
import torch

from dofla import dof
from dofla.errors import DoflaError


def _mpmath_dof(points: torch.Tensor, scaling: float, lam: float, digits: int = 90) -> float:
    """tr Σ(Σ + λI)⁻¹ with Σ = G/J computed with ``digits`` decimal digits (no factorisation tricks)."""
    mpmath.mp.dps = digits
    rows = points.double().tolist()
    size = len(rows)
    gram = mpmath.matrix(size, size)
    for i in range(size):
        for j in range(size):
            dot = mpmath.fsum(mpmath.mpf(a) * mpmath.mpf(b) for a, b in zip(rows[i], rows[j], strict=True))
            gram[i, j] = mpmath.exp(mpmath.mpf(scaling) * dot) / size
    shifted = gram + mpmath.mpf(lam) * mpmath.eye(size)
    product = gram * mpmath.inverse(shifted)
    return float(mpmath.fsum(product[i, i] for i in range(size)))


@pytest.mark.parametrize("norm", [0.5, 3.0, 9.0])
def test_stable_form_matches_90_digits_including_large_norms_and_duplicates(norm):
    generator = torch.Generator().manual_seed(int(norm * 10))
    points = torch.randn(14, 4, generator=generator, dtype=torch.float64)
    points = (
        norm
        * points
        / points.norm(dim=-1, keepdim=True)
        * torch.linspace(0.3, 1.0, 14, dtype=torch.float64)[:, None]
    )
    points = torch.cat([points, points[:3]])  # exact duplicates
    for lam in (2**-2, 2**-6):
        stable = float(dof.degrees_of_freedom(points, scaling=0.5, lambdas=[lam])[0])
        assert stable == pytest.approx(_mpmath_dof(points, 0.5, lam), rel=1e-8, abs=1e-8)


def test_identical_points_give_a_rank_one_matrix():
    point = torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64)
    points = point.repeat(50, 1)
    scaling = 0.7
    mu = math.exp(scaling * float(point.square().sum()))  # the single non-zero eigenvalue of G/J
    for lam in (1e-3, 0.1, 10.0):
        value = float(dof.degrees_of_freedom(points, scaling=scaling, lambdas=[lam])[0])
        assert value == pytest.approx(mu / (mu + lam), rel=1e-10)


def test_limits_and_monotone_in_lambda():
    points = torch.randn(40, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.5
    lambdas = [1e-12, 1e-4, 1e-2, 1.0, 1e2, 1e8]
    values = dof.degrees_of_freedom(points, scaling=0.4, lambdas=lambdas).tolist()
    assert values == sorted(values, reverse=True)
    assert values[0] == pytest.approx(40, abs=1e-3)  # λ -> 0: every distinct point counts
    assert values[-1] < 1e-6  # λ -> ∞: nothing counts


def test_finite_rank_kernel_is_bounded_by_its_rank():
    # Points on a 1-D line through the origin with tiny norms: exp(s xᵀy) ≈ 1 + s xᵀy (rank ≤ 2 to first order);
    # exactly, the kernel of points x = t·u has rank equal to the number of distinct t only in the limit, so
    # instead check the exact finite-rank case: all points equal up to sign -> at most 2 distinct points.
    base = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    points = torch.cat([base.repeat(20, 1), (-base).repeat(20, 1)])
    assert float(dof.degrees_of_freedom(points, scaling=0.5, lambdas=[1e-9])[0]) <= 2.0 + 1e-9


def test_saturation_on_huge_diagonals_is_counted_exactly():
    # Large, spread norms: the diagonal dominates, every point is its own direction: DoF ≈ J.
    generator = torch.Generator().manual_seed(1)
    points = torch.randn(64, 8, generator=generator, dtype=torch.float64) * 4.0
    value = float(dof.degrees_of_freedom(points, scaling=1.0, lambdas=[2**-4])[0])
    assert 63.0 < value <= 64.0
    assert dof.plain_eigen_noise_floor(points, 1.0) > 2**-4  # a plain eigendecomposition would be wrong here
    # The trace-relative λ does not saturate on the same points.
    relative = float(
        dof.degrees_of_freedom(points, scaling=1.0, lambdas=[2**-4], relative_to_diagonal=True)[0]
    )
    assert relative < 32


def test_attention_rank_of_known_matrices():
    identity = torch.eye(16, dtype=torch.float64)  # every token attends only to itself: full rank
    assert float(dof.attention_rank(identity, [1e-3])[0]) == pytest.approx(16 / (1 + 1e-3))
    first_token = torch.zeros(16, 16, dtype=torch.float64)
    first_token[:, 0] = 1.0  # every token attends to the first: rank one
    assert float(dof.attention_rank(first_token, [1e-3])[0]) == pytest.approx(1 / (1 + 1e-3))


def test_bad_lambdas_are_refused():
    with pytest.raises(DoflaError, match="positive"):
        dof.degrees_of_freedom(torch.zeros(3, 2), scaling=1.0, lambdas=[0.0])
    assert dof.parse_lambda("2^-4") == 2**-4 and dof.parse_lambda("0.5") == 0.5
    with pytest.raises(DoflaError, match="positive"):
        dof.parse_lambda("-1")
    with pytest.raises(DoflaError, match="cannot read lambda"):
        dof.parse_lambda("two")


def test_plain_eigvalsh_is_wrong_where_detected_and_the_stable_form_is_not():
    # Norms 0.5..6.5 at scale 1: G's diagonal reaches e^42, so eigvalsh(G/J) has absolute errors far above λ.
    generator = torch.Generator().manual_seed(3)
    points = torch.randn(24, 3, generator=generator, dtype=torch.float64)
    points = (
        points
        / points.norm(dim=-1, keepdim=True)
        * torch.linspace(0.5, 6.5, 24, dtype=torch.float64)[:, None]
    )
    points = torch.cat([points, points[:2]])  # exact duplicates
    lam = 2**-4
    exact = _mpmath_dof(points, 1.0, lam, digits=120)
    stable = float(dof.degrees_of_freedom(points, scaling=1.0, lambdas=[lam])[0])
    eigenvalues = torch.linalg.eigvalsh(torch.exp(points @ points.T) / points.shape[0])
    plain = float((eigenvalues / (eigenvalues + lam)).sum())
    assert stable == pytest.approx(exact, rel=1e-10)
    assert abs(plain - exact) > 1.0  # the plain count is off by whole degrees of freedom
    assert dof.plain_eigen_noise_floor(points, 1.0) > lam  # and this is detected


def test_kernel_spectrum_matches_the_closed_form_and_never_overflows():
    from dofla.dof import kernel_spectrum, layer_spectra

    # orthogonal points of squared norm c: G = (e^{sc} - 1) I + 1 1ᵀ, eigenvalues e^{sc} - 1 + N and e^{sc} - 1
    n, c, s = 6, 2.0, 0.5
    points = (torch.eye(n, dtype=torch.float64) * c**0.5)[:, :n]
    spectrum = kernel_spectrum(points, s)
    top, rest = math.exp(s * c) - 1 + n, math.exp(s * c) - 1
    expected = torch.tensor([1.0] + [rest / top] * (n - 1), dtype=torch.float64)
    torch.testing.assert_close(spectrum, expected, rtol=1e-10, atol=1e-12)
    # identical points: rank one
    same = kernel_spectrum(torch.ones(5, 3, dtype=torch.float64), 1.0)
    assert same[0] == 1.0 and same[1:].abs().max() < 1e-12
    # exp(s·|x|²) far beyond float64: still finite ratios (here the diagonal dominates: all close to 1)
    huge = kernel_spectrum(torch.eye(4, dtype=torch.float64) * 40.0, 1.0)
    assert torch.isfinite(huge).all() and huge.min() > 0.999
    assert len(kernel_spectrum(torch.randn(100, 4, dtype=torch.float64), 0.1)) == 64
    # per layer: the median over heads of each relative eigenvalue
    heads = [
        dof.HeadResult(0, h, {}, 1.0, 0.0, 0.0, 0.0, False, spectrum=[1.0, value, value / 10])
        for h, value in enumerate([0.5, 0.1, 0.3])
    ]
    result = dof.DofEstimate("dof", [0.0625], 3, heads, num_layers=1, num_heads=3, seconds=0.0)
    torch.testing.assert_close(layer_spectra(result)[0], torch.tensor([1.0, 0.3, 0.03], dtype=torch.float64))
