"""The measures of how many features a head needs, one registered function each.

A measure maps one head's captured points to a value per λ. Registered measures (``measure=``):

- ``dof``: the paper's DoF(λ) = tr Σ̃(Σ̃ + λI)⁻¹ of Σ̃ = G/J (:func:`dofla.dof.kernel.degrees_of_freedom`).
  On models whose ``s‖x‖²`` is large it saturates (DoF ≈ J for every head): the diagonal dominates and
  every point is its own direction. The estimate warns.
- ``dof_trace``: the same trace with λ relative to the largest eigenvalue scale, ``λ·max_i G_ii / J``:
  scale-free, it counts how many points carry kernel mass comparable to the largest — how many features a
  head needs before its dominant keys are represented.
- ``attention_rank``: the DoF of the teacher's own attention-probability matrices P (T × T, causal,
  row-stochastic) with λ relative to the top singular value squared: ``Σ σ_k² / (σ_k² + λσ_1²)``,
  averaged over a few sequences. Without the causal mask, a linear attention with M features gives
  ``P̂ = diag(r)⁻¹ Φ_q Φ_kᵀ`` of rank ≤ M, so by Eckart–Young ``‖P − P̂‖_F² ≥ Σ_{k>M} σ_k²``: heads whose
  attention has many significant singular values need many features. With the causal mask the rank
  bound does not hold (the mask of a rank-one matrix can be full rank), so there it is a predictor, not a
  bound; docs/dof.md says how well it predicts.

Adding a measure is one function ``(sample: HeadSample, lambdas) -> Tensor (len(lambdas),) float64``
decorated with :func:`register_measure`, and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dofla.dof.kernel import degrees_of_freedom, energy_rank
from dofla.registry import Registry


@dataclass
class HeadSample:
    """What a measure sees of one head: its J captured points (J, D), its attention scaling and, for
    measures registered with ``needs_attention_spectra``, attention_energy (S, T): the squared singular
    values of the teacher's attention-probability matrices of S sequences."""

    points: torch.Tensor
    scaling: float
    attention_energy: torch.Tensor | None = None
    _paper_dof: dict[float, float] = field(default_factory=dict, repr=False)

    def paper_dof(self, lambdas: Sequence[float]) -> torch.Tensor:
        """The paper's DoF at each λ, float64 (len(lambdas),); each λ is solved once and kept, so the
        estimate's diagnostics reuse what the ``dof`` measure computed."""
        missing = [lam for lam in lambdas if lam not in self._paper_dof]
        if missing:
            values = degrees_of_freedom(self.points, scaling=self.scaling, lambdas=missing)
            self._paper_dof.update(zip(missing, values.tolist(), strict=True))
        return torch.tensor([self._paper_dof[lam] for lam in lambdas], dtype=torch.float64)


@dataclass(frozen=True)
class Measure:
    """A registered measure: its function and what it needs beyond the captured points.

    needs_attention_spectra: the capture must keep attention spectra (``spectra_sequences >= 1``);
    saturation_warning: the measure is the paper's DoF, so its saturation is worth a Python warning.
    """

    name: str
    function: Callable[[HeadSample, Sequence[float]], torch.Tensor]
    needs_attention_spectra: bool = False
    saturation_warning: bool = False


MEASURES: Registry[Measure] = Registry("measure")


def register_measure(name: str, *, needs_attention_spectra: bool = False, saturation_warning: bool = False):
    """Function decorator: make ``function(sample, lambdas)`` the measure ``name``."""

    def register(function):
        MEASURES.add(name, Measure(name, function, needs_attention_spectra, saturation_warning))
        return function

    return register


@register_measure("dof", saturation_warning=True)
def paper_dof(sample: HeadSample, lambdas: Sequence[float]) -> torch.Tensor:
    """DoF(λ) = tr Σ̃(Σ̃ + λI)⁻¹ of Σ̃ = G/J at each λ."""
    return sample.paper_dof(lambdas)


@register_measure("dof_trace")
def dof_trace(sample: HeadSample, lambdas: Sequence[float]) -> torch.Tensor:
    """The paper's trace with each λ scaled by max_i G_ii / J (scale-free)."""
    return degrees_of_freedom(
        sample.points, scaling=sample.scaling, lambdas=lambdas, relative_to_diagonal=True
    )


@register_measure("attention_rank", needs_attention_spectra=True)
def attention_matrix_rank(sample: HeadSample, lambdas: Sequence[float]) -> torch.Tensor:
    """Σ_k σ_k² / (σ_k² + λσ_1²) of the teacher's attention matrices, averaged over the sequences."""
    return energy_rank(sample.attention_energy, lambdas).mean(0)  # (S, L) -> (L,)
