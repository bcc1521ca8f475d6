"""Learned feature maps: Hedgehog (LoLCATs) and the cheap baselines T2R and elu+1.

All compute in float32 and return features in the input's dtype with ``log_scale`` None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dofla.derived import DerivedTensor
from dofla.errors import DoflaError
from dofla.feature_maps.base import FeatureMap, grouped_product, register_feature_map


def identity_like(num_heads: int, rows: int, columns: int, generator, extra_std: float) -> Tensor:
    """(num_heads, rows, columns): the identity on the overlap; extra columns drawn N(0, extra_std^2)."""
    weight = torch.eye(rows, columns).expand(num_heads, rows, columns).clone()
    if columns > rows:
        weight[..., rows:] = extra_std * torch.randn(num_heads, rows, columns - rows, generator=generator)
    return weight


@register_feature_map("hedgehog")
class HedgehogFeatures(FeatureMap):
    """phi(x) = [softmax(x W) ⊕ softmax(-x W)] per head, W (num_heads, D, F/2) trainable (LoLCATs).

    Initialised identity-like (exactly the identity when F/2 == D). Features are interleaved
    (positive, negative, positive, ...) so that a head with M_h < F features uses the first M_h:
    each softmax then runs over that head's first M_h / 2 columns only.
    """

    def __init__(self, *, seed: int = 0, **shape) -> None:
        odd = [d for d in ([shape["feature_dim"]] + list(shape.get("head_feature_dims") or [])) if int(d) % 2]
        if odd:
            raise DoflaError(
                f"hedgehog features come in (softmax, softmax of the negation) pairs, so feature dimensions must "
                f"be even; got {odd[0]}; use an even number."
            )
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        generator = torch.Generator().manual_seed(int(seed))
        self.weight = nn.Parameter(
            identity_like(
                self.num_heads, self.head_dim, self.feature_dim // 2, generator, self.head_dim**-0.5
            )
        )
        self._kept_signed_weight = DerivedTensor()  # see signed_weight

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, None]:
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        projection = torch.einsum(
            "bhgtd,hdf->bhgtf", grouped, self.weight.to(grouped.dtype)
        )  # (B, Hm, G, T, F/2)
        half_mask = self.feature_mask[:, 0::2][None, :, None, None, :]  # (1, Hm, 1, 1, F/2)
        positive = torch.softmax(projection.masked_fill(~half_mask, float("-inf")), dim=-1)
        negative = torch.softmax((-projection).masked_fill(~half_mask, float("-inf")), dim=-1)
        features = torch.stack([positive, negative], dim=-1)  # (B, Hm, G, T, F/2, 2): interleaved
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None

    def decode_features(self, x: Tensor) -> tuple[Tensor, None]:
        """``forward`` in three operators: one product with the interleaved columns (W_f, -W_f) and one
        softmax over the (F/2, 2) pairs' first axis (maps with head-wise dimensions run ``forward``)."""
        if self.has_headwise_dims:
            return self.forward(x, is_query=False)
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        projection = grouped_product(grouped, self.signed_weight(grouped.dtype))  # (..., N, F)
        features = torch.softmax(projection.unflatten(-1, (-1, 2)), dim=-2)  # (..., F/2, 2)
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None

    def signed_weight(self, dtype: torch.dtype) -> Tensor:
        """(Hm, D, F): W's columns interleaved with their negations; kept between calls without autograd
        until the weight changes (an optimiser step, a load)."""

        def build() -> Tensor:
            weight = self.weight.to(dtype)
            return torch.stack([weight, -weight], dim=-1).flatten(-2)  # (Hm, D, F)

        return self._kept_signed_weight.get([self.weight], build, dtype)


@register_feature_map("t2r")
class ReluFeatures(FeatureMap):
    """T2R: phi(x) = ReLU(x W + b), W (num_heads, D, F) ~ N(0, 1/D), b = 0, both trainable."""

    def __init__(self, *, seed: int = 0, **shape) -> None:
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        generator = torch.Generator().manual_seed(int(seed))
        self.weight = nn.Parameter(
            torch.randn(self.num_heads, self.head_dim, self.feature_dim, generator=generator)
            * self.head_dim**-0.5
        )
        self.bias = nn.Parameter(torch.zeros(self.num_heads, self.feature_dim))

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, None]:
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        projection = (
            torch.einsum("bhgtd,hdf->bhgtf", grouped, self.weight.to(grouped.dtype))
            + self.bias.to(grouped.dtype)[None, :, None, None, :]
        )
        features = self.masked(F.relu(projection))
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None


