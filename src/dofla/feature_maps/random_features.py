"""Positive random features (Performer / FAVOR+) for the softmax kernel, fixed and learnable (DoF paper).

For K(x, y) = exp(scaling * x.y) and directions w_m ~ N(0, I_D):
    phi_m(x) = exp(sqrt(scaling) * w_m.x - scaling * |x|^2 / 2) / sqrt(M)
gives E[phi(x).phi(y)] = K(x, y) exactly (unbiased). Directions are drawn in orthogonal blocks of D (each
row still N(0, I) marginally, with lower variance). Everything is computed in log space in float32:
queries subtract their per-token maximum log-feature (a per-query factor cancels in the normalisation);
keys subtract it too and return it as ``log_scale``, which the ops apply exactly with a running maximum.
So no exponent is ever positive, whatever the norm of x or the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dofla.derived import DerivedTensor
from dofla.feature_maps.base import FeatureMap, register_feature_map


def orthogonal_gaussian_directions(num_heads: int, head_dim: int, num_features: int, generator) -> Tensor:
    """(num_heads, D, M) directions: orthogonal blocks of D rows, each row rescaled to a Gaussian norm."""
    heads = []
    for _ in range(num_heads):
        blocks = []
        for _ in range(-(-num_features // head_dim)):
            gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
            orthonormal, triangular = torch.linalg.qr(gaussian)  # columns orthonormal
            # Signs of R's diagonal fixed to +, so Q is uniformly (Haar) distributed and the features unbiased.
            orthonormal = orthonormal * torch.sign(torch.diagonal(triangular))[None, :]
            blocks.append(orthonormal.T)  # rows orthonormal
        rows = torch.cat(blocks, dim=0)[:num_features]  # (M, D)
        norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=-1)
        heads.append((rows * norms[:, None]).T)  # (D, M)
    return torch.stack(heads).float()


class _PositiveRandomFeatures(FeatureMap):
    """Shared forward of ``prf`` and ``learnable_prf``; subclasses provide directions and log weights."""

    def __init__(self, **shape) -> None:
        super().__init__(**shape)
        self._log_counts: dict = {}  # (dtype, device) -> log(M_h), (num_heads,): built once, not per call
        self._kept_fused_weights = DerivedTensor()  # see _fused_weights

    def directions(self) -> Tensor:  # (num_heads, D, F)
        raise NotImplementedError

    def log_feature_counts(self, like: Tensor) -> Tensor:
        """log(M_h) per map head, (num_heads,) in ``like``'s dtype and device."""
        key = (like.dtype, like.device)
        if key not in self._log_counts:
            counts = torch.tensor(self.head_feature_dims, dtype=like.dtype, device=like.device)
            self._log_counts[key] = torch.log(counts)
        return self._log_counts[key]

    def log_feature_weights(self) -> Tensor | None:  # (num_heads, F) added to the log-features, or None
        return None

    def _fused_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """sqrt(scaling) * directions (Hm, D, F) and the log-features' bias (Hm, 1, F): -log(M_h) / 2, plus
        log(alpha) / 2, and -inf for the features a head does not have. Kept between calls while the
        parameters are unchanged (their version counters) and no gradient is asked for."""
        directions, log_weights = self.directions(), self.log_feature_weights()
        parameters = [directions] if log_weights is None else [directions, log_weights]

        def build() -> tuple[Tensor, Tensor]:
            weight = math.sqrt(self.scaling) * directions.to(dtype)
            bias = (-0.5 * self.log_feature_counts(weight))[:, None].expand(self.num_heads, self.feature_dim)
            if log_weights is not None:
                bias = bias + 0.5 * log_weights.to(dtype)
            if self.has_headwise_dims:
                bias = bias.masked_fill(~self.feature_mask, float("-inf"))
            return weight, bias[:, None, :].contiguous()  # (Hm, D, F), (Hm, 1, F)

        return self._kept_fused_weights.get(parameters, build, dtype)

    def forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor | None]:
        """``reference_forward`` regrouped into fewer passes over the (T, F) features: the squared norm is
        the same for all of a token's features, so it cancels in phi and enters only the keys' log scale;
        scaling, 1/M_h, alpha and the head-wise mask are folded into one weight and one bias, so the
        log-features are one batched product (with its bias for a batch of one)."""
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        batch, heads, group, length, dim = grouped.shape
        weight, bias = self._fused_weights(grouped.dtype)  # (Hm, D, F), (Hm, 1, F)
        if batch == 1:  # (Hm, N, D) rows: one product with its bias
            rows = grouped.reshape(heads, group * length, dim)
            log_features = torch.baddbmm(bias, rows, weight)  # (Hm, N, F)
        else:
            rows = grouped.reshape(batch, heads, group * length, dim)  # (B, Hm, N, D)
            log_features = torch.matmul(rows, weight) + bias  # (B, Hm, N, F)
        token_max = log_features.amax(-1, keepdim=True)  # (B, Hm, N, 1) or (Hm, N, 1)
        if torch.is_grad_enabled() and log_features.requires_grad:  # amax keeps its input for backward
            features = torch.exp(log_features - token_max)
        else:
            features = log_features.sub_(token_max).exp_()
        shape = x.shape[:3]
        features = features.view(shape + (self.feature_dim,))
        if features.dtype != x.dtype:
            features = features.to(x.dtype)
        if is_query:
            return features, None
        squared_norm = torch.linalg.vecdot(rows, rows)
        log_scale = torch.sub(token_max.squeeze(-1), squared_norm, alpha=0.5 * self.scaling)
        # + 0 * |x|^2: NaN for a key whose squared norm overflows, as in the formula (not a silently absent
        # key); exactly the same value and gradient otherwise
        log_scale = log_scale + squared_norm * 0.0
        return features, log_scale.view(shape)

    def reference_forward(self, x: Tensor, *, is_query: bool) -> tuple[Tensor, Tensor | None]:
        """The formula as written (the module docstring's), one operation per term: what ``forward`` must
        equal up to rounding, in its outputs and gradients."""
        grouped = self.grouped_input(x)  # (B, Hm, G, T, D)
        projection = torch.einsum(
            "bhgtd,hdf->bhgtf", grouped, self.directions().to(grouped.dtype)
        )  # (B, Hm, G, T, F)
        squared_norm = grouped.square().sum(-1, keepdim=True)  # (B, Hm, G, T, 1)
        log_features = (
            math.sqrt(self.scaling) * projection
            - 0.5 * self.scaling * squared_norm
            - 0.5 * self.log_feature_counts(grouped)[None, :, None, None, None]  # 1/M_h normalisation
        )
        log_weights = self.log_feature_weights()
        if log_weights is not None:  # K_hat = sum_m alpha_m phi_m phi_m: sqrt(alpha_m) on each side
            log_features = log_features + 0.5 * log_weights.to(grouped.dtype)[None, :, None, None, :]
        if self.has_headwise_dims:
            log_features = log_features.masked_fill(~self.feature_mask[None, :, None, None, :], float("-inf"))
        # Per-token maximum, kept differentiable: phi * exp(log_scale) = exp(log_features) has its exact gradient
        # (the two paths through token_max cancel), and where the normalisation does not cancel (the hybrid's
        # linear part) the gradient is still that of the function computed.
        token_max = log_features.amax(-1, keepdim=True)  # (B, Hm, G, T, 1)
        features = torch.exp(log_features - token_max).reshape(x.shape[:3] + (self.feature_dim,))
        if is_query:
            return features.to(x.dtype), None
        return features.to(x.dtype), token_max.reshape(x.shape[:3])


