"""Configuration dataclasses: the conversion plan (what each layer becomes), saved as JSON with every run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dofla.errors import DoflaError

MAX_FEATURE_DIM = 8192  # features per head: far beyond any useful size, well below an out-of-memory crash


def check_feature_budget(budget: int) -> None:
    """--budget: a positive number of features per layer, at most :data:`MAX_FEATURE_DIM`."""
    if not 0 < budget <= MAX_FEATURE_DIM:
        raise DoflaError(
            f"--budget must be a positive number of features per layer, at most {MAX_FEATURE_DIM}; got {budget}."
        )


DEFAULT_WINDOW = 64  # tokens a hybrid layer's sliding window keeps, where nothing else says
LAYER_KINDS = ("softmax", "linear", "hybrid")
PLAN_VERSION = 1


@dataclass
class LayerPlan:
    """What one attention layer becomes.

    kind: "softmax" (left as is), "linear" or "hybrid" (sliding-window softmax + linear).
    feature_dim: features per head (for head-wise plans, the largest head's; smaller heads are masked).
    head_feature_dims: optional per-head dimensions; one entry per key/value head when
        ``share_kv_heads`` (one feature map per key/value group), else one per query head.
    share_kv_heads: query heads of a key/value group share one feature map and one state
        (state per key/value head); False gives each query head its own map and state.
    window: sliding-window size for "hybrid" layers.
    sinks: the first ``sinks`` tokens of a sequence stay visible to the window of "hybrid" layers
        (attention sinks) and never enter the linear part.
    cell: the student cell by name (:mod:`dofla.cells`): "linear" (LoLCATs: plain linear attention, with the
        window sharing one normalisation), "gla" (with forgetting), ... The plan is plain data: the name is
        checked where the student is built (:func:`dofla.cells.build_student`) and in the settings' validation.
    """

    kind: str = "linear"
    feature_map: str = "learnable_prf"
    feature_dim: int = 64
    head_feature_dims: list[int] | None = None
    share_kv_heads: bool = True
    window: int = DEFAULT_WINDOW
    options: dict[str, Any] = field(default_factory=dict)
    cell: str = "linear"
    sinks: int = 0

    def validate(self, layer_index: int, num_heads: int, num_kv_heads: int) -> None:
        where = f"layer {layer_index}"
        if self.kind not in LAYER_KINDS:
            raise DoflaError(f"{where}: unknown kind {self.kind!r}; use one of {', '.join(LAYER_KINDS)}.")
        if self.kind == "softmax":
            return
        sizes = dict(feature_dim=self.feature_dim, window=self.window, sinks=self.sinks)
        for name, value in [
            *sizes.items(),
            *(("head_feature_dims", v) for v in self.head_feature_dims or ()),
        ]:
            if not isinstance(value, int) or isinstance(value, bool):
                raise DoflaError(f"{where}: {name} must be a whole number, got {value!r}.")
        if self.feature_dim <= 0:
            raise DoflaError(f"{where}: feature dimension must be positive, got {self.feature_dim}.")
        if self.feature_dim > MAX_FEATURE_DIM:
            raise DoflaError(
                f"{where}: feature dimension {self.feature_dim} is above the most dofla builds, "
                f"{MAX_FEATURE_DIM} features per head; use a smaller one."
            )
        if self.head_feature_dims is not None:
            expected = num_kv_heads if self.share_kv_heads else num_heads
            if len(self.head_feature_dims) != expected:
                raise DoflaError(
                    f"{where}: {len(self.head_feature_dims)} head feature dimensions given, the model has "
                    f"{expected} {'key/value' if self.share_kv_heads else 'query'} heads there."
                )
            if min(self.head_feature_dims) <= 0:
                raise DoflaError(
                    f"{where}: every head needs at least one feature, got {self.head_feature_dims}."
                )
            if max(self.head_feature_dims) != self.feature_dim:
                raise DoflaError(
                    f"{where}: feature_dim {self.feature_dim} must equal the largest head dimension "
                    f"{max(self.head_feature_dims)}."
                )
        if self.kind == "hybrid" and int(self.window) <= 0:
            raise DoflaError(f"{where}: hybrid window must be positive, got {self.window}.")
        if int(self.sinks) < 0:
            raise DoflaError(f"{where}: the number of sink tokens must be 0 or more, got {self.sinks}.")
        if int(self.sinks) > 0 and self.kind != "hybrid":
            raise DoflaError(
                f"{where}: sink tokens belong to the sliding window; use kind hybrid or sinks 0 (got "
                f"{self.sinks} sinks for kind {self.kind})."
            )


@dataclass
class ConversionPlan:
    """Per-layer conversion plan for one teacher architecture.

    The architecture fields let a plan made for one model be refused on another.
    ``metadata`` records how the plan was made (allocation, budget, measure, lambda, ...).
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: list[LayerPlan]
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    # converted layers' memories read rotary positions modulo this many tokens (dofla.rotary); None: true
    position_period: int | None = None
    # hybrid layers' windows see their sinks from the window's edge (dofla.convert.set_sinks_at_edge)
    sinks_at_edge: bool = False

    def validate(self) -> None:
        from dofla.rotary import check_period

        check_period(self.position_period)
        if not isinstance(self.sinks_at_edge, bool):
            raise DoflaError(f"sinks_at_edge must be true or false, got {self.sinks_at_edge!r}.")
        if len(self.layers) != self.num_layers:
            raise DoflaError(
                f"the plan lists {len(self.layers)} layers but says the model has {self.num_layers}."
            )
        for index, layer in enumerate(self.layers):
            layer.validate(index, self.num_heads, self.num_kv_heads)

    def check_matches(
        self, model_type: str, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        """Refuse a plan made for a different architecture, naming the first difference."""
        ours = (self.model_type, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim)
        theirs = (model_type, num_layers, num_heads, num_kv_heads, head_dim)
        names = ("model type", "layers", "heads", "key/value heads", "head size")
        for name, planned, actual in zip(names, ours, theirs, strict=True):
            if planned != actual:
                raise DoflaError(
                    f"this plan was made for a different model: {name} is {planned} in the plan but {actual} "
                    "in the model; make a new plan for this model with `dofla dof`."
                )

    @property
    def converted_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind != "softmax"]

    @property
    def kept_windowed_layers(self) -> list[int]:
        """The teacher's own sliding-window layers the plan leaves as they are (a bounded cache already)."""
        windowed = self.metadata.get("teacher_windowed_layers") or []
        return [int(i) for i in windowed if self.layers[int(i)].kind == "softmax"]

    def layer_reasons(self) -> list[str]:
        """Per layer, what the plan does with it and why (reports and ``dofla info`` show it)."""
        windowed = {int(i) for i in self.metadata.get("teacher_windowed_layers") or []}
        own = f"the teacher's own sliding window of {self.metadata.get('teacher_window')} tokens"
        reasons = []
        for index, layer in enumerate(self.layers):
            if layer.kind != "softmax":
                reasons.append(f"converted ({own})" if index in windowed else "converted (full attention)")
            elif index in windowed:
                reasons.append(f"kept: {own}, a bounded cache")
            else:
                reasons.append("kept: full softmax")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConversionPlan:
        try:
            layers = [LayerPlan(**layer) for layer in data["layers"]]
            fields = {k: v for k, v in data.items() if k != "layers"}
            plan = cls(layers=layers, **fields)
        except (KeyError, TypeError) as error:
            raise DoflaError(f"this is not a dofla plan ({error}); make one with `dofla dof`.") from None
        if plan.version != PLAN_VERSION:
            raise DoflaError(
                f"plan version {plan.version} is not supported (this dofla reads {PLAN_VERSION})."
            )
        plan.validate()
        return plan

    def save(self, path: str | Path) -> None:
        from dofla.io import write_text_atomic

        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ConversionPlan:
        path = Path(path)
        if not path.is_file():
            raise DoflaError(f"plan file {path} does not exist.")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise DoflaError(f"plan file {path} is not valid JSON ({error}).") from None
        return cls.from_dict(data)
