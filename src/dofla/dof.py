"""Degrees of freedom of each layer's (and head's) attention kernel, and feature dimensions allocated by them.

For one head, sample J points x_i from the union of its queries and keys (after rotary) and let
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

Measures (``measure=``):
- ``dof``: the paper's, as above. On models whose ``s‖x‖²`` is large it saturates (DoF ≈ J for every
  head): the diagonal dominates and every point is its own direction. The report says so.
- ``dof_trace``: the same trace with λ relative to the largest eigenvalue scale, ``λ·max_i G_ii / J``:
  scale-free, it counts how many points carry kernel mass comparable to the largest — how many
  features a head needs before its dominant keys are represented.
- ``attention_rank``: the DoF of the teacher's own attention-probability matrices P (T × T, causal,
  row-stochastic) with λ relative to the top singular value squared: ``Σ σ_k² / (σ_k² + λσ_1²)``,
  averaged over a few sequences. Without the causal mask, a linear attention with M features gives
  ``P̂ = diag(r)⁻¹ Φ_q Φ_kᵀ`` of rank ≤ M, so by Eckart–Young ``‖P − P̂‖_F² ≥ Σ_{k>M} σ_k²``: heads
  whose attention has many significant singular values need many features. With the causal mask the
  rank bound does not hold (the mask of a rank-one matrix can be full rank), so there it is a
  predictor, not a bound; docs/dof.md says how well it predicts.

Allocation under a budget C (mean features per layer): ``M_s ∝ measure_s`` with largest-remainder
rounding so that the total is exactly C × (converted layers), a per-layer minimum, and variants
``dof`` (layer = max over heads), ``dof_clip`` (clamped to the head size; the clipped excess is
redistributed over the unclipped layers), ``fix`` (C everywhere) and ``headwise`` (per-head dims
with mean C per head; a layer's tensor width is its largest head). ``keep_softmax=N`` leaves the N
layers with the highest measure as softmax attention.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dofla.config import ConversionPlan, LayerPlan
from dofla.errors import DoflaError

MEASURES = ("dof", "dof_trace", "attention_rank")
VARIANTS = ("dof", "dof_clip", "fix", "headwise")
SATURATION_LEVEL = 0.9  # DoF/J above this counts as saturated
_EPS64 = torch.finfo(torch.float64).eps


# ---------------------------------------------------------------------------------------------------------
# The stable degrees-of-freedom computation
# ---------------------------------------------------------------------------------------------------------


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
    values = values.clamp_min(_EPS64 * float(values.abs().max()))
    return (vectors.square() / values).sum(-1)


SPECTRUM_POINTS = 256  # points per head for the eigenvalue-decay plot (a 256 x 256 eigvalsh is cheap)
SPECTRUM_VALUES = 64  # eigenvalues kept per head


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
    return x.shape[0] * _EPS64 * math.exp(min(log_mu_max, 709.0))


def attention_rank(probabilities: torch.Tensor, lambdas: Sequence[float]) -> torch.Tensor:
    """DoF of attention-probability matrices with λ relative to σ₁²: (..., T, T) -> (..., len(lambdas)) float64."""
    singular = torch.linalg.svdvals(probabilities.to(torch.float64))  # (..., T)
    energy = singular.square()
    top = energy[..., :1]
    return torch.stack([(energy / (energy + lam * top)).sum(-1) for lam in lambdas], dim=-1)


# ---------------------------------------------------------------------------------------------------------
# Estimation on a model
# ---------------------------------------------------------------------------------------------------------


@dataclass
class HeadResult:
    layer: int
    head: int
    measure: dict[str, float]  # "λ" as a string -> value
    dof_over_j: float
    log_kernel_min: float
    log_kernel_max: float
    noise_floor: float
    plain_eig_unreliable: bool
    # the largest eigenvalues of G/J over the first SPECTRUM_POINTS points, divided by the largest
    spectrum: list[float] = field(default_factory=list)


@dataclass
class DofEstimate:
    """Per layer and head: the chosen measure at each λ, with diagnostics. ``layer_measure`` is max over heads."""

    measure: str
    lambdas: list[float]
    num_points: int
    heads: list[HeadResult]
    num_layers: int
    num_heads: int
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def head_measure(self, lam: float | None = None) -> list[list[float]]:
        key = _lambda_key(self.lambdas[0] if lam is None else lam)
        table = [[0.0] * self.num_heads for _ in range(self.num_layers)]
        for head in self.heads:
            table[head.layer][head.head] = head.measure[key]
        return table

    def layer_measure(self, lam: float | None = None) -> list[float]:
        return [max(row) for row in self.head_measure(lam)]

    def saturated_fraction(self) -> float:
        return sum(head.dof_over_j > SATURATION_LEVEL for head in self.heads) / max(1, len(self.heads))

    def to_dict(self) -> dict:
        return asdict(self)


def _lambda_key(lam: float) -> str:
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


@dataclass
class CapturedPoints:
    """Points sampled per (layer, query head) from the union of its queries and keys, captured once.

    points[layer][head]: (J, D) float32; spectra[layer]: squared singular values (S, H, T) of the
    teacher's attention-probability matrices of the first S sequences (only if asked for).
    """

    points: list[list[torch.Tensor]]
    scalings: list[float]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    spectra: dict[int, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


def capture_points(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    num_points: int = 1024,
    seed: int = 0,
    spectra_sequences: int = 0,
    progress: bool = False,
) -> CapturedPoints:
    """Run the teacher on ``batches`` (B, T) once and keep J = ``num_points`` uniformly drawn points per head.

    Each query head h is paired with key/value head h // (H / Hkv); its J points are drawn without
    replacement (seeded) from the 2·tokens vectors [its queries | its keys]. Only the drawn points are
    kept, so memory is O(layers · heads · J · D). The model's attention implementation is restored.
    """
    import time

    from dofla.models import capture_attention, get_adapter

    if num_points < 2:
        raise DoflaError(f"the number of points J must be at least 2, got {num_points}.")
    batches = list(batches)
    if not batches:
        raise DoflaError("no calibration data: give at least one batch of token ids.")
    adapter = get_adapter(model)
    tokens = sum(batch.shape[0] * batch.shape[1] for batch in batches)
    if 2 * tokens < num_points:
        raise DoflaError(
            f"J = {num_points} points were asked for but the calibration data gives only {2 * tokens} "
            f"query and key vectors per head ({tokens} tokens); give more data or a smaller J."
        )
    start = time.perf_counter()
    heads, groups = adapter.num_heads, adapter.num_heads // adapter.num_kv_heads
    scalings = [adapter.attention_scaling(layer, model) for layer in range(adapter.num_layers)]
    generator = torch.Generator().manual_seed(seed)
    # Chosen indices into the union [queries of all tokens | keys of all tokens], per head.
    chosen = torch.stack([torch.randperm(2 * tokens, generator=generator)[:num_points] for _ in range(heads)])
    samples: dict[int, list[list[torch.Tensor]]] = {
        layer: [[] for _ in range(heads)] for layer in range(adapter.num_layers)
    }
    spectra: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(adapter.num_layers)}
    offset, sequences_seen = 0, 0
    iterator = capture_attention(model, batches, fields=("query", "key"), dtype=torch.float32)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, total=len(batches), desc="capturing q/k", unit="batch")
    for batch, captured in zip(batches, iterator, strict=True):
        batch_tokens = batch.shape[0] * batch.shape[1]
        in_batch = (chosen >= offset) & (chosen < offset + batch_tokens)  # (H, J) queries of this batch
        in_batch_keys = (chosen >= tokens + offset) & (chosen < tokens + offset + batch_tokens)
        for layer, tensors in captured.items():
            query = tensors["query"].transpose(1, 2).reshape(-1, heads, adapter.head_dim)  # (B·T, H, D)
            key = tensors["key"].transpose(1, 2).reshape(-1, adapter.num_kv_heads, adapter.head_dim)
            for head in range(heads):
                samples[layer][head].append(query[chosen[head][in_batch[head]] - offset, head])
                samples[layer][head].append(
                    key[chosen[head][in_batch_keys[head]] - tokens - offset, head // groups]
                )
            for sequence in range(max(0, min(batch.shape[0], spectra_sequences - sequences_seen))):
                probabilities = _attention_probabilities(
                    tensors["query"][sequence], tensors["key"][sequence], scalings[layer], groups
                )
                spectra[layer].append(torch.linalg.svdvals(probabilities).square())  # (H, T)
        offset += batch_tokens
        sequences_seen += batch.shape[0]
    points = [
        [torch.cat(samples[layer][head]) for head in range(heads)] for layer in range(adapter.num_layers)
    ]
    return CapturedPoints(
        points=points,
        scalings=scalings,
        num_layers=adapter.num_layers,
        num_heads=heads,
        num_kv_heads=adapter.num_kv_heads,
        spectra={layer: torch.stack(values) for layer, values in spectra.items() if values},
        seconds=time.perf_counter() - start,
    )


def measure_points(
    captured: CapturedPoints,
    *,
    lambdas: Sequence[float] = (2**-4,),
    measure: str = "dof",
    num_points: int | None = None,
    seed: int = 0,
    kernel_spectra: bool = False,
) -> DofEstimate:
    """The chosen measure per layer and head from captured points (optionally a seeded J-subset of them).

    ``kernel_spectra``: also keep each head's :func:`kernel_spectrum` (for the eigenvalue-decay plot).
    """
    import time

    if measure not in MEASURES:
        raise DoflaError(f"unknown measure {measure!r}; use one of {', '.join(MEASURES)}.")
    if any(lam <= 0 for lam in lambdas):
        raise DoflaError(f"every lambda must be positive, got {list(lambdas)}.")
    if measure == "attention_rank" and not captured.spectra:
        raise DoflaError("attention_rank needs attention spectra; capture with spectra_sequences >= 1.")
    available = captured.points[0][0].shape[0]
    if num_points is not None and num_points > available:
        raise DoflaError(f"J = {num_points} is more than the {available} captured points; capture more.")
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    results = []
    for layer in range(captured.num_layers):
        scaling = captured.scalings[layer]
        for head in range(captured.num_heads):
            points = captured.points[layer][head]  # (J, D)
            if num_points is not None and num_points < available:
                points = points[torch.randperm(available, generator=generator)[:num_points]]
            dof = degrees_of_freedom(
                points, scaling=scaling, lambdas=lambdas if measure == "dof" else lambdas[:1]
            )
            if measure == "dof":
                values = dof
            elif measure == "dof_trace":
                values = degrees_of_freedom(
                    points, scaling=scaling, lambdas=lambdas, relative_to_diagonal=True
                )
            else:
                energy = captured.spectra[layer][:, head]  # (S, T)
                values = torch.stack(
                    [(energy / (energy + lam * energy[:, :1])).sum(-1).mean() for lam in lambdas]
                )
            log_diag = scaling * points.double().square().sum(-1)
            noise = plain_eigen_noise_floor(points, scaling)
            results.append(
                HeadResult(
                    layer=layer,
                    head=head,
                    measure={
                        _lambda_key(lam): float(value) for lam, value in zip(lambdas, values, strict=True)
                    },
                    dof_over_j=float(dof[0]) / points.shape[0],
                    log_kernel_min=float(log_diag.min()),
                    log_kernel_max=float(log_diag.max()),
                    noise_floor=noise,
                    plain_eig_unreliable=noise > min(lambdas),
                    spectrum=(
                        kernel_spectrum(points[:SPECTRUM_POINTS], scaling).tolist() if kernel_spectra else []
                    ),
                )
            )
    result = DofEstimate(
        measure=measure,
        lambdas=list(lambdas),
        num_points=num_points or available,
        heads=results,
        num_layers=captured.num_layers,
        num_heads=captured.num_heads,
        seconds=captured.seconds + time.perf_counter() - start,
    )
    saturated = result.saturated_fraction()
    if saturated > 0.5:
        result.warnings.append(
            f"DoF is saturated on this model: {saturated:.0%} of heads have DoF/J > {SATURATION_LEVEL} (the kernel's "
            "diagonal exp(s·|x|²) dominates), so the paper's measure does not discriminate between layers and a "
            "DoF allocation is nearly Fix; consider --measure dof_trace or attention_rank."
        )
    unreliable = sum(head.plain_eig_unreliable for head in results)
    if unreliable:
        result.warnings.append(
            f"a plain float64 eigendecomposition of G/J would be unreliable for {unreliable} of {len(results)} heads "
            "(its error exceeds lambda); the stable factorised form was used."
        )
    return result


def estimate(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    num_points: int = 1024,
    lambdas: Sequence[float] = (2**-4,),
    measure: str = "dof",
    seed: int = 0,
    rank_sequences: int = 2,
    progress: bool = False,
    kernel_spectra: bool = False,
) -> DofEstimate:
    """Measure every layer's and head's DoF (or ``measure``) on calibration batches of token ids (B, T).

    :func:`capture_points` then :func:`measure_points`; ``rank_sequences`` sequences give the attention
    spectra of ``attention_rank``; ``kernel_spectra`` keeps each head's kernel eigenvalues. Warns when the
    paper's DoF is saturated (DoF/J > 0.9 for most heads).
    """
    if measure not in MEASURES:
        raise DoflaError(f"unknown measure {measure!r}; use one of {', '.join(MEASURES)}.")
    if any(lam <= 0 for lam in lambdas):
        raise DoflaError(f"every lambda must be positive, got {list(lambdas)}.")
    captured = capture_points(
        model,
        list(batches),
        num_points=num_points,
        seed=seed,
        spectra_sequences=rank_sequences if measure == "attention_rank" else 0,
        progress=progress,
    )
    result = measure_points(captured, lambdas=lambdas, measure=measure, kernel_spectra=kernel_spectra)
    if measure == "dof" and result.saturated_fraction() > 0.5:
        warnings.warn(result.warnings[0], stacklevel=2)
    return result


def _attention_probabilities(
    query: torch.Tensor, key: torch.Tensor, scaling: float, groups: int
) -> torch.Tensor:
    """Causal softmax attention probabilities of one sequence: query (H, T, D), key (Hk, T, D) -> (H, T, T)."""
    key = key.repeat_interleave(groups, 0)
    scores = (query.double() @ key.double().transpose(-1, -2)) * scaling
    length = scores.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


# ---------------------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------------------


def _largest_remainder(shares: Sequence[float], total: int, minimum: int, maximum: int | None) -> list[int]:
    """Integers proportional to ``shares`` summing exactly to ``total``, each within [minimum, maximum].

    Water-filling: x_i = clip(t·share_i, minimum, maximum) with t chosen so that Σx = total (what a
    bound cuts from one layer goes to the others in proportion); then largest-remainder rounding.
    If even t → ∞ leaves budget over (zero shares pinned at the minimum), the rest is spread evenly
    over the layers still below the maximum.
    """
    count = len(shares)
    upper = float(maximum) if maximum is not None else math.inf
    if minimum * count > total:
        raise DoflaError(
            f"a minimum of {minimum} features for {count} layers needs {minimum * count}, more than the budget {total}."
        )
    if upper * count < total:
        raise DoflaError(
            f"the budget of {total} features cannot be placed in {count} layers of at most {maximum} each; "
            f"lower the budget to at most {maximum} per layer."
        )
    shares = [max(float(value), 0.0) for value in shares]

    def filled(scale: float) -> list[float]:
        return [min(max(scale * share, minimum), upper) for share in shares]

    low, high = 0.0, 1.0
    while sum(filled(high)) < total and high < 1e300:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if sum(filled(middle)) < total else (low, middle)
    ideal = filled(high)
    short = total - sum(ideal)
    if short > 1e-9:  # only layers with zero share can still take features
        open_layers = [i for i in range(count) if ideal[i] < upper]
        for i in open_layers:
            ideal[i] = min(upper, ideal[i] + short / len(open_layers))
    scale_back = total / sum(ideal)
    ideal = [min(max(value * scale_back, minimum), upper) for value in ideal]
    result = [min(max(math.floor(value), minimum), int(min(upper, total))) for value in ideal]
    leftover = total - sum(result)
    order = sorted(range(count), key=lambda i: (ideal[i] - result[i], -i), reverse=True)
    step = 1 if leftover > 0 else -1
    while leftover != 0:
        moved = False
        for i in order if step > 0 else reversed(order):
            if leftover == 0:
                break
            candidate = result[i] + step
            if minimum <= candidate <= upper:
                result[i] = candidate
                leftover -= step
                moved = True
        if not moved:
            raise DoflaError(f"cannot place {total} features within the per-layer bounds.")
    return result


@dataclass
class Allocation:
    variant: str
    budget: int
    layer_dims: list[int]  # 0 for layers kept as softmax
    head_dims: list[list[int]] | None = None  # headwise only: per map head
    softmax_layers: list[int] = field(default_factory=list)


def allocate_feature_dims(
    layer_measure: Sequence[float],
    *,
    budget: int,
    variant: str = "dof",
    head_size: int | None = None,
    minimum: int = 1,
    keep_softmax: int = 0,
    head_measure: Sequence[Sequence[float]] | None = None,
) -> Allocation:
    """Feature dimensions per layer (and per head for ``headwise``) with mean ``budget`` over converted layers."""
    layers = len(layer_measure)
    if variant not in VARIANTS:
        raise DoflaError(f"unknown allocation {variant!r}; use one of {', '.join(VARIANTS)}.")
    if budget <= 0:
        raise DoflaError(f"the budget must be a positive number of features per layer, got {budget}.")
    if minimum < 1:
        raise DoflaError(f"the minimum per layer must be at least 1, got {minimum}.")
    if not 0 <= keep_softmax < layers:
        raise DoflaError(
            f"keep_softmax must be between 0 and {layers - 1} for {layers} layers, got {keep_softmax}."
        )
    if any(not math.isfinite(value) or value < 0 for value in layer_measure):
        raise DoflaError("the layer measures must be finite and non-negative.")
    ranked = sorted(range(layers), key=lambda i: layer_measure[i], reverse=True)
    softmax_layers = sorted(ranked[:keep_softmax])
    converted = [i for i in range(layers) if i not in softmax_layers]
    dims = [0] * layers
    head_dims = None
    if variant == "fix":
        if budget < minimum:
            raise DoflaError(f"the budget {budget} is below the minimum {minimum}.")
        for i in converted:
            dims[i] = budget
    elif variant in ("dof", "dof_clip"):
        if variant == "dof_clip" and head_size is None:
            raise DoflaError("dof_clip needs the head size.")
        values = _largest_remainder(
            [layer_measure[i] for i in converted],
            budget * len(converted),
            minimum,
            head_size if variant == "dof_clip" else None,
        )
        for i, value in zip(converted, values, strict=True):
            dims[i] = value
    else:  # headwise
        if head_measure is None:
            raise DoflaError("headwise allocation needs the per-head measures.")
        per_layer_heads = len(head_measure[0])
        flat = [head_measure[i][h] for i in converted for h in range(per_layer_heads)]
        values = _largest_remainder(flat, budget * len(flat), minimum, None)
        head_dims = [[0] * per_layer_heads for _ in range(layers)]
        for position, i in enumerate(converted):
            head_dims[i] = values[position * per_layer_heads : (position + 1) * per_layer_heads]
            dims[i] = max(head_dims[i])
    return Allocation(
        variant=variant, budget=budget, layer_dims=dims, head_dims=head_dims, softmax_layers=softmax_layers
    )


def map_head_measure(
    head_measure: Sequence[Sequence[float]], num_kv_heads: int, share_kv_heads: bool
) -> list[list[float]]:
    """Per-query-head measures -> per map head: with shared maps, the max over the query heads of a group."""
    if not share_kv_heads:
        return [list(row) for row in head_measure]
    groups = len(head_measure[0]) // num_kv_heads
    return [[max(row[g * groups : (g + 1) * groups]) for g in range(num_kv_heads)] for row in head_measure]


def make_plan(
    model: torch.nn.Module,
    estimate_or_allocation: DofEstimate | Allocation,
    *,
    budget: int = 64,
    variant: str = "dof",
    kind: str = "linear",
    feature_map: str = "learnable_prf",
    window: int = 64,
    minimum: int = 1,
    keep_softmax: int = 0,
    share_kv_heads: bool = True,
    lam: float | None = None,
    metadata: dict | None = None,
) -> ConversionPlan:
    """A conversion plan from a DoF estimate (allocated here) or from a ready allocation.

    ``metadata`` (e.g. from :func:`plan_metadata`) is merged into the plan's metadata.
    """
    from dofla.models import get_adapter

    adapter = get_adapter(model)
    if isinstance(estimate_or_allocation, DofEstimate):
        estimate_result = estimate_or_allocation
        head_measure = map_head_measure(
            estimate_result.head_measure(lam), adapter.num_kv_heads, share_kv_heads
        )
        allocation = allocate_feature_dims(
            estimate_result.layer_measure(lam),
            budget=budget,
            variant=variant,
            head_size=adapter.head_dim,
            minimum=minimum,
            keep_softmax=keep_softmax,
            head_measure=head_measure,
        )
        recorded = {
            "allocation": variant,
            "measure": estimate_result.measure,
            "lambda": _lambda_key(lam if lam is not None else estimate_result.lambdas[0]),
            "num_points": estimate_result.num_points,
            "budget": budget,
            "saturated_fraction": estimate_result.saturated_fraction(),
        }
    else:
        allocation = estimate_or_allocation
        recorded = {"allocation": allocation.variant, "budget": allocation.budget}
    recorded.update(metadata or {})
    layers = []
    for index in range(adapter.num_layers):
        if allocation.layer_dims[index] == 0:
            layers.append(LayerPlan(kind="softmax"))
            continue
        head_dims = allocation.head_dims[index] if allocation.head_dims is not None else None
        layers.append(
            LayerPlan(
                kind=kind,
                feature_map=feature_map,
                feature_dim=allocation.layer_dims[index],
                head_feature_dims=head_dims,
                share_kv_heads=share_kv_heads,
                window=window,
            )
        )
    plan = ConversionPlan(
        model_type=adapter.model_type,
        num_layers=adapter.num_layers,
        num_heads=adapter.num_heads,
        num_kv_heads=adapter.num_kv_heads,
        head_dim=adapter.head_dim,
        layers=layers,
        metadata=recorded,
    )
    plan.validate()
    return plan


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------


def allocate_all(
    estimate_result: DofEstimate,
    adapter,
    *,
    budget: int,
    minimum: int = 1,
    keep_softmax: int = 0,
    lam: float | None = None,
    share_kv_heads: bool = True,
) -> dict[str, Allocation]:
    """Every allocation variant for one estimate: {"fix", "dof", "dof_clip" (if budget <= head size), "headwise"}."""
    layer_values = estimate_result.layer_measure(lam)
    head_values = map_head_measure(estimate_result.head_measure(lam), adapter.num_kv_heads, share_kv_heads)
    allocations = {}
    for variant in VARIANTS:
        if variant == "dof_clip" and budget > adapter.head_dim:
            continue
        allocations[variant] = allocate_feature_dims(
            layer_values,
            budget=budget,
            variant=variant,
            head_size=adapter.head_dim,
            minimum=minimum,
            keep_softmax=keep_softmax,
            head_measure=head_values,
        )
    return allocations


def plan_metadata(estimate_result: DofEstimate, allocation: Allocation, *, data: str, seed: int) -> dict:
    """What a plan records about how it was allocated."""
    return {
        "allocation": allocation.variant,
        "budget": allocation.budget,
        "measure": estimate_result.measure,
        "lambda": _lambda_key(estimate_result.lambdas[0]),
        "lambdas": [_lambda_key(lam) for lam in estimate_result.lambdas],
        "num_points": estimate_result.num_points,
        "seed": seed,
        "calibration": data,
        "softmax_layers": allocation.softmax_layers,
        "saturated_fraction": estimate_result.saturated_fraction(),
    }


def markdown_report(
    estimate_result: DofEstimate, adapter, *, budget: int, minimum: int = 1, keep_softmax: int = 0
) -> str:
    """Summary, warnings, diagnostic ranges, and per λ the per-layer table with dims of every variant at ``budget``."""
    heads = estimate_result.heads
    unreliable = sum(head.plain_eig_unreliable for head in heads)
    lines = [
        f"# Degrees of freedom: measure `{estimate_result.measure}`, J = {estimate_result.num_points}",
        "",
        f"- heads: {len(heads)} ({estimate_result.num_layers} layers x {estimate_result.num_heads}); "
        f"time {estimate_result.seconds:.1f} s (capture and solve)",
        f"- heads with DoF/J > {SATURATION_LEVEL} (paper's DoF at the first λ): "
        f"{sum(head.dof_over_j > SATURATION_LEVEL for head in heads)} of {len(heads)}",
        f"- log-kernel diagonal s·|x|²: {min(h.log_kernel_min for h in heads):.1f} .. "
        f"{max(h.log_kernel_max for h in heads):.1f}",
        f"- heads where a plain float64 eigendecomposition's error (noise floor) exceeds λ: {unreliable}",
        "",
    ]
    lines += [f"> **Warning:** {message}" for message in estimate_result.warnings]
    for lam in estimate_result.lambdas:
        allocations = allocate_all(
            estimate_result, adapter, budget=budget, minimum=minimum, keep_softmax=keep_softmax, lam=lam
        )
        lines += [
            "",
            f"## λ = {_lambda_key(lam)}, C = {budget}",
            "",
            markdown_table(estimate_result, allocations, lam),
        ]
    return "\n".join(lines) + "\n"


def markdown_table(
    estimate_result: DofEstimate, allocations: dict[str, Allocation], lam: float | None = None
) -> str:
    """Layer, per-head measure, layer measure (max), and dimensions under each allocation variant."""
    heads = estimate_result.head_measure(lam)
    layer_values = estimate_result.layer_measure(lam)
    names = list(allocations)
    lines = [
        f"| layer | per-head {estimate_result.measure} | layer | " + " | ".join(names) + " |",
        "|---:|---|---:|" + "---:|" * len(names),
    ]
    for layer, row in enumerate(heads):
        dims = []
        for name in names:
            allocation = allocations[name]
            if allocation.head_dims is not None and allocation.layer_dims[layer]:
                dims.append("/".join(str(d) for d in allocation.head_dims[layer]))
            else:
                dims.append(str(allocation.layer_dims[layer] or "softmax"))
        lines.append(
            f"| {layer} | {' '.join(f'{value:.1f}' for value in row)} | {layer_values[layer]:.1f} | "
            + " | ".join(dims)
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot_report(
    estimate_result: DofEstimate, allocations: dict[str, Allocation], out_dir: Path
) -> list[Path]:
    """PNG plots: dimensions per layer for each variant; the measure against λ per layer; the kernel's
    eigenvalue decay per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    figure, axis = plt.subplots(figsize=(8, 4))
    for name, allocation in allocations.items():
        axis.plot(range(len(allocation.layer_dims)), allocation.layer_dims, marker="o", label=name)
    axis.set(xlabel="layer", ylabel="feature dimension", title=f"allocation by {estimate_result.measure}")
    axis.legend()
    figure.tight_layout()
    paths.append(out_dir / "dims_per_layer.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(8, 4))
    for lam in estimate_result.lambdas:
        axis.plot(estimate_result.layer_measure(lam), marker=".", label=f"λ = {_lambda_key(lam)}")
    axis.set(xlabel="layer", ylabel=f"{estimate_result.measure} (max over heads)", title="measure against λ")
    axis.legend()
    figure.tight_layout()
    paths.append(out_dir / "measure_vs_lambda.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    if any(head.spectrum for head in estimate_result.heads):
        paths.append(plot_eigenvalue_decay(estimate_result, out_dir / "eigenvalue_decay.png"))
    return paths


def layer_spectra(estimate_result: DofEstimate) -> dict[int, torch.Tensor]:
    """Per layer, the median over heads of each relative eigenvalue μ_k / μ_1 (k = 1..SPECTRUM_VALUES)."""
    spectra: dict[int, list[list[float]]] = {}
    for head in estimate_result.heads:
        if head.spectrum:
            spectra.setdefault(head.layer, []).append(head.spectrum)
    return {
        layer: torch.tensor(rows, dtype=torch.float64).median(dim=0).values for layer, rows in spectra.items()
    }


def plot_eigenvalue_decay(estimate_result: DofEstimate, path: Path) -> Path:
    """μ_k / μ_1 of G/J against k, one line per layer (median over heads), with the float64 noise level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spectra = layer_spectra(estimate_result)
    colours = plt.get_cmap("viridis")
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for layer, values in sorted(spectra.items()):
        shown = values.clamp_min(1e-18).numpy()
        axis.semilogy(range(1, len(shown) + 1), shown, color=colours(layer / max(1, len(spectra) - 1)), lw=1)
    axis.axhline(SPECTRUM_POINTS * _EPS64, color="red", ls="--", lw=1, label="float64 rounding (N·ε)")
    mappable = plt.cm.ScalarMappable(cmap=colours, norm=plt.Normalize(0, max(spectra) if spectra else 1))
    figure.colorbar(mappable, ax=axis, label="layer")
    axis.set(
        xlabel="k",
        ylabel="μ_k / μ_1 (median over heads)",
        title=f"kernel eigenvalue decay, exp(s·x_iᵀx_j) on {SPECTRUM_POINTS} captured points per head",
    )
    axis.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
