"""``taylor``: second-order Taylor features of exp (the feature map of Based, Arora et al. 2024).

phi(x) = [1, y, vec(y y^T) / sqrt(2)] with y = sqrt(scaling) x W, so that

    phi(q) . phi(k) = 1 + s + s^2 / 2,    s = scaling (q W) . (k W),

the expansion of exp(s) to second order: positive for every s (its minimum is 1/2), so normalised linear
attention can use it although the features are signed, and it grows with s like a softmax weight's
expansion, which is what lets a linear memory pick out a matching key among many (recall). W (num_heads, D,
r) is trainable, drawn N(0, 1/r) per entry (so (q W) . (k W) is q . k on average: the map starts as the
expansion of the teacher's own logits).

With F features a head uses the largest r with 1 + r + r^2 <= F; the rest are 0. Features are ordered by
level: after the constant, level m holds y_m and the products y_i y_j with max(i, j) = m (2m + 2 entries),
so the first 1 + r + r^2 features are exactly those of r projections, and a head with fewer features (a
head-wise plan) is the same map with a smaller r.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dofla.errors import DoflaError
from dofla.feature_maps.base import FeatureMap, register_feature_map


def taylor_rank(features: int) -> int:
    """The largest r with 1 + r + r^2 <= features (0 for fewer than 3 features)."""
    rank = int(math.isqrt(max(int(features) - 1, 0)))
    while rank > 0 and 1 + rank + rank * rank > features:
        rank -= 1
    return rank


def level_order(rank: int) -> Tensor:
    """Positions in [1, y (r), vec(y y^T) (r^2, row-major)] of the level-ordered features (1 + r + r^2)."""
    order = [0]
    for level in range(rank):
        order.append(1 + level)  # y_m
        products = [(i, level) for i in range(level)] + [(level, j) for j in range(level + 1)]
        order.extend(1 + rank + i * rank + j for i, j in products)
    return torch.tensor(order, dtype=torch.long)


@register_feature_map("taylor")
class TaylorFeatures(FeatureMap):
    """phi(x) = [1, y, vec(y y^T) / sqrt(2)], y = sqrt(scaling) x W (see the module docstring); signed
    features with a positive kernel, so every cell takes it."""

    nonnegative = False
    positive_kernel = True

    def __init__(self, *, seed: int = 0, **shape) -> None:
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        self.rank = taylor_rank(self.feature_dim)
        if self.rank < 1:
            raise DoflaError(
                f"taylor features need at least 3 features (1 + r + r^2 for r projections), got "
                f"{self.feature_dim}; use a larger feature dimension (e.g. 57, 111, 241 for r = 7, 10, 15)."
            )
        ranks = [taylor_rank(dims) for dims in self.head_feature_dims]
        if min(ranks) < 1:
            raise DoflaError(
                f"taylor features need at least 3 features per head, got head dimensions "
                f"{self.head_feature_dims}; give every head 3 or more."
            )
        generator = torch.Generator().manual_seed(int(seed))
        self.weight = nn.Parameter(
            torch.randn(self.num_heads, self.head_dim, self.rank, generator=generator) / math.sqrt(self.rank)
        )
        # (num_heads, r): True for the projections a head uses; derived from the config, so not saved
        self.register_buffer(
            "rank_mask", torch.arange(self.rank)[None, :] < torch.tensor(ranks)[:, None], persistent=False
        )
        self.register_buffer("order", level_order(self.rank), persistent=False)

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, None]:
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        weight = self.weight.to(grouped.dtype) * math.sqrt(self.scaling)
        y = torch.einsum("bhgtd,hdr->bhgtr", grouped, weight)  # (B, Hm, G, T, r)
        if self.has_headwise_dims:
            y = y * self.rank_mask[None, :, None, None, :].to(y.dtype)
        products = (y[..., :, None] * y[..., None, :]).flatten(-2) * 0.5**0.5  # (..., r^2)
        features = torch.cat([torch.ones_like(y[..., :1]), y, products], dim=-1)[..., self.order]
        padding = self.feature_dim - features.shape[-1]
        if padding:
            features = torch.nn.functional.pad(features, (0, padding))
        return features.reshape(x.shape[:3] + (self.feature_dim,)).to(x.dtype), None