@register_feature_map("projection")
class ProjectionFeatures(FeatureMap):
    """phi(x) = x W, signed, W (num_heads, D, F) trainable, initialised to the rectangular identity.

    Not a kernel feature map (features can be negative): it serves cells whose state is an associative
    memory rather than a normalised sum, such as the gated delta rule, as learned keys and queries of any
    dimension F (so an allocated per-layer dimension still applies). With F <= D it starts as the teacher's
    own q and k (their first F coordinates). Columns beyond D start small and random
    (:meth:`extra_columns`): at 0 they would stay 0, since in the gated delta rule a feature that is 0 in
    every key and query gets no gradient. Being linear in x, the features span at most D directions; columns
    beyond D add directions only after a per-channel operation such as the delta cell's ``short_conv``.
    """

    nonnegative = False
    extra_column_scale = 0.1  # columns beyond the head size, against the identity's unit columns

    def __init__(self, *, seed: int = 0, **shape) -> None:
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        weight = torch.eye(self.head_dim, self.feature_dim).expand(self.num_heads, -1, -1).clone()
        if self.feature_dim > self.head_dim:
            weight[..., self.head_dim :] = self.extra_columns(torch.Generator().manual_seed(int(seed)))
        self.weight = nn.Parameter(weight)  # (Hm, D, F)

    def extra_columns(self, generator: torch.Generator) -> Tensor:
        """The starting columns beyond the head size (Hm, D, F - D): N(0, 1/D), scaled by ``extra_column_scale``."""
        shape = (self.num_heads, self.head_dim, self.feature_dim - self.head_dim)
        return torch.randn(shape, generator=generator) * self.extra_column_scale * self.head_dim**-0.5

    def activation(self, projection: Tensor) -> Tensor:
        """The map applied to x W (B, Hm, G, T, F); the identity here."""
        return projection

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, None]:
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        projection = torch.einsum("bhgtd,hdf->bhgtf", grouped, self.weight.to(grouped.dtype))
        features = self.masked(self.activation(projection))
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None

    def decode_features(self, x: Tensor) -> tuple[Tensor, None]:
        """``forward`` as one batched product (maps with head-wise dimensions run ``forward``)."""
        if self.has_headwise_dims:
            return self.forward(x, is_query=False)
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        features = self.activation(grouped_product(grouped, self.weight.to(grouped.dtype)))  # (.., N, F)
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None


@register_feature_map("elu1")
class EluPlusOneFeatures(ProjectionFeatures):
    """phi(x) = elu(x W) + 1 with a trainable W (num_heads, D, F) initialised to the rectangular identity.

    With F == D this starts as the classic elu(x) + 1 of Katharopoulos et al.; extra columns start at 0
    (constant feature 1, which learns: elu's slope at 0 is 1), missing ones drop coordinates.
    """

    nonnegative = True

    def extra_columns(self, generator: torch.Generator) -> Tensor:
        return torch.zeros(self.num_heads, self.head_dim, self.feature_dim - self.head_dim)

    def activation(self, projection: Tensor) -> Tensor:
        return F.elu(projection) + 1


def dct_matrix(size: int) -> Tensor:
    """(size, size) orthonormal DCT-II matrix C: C @ x is the DCT of x, C @ C.T = I."""
    frequency = torch.arange(size, dtype=torch.float64)[:, None]
    position = torch.arange(size, dtype=torch.float64)[None, :]
    matrix = torch.cos(torch.pi * (position + 0.5) * frequency / size) * (2.0 / size) ** 0.5
    matrix[0] /= 2**0.5
    return matrix


@register_feature_map("dijiang")
class DiJiangFeatures(FeatureMap):
    """DiJiang (frequency domain): phi(x) = exp(log_weight) * softmax(t * DCT(x)) over F features.

    Feature f reads DCT coefficient f mod D scaled by t_f = Phi^-1((f + 1/2) / F) (quasi-Monte Carlo
    Gaussian points, permuted by ``seed``); the DCT and t are fixed, the per-feature weights
    ``log_weight`` (0 at start) train. This follows the authors' code (softmax of x projected by
    DCT times a diagonal of inverse-normal points), without its separate position decay.
    """

    def __init__(self, *, seed: int = 0, **shape) -> None:
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        generator = torch.Generator().manual_seed(int(seed))
        points = (torch.arange(self.feature_dim, dtype=torch.float64) + 0.5) / self.feature_dim
        gaussian_points = torch.distributions.Normal(0.0, 1.0).icdf(points)  # (F,)
        projections = []
        for _ in range(self.num_heads):
            scale = gaussian_points[torch.randperm(self.feature_dim, generator=generator)]
            columns = torch.arange(self.feature_dim) % self.head_dim
            projections.append(dct_matrix(self.head_dim).T[:, columns] * scale[None, :])  # (D, F)
        self.register_buffer("projection", torch.stack(projections).float())  # (self.num_heads, D, F)
        self.log_weight = nn.Parameter(torch.zeros(self.num_heads, self.feature_dim))

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, None]:
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        logits = torch.einsum(
            "bhgtd,hdf->bhgtf", grouped, self.projection.to(grouped.dtype)
        )  # (B, Hm, G, T, F)
        if self.has_headwise_dims:
            logits = logits.masked_fill(~self.feature_mask[None, :, None, None, :], float("-inf"))
        features = (
            torch.softmax(logits, dim=-1) * self.log_weight.to(grouped.dtype).exp()[None, :, None, None, :]
        )
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None
