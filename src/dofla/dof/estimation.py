"""Capture q/k points from a teacher once, then measure every layer and head: the :class:`DofEstimate`.

:func:`capture_points` runs the teacher over calibration batches and keeps J uniformly drawn points per
head from the union of its queries and keys (after rotary); :func:`measure_points` applies a registered
measure (:mod:`dofla.dof.measures`) to each head at each λ, with diagnostics (DoF/J, the log-kernel
range, whether a plain eigendecomposition would be unreliable); :func:`estimate` does both.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from dofla.dof.kernel import SPECTRUM_POINTS, kernel_spectrum, lambda_key, plain_eigen_noise_floor
from dofla.dof.measures import MEASURES, HeadSample
from dofla.errors import DoflaError

SATURATION_LEVEL = 0.9  # DoF/J above this counts as saturated


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
        key = lambda_key(self.lambdas[0] if lam is None else lam)
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
    chosen = MEASURES[measure]
    if any(lam <= 0 for lam in lambdas):
        raise DoflaError(f"every lambda must be positive, got {list(lambdas)}.")
    if chosen.needs_attention_spectra and not captured.spectra:
        raise DoflaError(f"{measure} needs attention spectra; capture with spectra_sequences >= 1.")
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
            spectra = captured.spectra[layer][:, head] if chosen.needs_attention_spectra else None  # (S, T)
            sample = HeadSample(points, scaling, spectra)
            values = chosen.function(sample, lambdas)
            dof = sample.paper_dof(lambdas[:1])  # the diagnostics' DoF/J at the first λ
            log_diag = scaling * points.double().square().sum(-1)
            noise = plain_eigen_noise_floor(points, scaling)
            results.append(
                HeadResult(
                    layer=layer,
                    head=head,
                    measure={
                        lambda_key(lam): float(value) for lam, value in zip(lambdas, values, strict=True)
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
            "DoF allocation is nearly Fix; consider --allocation measured (measured error curves) or --measure "
            "dof_trace or attention_rank."
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
    chosen = MEASURES[measure]
    if any(lam <= 0 for lam in lambdas):
        raise DoflaError(f"every lambda must be positive, got {list(lambdas)}.")
    captured = capture_points(
        model,
        list(batches),
        num_points=num_points,
        seed=seed,
        spectra_sequences=rank_sequences if chosen.needs_attention_spectra else 0,
        progress=progress,
    )
    result = measure_points(captured, lambdas=lambdas, measure=measure, kernel_spectra=kernel_spectra)
    if chosen.saturation_warning and result.saturated_fraction() > 0.5:
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
