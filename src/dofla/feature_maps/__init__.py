"""Feature maps phi for linear attention, all built by name from one registry.

``prf`` / ``learnable_prf`` (positive random features, DoF paper), ``hedgehog`` (LoLCATs),
``t2r`` and ``elu1`` (cheap baselines), ``dijiang`` (DCT frequency-domain features), ``taylor`` (Based's
second-order Taylor expansion of exp: signed features, positive kernel); ``projection`` (signed learned
keys, for the gated delta rule cell only). See docs/feature_maps.md for the formulas.
"""

from dofla.feature_maps.base import FEATURE_MAPS, FeatureMap, build_feature_map, register_feature_map
from dofla.feature_maps.learned import (
    DiJiangFeatures,
    EluPlusOneFeatures,
    HedgehogFeatures,
    ProjectionFeatures,
    ReluFeatures,
)
from dofla.feature_maps.random_features import (
    LearnablePositiveRandomFeatures,
    PositiveRandomFeatures,
    orthogonal_gaussian_directions,
)
from dofla.feature_maps.taylor import TaylorFeatures

__all__ = [
    "FEATURE_MAPS",
    "DiJiangFeatures",
    "EluPlusOneFeatures",
    "FeatureMap",
    "HedgehogFeatures",
    "LearnablePositiveRandomFeatures",
    "PositiveRandomFeatures",
    "ProjectionFeatures",
    "ReluFeatures",
    "TaylorFeatures",
    "build_feature_map",
    "orthogonal_gaussian_directions",
    "register_feature_map",
]
