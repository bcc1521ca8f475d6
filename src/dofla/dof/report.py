"""What ``dofla dof`` shows of an estimate: the per-layer markdown table and PNG plots."""

from __future__ import annotations

from pathlib import Path

import torch

from dofla.dof.allocate import Allocation
from dofla.dof.estimation import DofEstimate
from dofla.dof.kernel import FLOAT64_EPS, SPECTRUM_POINTS, lambda_key
from dofla.io import write_atomic


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
        axis.plot(estimate_result.layer_measure(lam), marker=".", label=f"λ = {lambda_key(lam)}")
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
    axis.axhline(SPECTRUM_POINTS * FLOAT64_EPS, color="red", ls="--", lw=1, label="float64 rounding (N·ε)")
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


def plot_error_curves(curves, path: Path) -> Path:
    """Each layer's measured error against its feature dimension (log-log), one line per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    colours = plt.cm.viridis([i / max(1, len(curves.layers) - 1) for i in range(len(curves.layers))])
    for colour, layer, row in zip(colours, curves.layers, curves.errors, strict=True):
        axis.plot(curves.dims, row, "o-", color=colour, lw=1, ms=3, label=f"layer {layer}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("feature dimension")
    axis.set_ylabel(f"measured error ({curves.criterion})")
    axis.set_title("per-layer error curves (short teacher-forced fits)")
    if len(curves.layers) <= 12:
        axis.legend(fontsize=6)
    figure.tight_layout()
    write_atomic(Path(path), lambda temporary: figure.savefig(temporary, format="png", dpi=110))
    plt.close(figure)
    return Path(path)
