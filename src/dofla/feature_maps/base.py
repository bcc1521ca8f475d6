"""The feature-map base class and the one registry every map name is looked up in."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from dofla.errors import DoflaError
from dofla.registry import Registry

FEATURE_MAPS: Registry[type[FeatureMap]] = Registry("feature map")


def register_feature_map(name: str):
    """Class decorator: make a FeatureMap subclass buildable by ``name``."""
    return FEATURE_MAPS.decorator(name, attribute="name")


def grouped_product(grouped: Tensor, weight: Tensor) -> Tensor:
    """grouped (B, Hm, G, T, D) @ weight (Hm, D, F) -> (B, Hm, G * T, F) per map head, as one batched product
    ((Hm, G * T, F) for a batch of one): a decoding step's cost is its number of operators."""
    batch, heads, group, length, dim = grouped.shape
    if batch == 1:
        return torch.bmm(grouped.reshape(heads, group * length, dim), weight)
    return torch.matmul(grouped.reshape(batch, heads, group * length, dim), weight)


class FeatureMap(nn.Module):
    """phi: (B, Hx, T, D) -> (B, Hx, T, F) non-negative features, one parameter set per map head.

    num_heads: parameter sets ("map heads"); an input with Hx heads uses set i // (Hx // num_heads) for
        head i, so query heads of one key/value group share their group's map (transformers' repeat_kv).
    feature_dim: F, features per head; with ``head_feature_dims`` it is the largest, and a head with
        fewer features gets its extra features exactly 0 (no effect on outputs or gradients).
    scaling: the attention's logit scale (1/sqrt(D) for most models), for maps that approximate
        exp(scaling * q.k).
    """

    name = "base"
    nonnegative = True  # normalised linear attention needs phi >= 0; signed maps serve the delta rule only
    positive_kernel = False  # signed features whose products phi(q) . phi(k) are positive anyway (taylor)

    def __init__(
        self, *, num_heads: int, head_dim: int, feature_dim: int, scaling: float, head_feature_dims=None
    ) -> None:
        super().__init__()
        self.num_heads = int(num_heads)
        self.head_dim = int(head_dim)
        self.feature_dim = int(feature_dim)
        self.scaling = float(scaling)
        dims = (
            [self.feature_dim] * self.num_heads
            if head_feature_dims is None
            else [int(d) for d in head_feature_dims]
        )
        self.head_feature_dims = dims
        # (num_heads, F): True for the features a head really has; derived from the config, so not saved
        self.register_buffer(
            "feature_mask",
            torch.arange(self.feature_dim)[None, :] < torch.tensor(dims)[:, None],
            persistent=False,
        )

    @property
    def has_headwise_dims(self) -> bool:
        return min(self.head_feature_dims) < self.feature_dim

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor | None]:
        """x (B, Hx, T, D) -> phi (B, Hx, T, F) >= 0 in x's dtype, log_scale (B, Hx, T) float32 (float64 for
        float64 x) or None.

        The true features are phi * exp(log_scale)[..., None]; queries always return None (a per-query
        factor cancels in linear attention's normalisation).
        """
        raise NotImplementedError

    def decode_features(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``forward(x, is_query=False)`` in the fewest operators, for decoding steps (whose cost is their
        number of small operators): x (B, Hx, T, D) -> phi (B, Hx, T, F), log_scale (B, Hx, T) or None.

        Equal to ``forward`` up to rounding (a map may reorder its arithmetic); training never takes it.
        Maps without a faster form run ``forward`` (directly: a module call's hook machinery costs as much
        as a small operator).
        """
        return self.forward(x, is_query=False)

    def group_view(self, x: Tensor) -> Tensor:
        """(B, Hx, T, D) -> (B, num_heads, Hx // num_heads, T, D), checking that the heads divide."""
        batch, heads, length, dim = x.shape
        if heads % self.num_heads != 0 or dim != self.head_dim:
            raise DoflaError(
                f"feature map {self.name!r} has {self.num_heads} heads of size {self.head_dim}, got an input "
                f"with {heads} heads of size {dim}; the heads must be a multiple of {self.num_heads}."
            )
        return x.view(batch, self.num_heads, heads // self.num_heads, length, dim)

    def grouped_input(self, x: Tensor) -> Tensor:
        """``group_view`` in the compute dtype: float64 for float64 inputs (tests, gradcheck), else float32."""
        grouped = self.group_view(x)
        return grouped if grouped.dtype in (torch.float32, torch.float64) else grouped.to(torch.float32)

    def masked(self, features: Tensor) -> Tensor:
        """Zero the features a head does not have; features (B, num_heads, G, T, F)."""
        if not self.has_headwise_dims:
            return features
        return features * self.feature_mask[None, :, None, None, :].to(features.dtype)

    def parameter_groups(self, base_lr: float) -> list[dict]:
        """AdamW parameter groups; maps without their own learning rates use ``base_lr`` for everything."""
        parameters = [parameter for parameter in self.parameters() if parameter.requires_grad]
        return [{"params": parameters, "lr": float(base_lr)}] if parameters else []

    def extra_repr(self) -> str:
        dims = f", head_feature_dims={self.head_feature_dims}" if self.has_headwise_dims else ""
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}{dims}"


def build_feature_map(
    name: str,
    *,
    num_heads: int,
    head_dim: int,
    feature_dim: int,
    scaling: float,
    head_feature_dims=None,
    **options,
) -> FeatureMap:
    """Build the registered map ``name``; ``options`` are that map's own keyword arguments."""
    cls = FEATURE_MAPS[name]
    if int(feature_dim) <= 0:
        raise DoflaError(
            f"feature_dim must be positive, got {feature_dim}; give each head at least one feature."
        )
    if int(num_heads) <= 0 or int(head_dim) <= 0:
        raise DoflaError(f"num_heads and head_dim must be positive, got {num_heads} and {head_dim}.")
    if head_feature_dims is not None:
        dims = [int(d) for d in head_feature_dims]
        if len(dims) != int(num_heads):
            raise DoflaError(
                f"head_feature_dims has {len(dims)} entries for {num_heads} map heads; give one per map head."
            )
        if min(dims) <= 0 or max(dims) > int(feature_dim):
            raise DoflaError(
                f"head_feature_dims {dims} must lie in 1..feature_dim ({feature_dim}); raise feature_dim to the "
                "largest head's dimension."
            )
    named = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    shape = {"self", "num_heads", "head_dim", "feature_dim", "scaling", "head_feature_dims"}
    accepted = {
        name
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if parameter.kind in named
    } - shape  # a map's own options (the shape itself is passed through ``**shape``)
    unknown = sorted(set(options) - accepted)
    if unknown:
        allowed = sorted(accepted)
        raise DoflaError(
            f"feature map {name!r} has no option {', '.join(unknown)}; its options are: {', '.join(allowed) or 'none'}."
        )
    return cls(
        num_heads=int(num_heads),
        head_dim=int(head_dim),
        feature_dim=int(feature_dim),
        scaling=float(scaling),
        head_feature_dims=head_feature_dims,
        **options,
    )