@register_feature_map("prf")
class PositiveRandomFeatures(_PositiveRandomFeatures):
    """Fixed positive random features (Performer); ``seed`` fixes the draw, ``redraw()`` makes a new one."""

    def __init__(self, *, seed: int = 0, **shape) -> None:
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        self.seed = int(seed)
        generator = torch.Generator().manual_seed(self.seed)
        self.register_buffer(
            "random_directions",
            orthogonal_gaussian_directions(self.num_heads, self.head_dim, self.feature_dim, generator),
        )

    def directions(self) -> Tensor:
        return self.random_directions

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> None:
        """Draw new directions (from ``seed``, or from torch's global generator when None)."""
        generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        fresh = orthogonal_gaussian_directions(self.num_heads, self.head_dim, self.feature_dim, generator)
        self.random_directions.copy_(fresh.to(self.random_directions.device))


@register_feature_map("learnable_prf")
class LearnablePositiveRandomFeatures(_PositiveRandomFeatures):
    """DoF paper's learned features: trainable directions z and per-feature weights alpha = exp(log_alpha).

    At initialisation z is the ``prf`` draw of the same seed and alpha = 1, so the map equals ``prf``.
    Learning rates (the paper's): ``z_lr`` = 0.02 for z, ``alpha_lr`` = 0.2 for log_alpha.
    """

    def __init__(self, *, seed: int = 0, z_lr: float = 0.02, alpha_lr: float = 0.2, **shape) -> None:
        super().__init__(**shape)  # num_heads, head_dim, feature_dim, scaling, head_feature_dims
        self.seed, self.z_lr, self.alpha_lr = int(seed), float(z_lr), float(alpha_lr)
        generator = torch.Generator().manual_seed(self.seed)
        self.z = nn.Parameter(
            orthogonal_gaussian_directions(self.num_heads, self.head_dim, self.feature_dim, generator)
        )
        self.log_alpha = nn.Parameter(torch.zeros(self.num_heads, self.feature_dim))

    def directions(self) -> Tensor:
        return self.z

    def log_feature_weights(self) -> Tensor:
        return self.log_alpha

    def parameter_groups(self, base_lr: float) -> list[dict]:
        """z at ``z_lr`` and log_alpha at ``alpha_lr`` (the map's own rates; ``base_lr`` is not used)."""
        return [
            {"params": [self.z], "lr": self.z_lr, "name": "z"},
            {"params": [self.log_alpha], "lr": self.alpha_lr, "name": "alpha"},
        ]
