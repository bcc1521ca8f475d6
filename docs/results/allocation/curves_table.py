"""Write docs/results/allocation/curves_allocation.md from the measured error curves: each layer's curve, the
measured allocation at mean budget 32, and the K = 3 softmax layers chosen uniformly and by measured error."""
import sys
from pathlib import Path

from dofla import dof
from dofla.io import write_text_atomic

curves = dof.ErrorCurves.load(sys.argv[1])
out = Path(sys.argv[2])
layers = list(range(len(curves.layers)))
measured = dof.allocate_feature_dims([0.0] * len(layers), budget=32, variant="measured", curves=curves)
uniform = dof.SOFTMAX_CHOICES["uniform"](layers, 3, measure=None, curves=curves, budget=32)
chosen = dof.SOFTMAX_CHOICES["measured"](layers, 3, measure=None, curves=curves, budget=32)
lines = [
    "# Measured error curves and what they allocate (written by the command in README.md)",
    "",
    f"Criterion `{curves.criterion}`, fitted dimensions {curves.dims}, measured in {curves.seconds:.0f} s.",
    "",
    f"Measured allocation at mean budget 32 (sum {sum(measured.layer_dims)} = 32 x {len(layers)}): "
    + " ".join(str(d) for d in measured.layer_dims) + ".",
    "",
    f"K = 3 softmax layers: uniform {uniform}, measured {chosen}.",
    "",
    "Sum over layers of the fitted error at Fix (32 everywhere): "
    f"{sum(curves.error(layer, 32) for layer in layers):.4f}; at the measured allocation: "
    f"{sum(curves.error(layer, d) for layer, d in zip(layers, measured.layer_dims, strict=True)):.4f}.",
    "",
    "| layer | " + " | ".join(f"error at {d}" for d in curves.dims) + " | fitted at 32 | measured dim |",
    "|---|" + "---|" * (len(curves.dims) + 2),
]
for layer, row in zip(layers, curves.errors, strict=True):
    lines.append(
        f"| {layer} | " + " | ".join(f"{value:.4g}" for value in row)
        + f" | {curves.error(layer, 32):.4g} | {measured.layer_dims[layer]} |"
    )
write_text_atomic(out, "\n".join(lines) + "\n")
