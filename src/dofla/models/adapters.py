"""The architecture table: one adapter per supported family, built from a model or its config.

An adapter knows where a family keeps its attention modules and reads the shape facts dofla needs
(heads, key/value heads, head size, scaling, rotary, sliding windows) from the config. The attention
computation itself is never re-implemented: dofla hooks the attention interface (``dofla.dispatch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from dofla.errors import DoflaError


@dataclass(frozen=True)
class Family:
    """Where a family keeps its decoder layers and, inside each, its attention module."""

    name: str
    layers_path: str
    attention_attribute: str
    uses_rotary: bool


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "model.layers", "self_attn", True),
    "qwen2": Family("Qwen2", "model.layers", "self_attn", True),
    "qwen3": Family("Qwen3", "model.layers", "self_attn", True),
    "mistral": Family("Mistral", "model.layers", "self_attn", True),
    "gemma2": Family("Gemma 2", "model.layers", "self_attn", True),
    "gemma3_text": Family("Gemma 3 (text)", "model.layers", "self_attn", True),
    "gpt2": Family("GPT-2", "transformer.h", "attn", False),
    "gpt_neox": Family("GPT-NeoX / Pythia", "gpt_neox.layers", "attention", True),
}
"""model_type -> family. Gemma 3 is supported through its text-only causal LM (``gemma3_text``)."""


def supported_model_types() -> str:
    return ", ".join(f"{family.name} ({model_type})" for model_type, family in FAMILIES.items())


def _get_attribute_path(root: object, path: str) -> object:
    for name in path.split("."):
        root = getattr(root, name)
    return root


@dataclass
class ArchitectureAdapter:
    """Shape facts of one teacher, and where its attention modules are."""

    model_type: str
    family: Family
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    context_length: int | None
    rotary_fraction: float
    layer_kinds: list[str]
    sliding_window: int | None
    default_scalings: list[float] = field(repr=False)

    @property
    def uses_rotary(self) -> bool:
        return self.family.uses_rotary

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        try:
            return list(_get_attribute_path(model, self.family.layers_path))
        except AttributeError:
            raise DoflaError(
                f"this {self.family.name} model has no `{self.family.layers_path}`; load it as a causal language "
                "model (AutoModelForCausalLM)."
            ) from None

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The per-layer attention modules, in layer order."""
        return [getattr(layer, self.family.attention_attribute) for layer in self.decoder_layers(model)]

    def attention_scaling(self, layer_index: int, model: nn.Module | None = None) -> float:
        """The factor on q·k before the softmax (the module's own ``scaling`` where a model is given)."""
        if model is not None:
            module = self.attention_modules(model)[layer_index]
            if getattr(module, "scaling", None) is not None:
                return float(module.scaling)
        return self.default_scalings[layer_index]

    @staticmethod
    def parameter_count(model: nn.Module) -> int:
        """Distinct parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _layer_kinds(config, num_layers: int) -> tuple[list[str], int | None]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = ["sliding" if "sliding" in str(kind) else "full" for kind in layer_types]
    elif window and getattr(config, "use_sliding_window", True):
        kinds = ["sliding"] * num_layers
    else:
        kinds = ["full"] * num_layers
    return kinds, (int(window) if window and "sliding" in kinds else None)


def _rotary_fraction(config, family: Family) -> float:
    if not family.uses_rotary:
        return 0.0
    rope = getattr(config, "rope_parameters", None) or {}
    fraction = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    fraction = (
        fraction or getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None)
    )
    return float(fraction or 1.0)


def _default_scalings(config, model_type: str, head_dim: int, num_layers: int) -> list[float]:
    if model_type in ("gemma2", "gemma3_text") and getattr(config, "query_pre_attn_scalar", None):
        base = float(config.query_pre_attn_scalar) ** -0.5
    elif model_type == "gpt2" and not getattr(config, "scale_attn_weights", True):
        base = 1.0
    else:
        base = head_dim**-0.5
    if model_type == "gpt2" and getattr(config, "scale_attn_by_inverse_layer_idx", False):
        return [base / (index + 1) for index in range(num_layers)]
    return [base] * num_layers


def get_adapter(model_or_config) -> ArchitectureAdapter:
    """The adapter for a model (or a config); unsupported families get a DoflaError naming the supported ones."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    model_type = str(getattr(config, "model_type", "") or "")
    family = FAMILIES.get(model_type)
    if family is None:
        raise DoflaError(
            f"architecture {model_type or 'unknown'!r} is not supported; supported: {supported_model_types()}."
        )
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    kinds, window = _layer_kinds(config, num_layers)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return ArchitectureAdapter(
        model_type=model_type,
        family=family,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        hidden_size=int(config.hidden_size),
        context_length=int(context) if context else None,
        rotary_fraction=_rotary_fraction(config, family),
        layer_kinds=kinds,
        sliding_window=window,
        default_scalings=_default_scalings(config, model_type, head_dim, num_layers),
    )
