"""The architecture table: one adapter per supported family, built from a model or its config.

All per-family knowledge lives in :data:`FAMILIES`: where a family keeps its decoder layers and their
attention modules, the projections LoRA adapts, the keyword its attention takes the cache under (GPT-NeoX
says ``layer_past``) and where it keeps its logit soft-capping. An adapter reads the shape facts dofla
needs (heads, key/value heads, head size, scaling, rotary, sliding windows) from the config. The attention
computation itself is never re-implemented: dofla hooks the attention interface (``dofla.dispatch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from dofla.errors import DoflaError


@dataclass(frozen=True)
class Family:
    """What dofla needs to know about one model family.

    layers_path: the decoder-layer list from the model's root; attention_attribute: the attention module
    inside each decoder layer; lora_targets: the attention's projection modules (q/k/v/o or fused) by name
    suffix; cache_argument: the keyword the attention forward takes its cache under; softcap_attribute:
    the attention module's logit soft-capping attribute (None where the family has none); needs_bos: the
    family's models read every sequence from a beginning-of-sequence token (Gemma's do: without it every
    figure is off), so every row dofla packs starts with one.
    """

    name: str
    layers_path: str
    attention_attribute: str
    uses_rotary: bool
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    cache_argument: str = "past_key_values"
    softcap_attribute: str | None = None
    needs_bos: bool = False


_GEMMA = dict(softcap_attribute="attn_logit_softcapping", needs_bos=True)
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "model.layers", "self_attn", True),
    "qwen2": Family("Qwen2", "model.layers", "self_attn", True),
    "qwen3": Family("Qwen3", "model.layers", "self_attn", True),
    "mistral": Family("Mistral", "model.layers", "self_attn", True),
    "gemma2": Family("Gemma 2", "model.layers", "self_attn", True, **_GEMMA),
    "gemma3_text": Family("Gemma 3 (text)", "model.layers", "self_attn", True, **_GEMMA),
    "gpt2": Family("GPT-2", "transformer.h", "attn", False, lora_targets=("c_attn", "c_proj")),
    "gpt_neox": Family(
        "GPT-NeoX / Pythia",
        "gpt_neox.layers",
        "attention",
        True,
        lora_targets=("query_key_value", "dense"),
        cache_argument="layer_past",
    ),
}
"""model_type -> family. Gemma 3 is supported through its text-only causal LM (``gemma3_text``)."""

CACHE_ARGUMENTS: tuple[str, ...] = tuple(dict.fromkeys(family.cache_argument for family in FAMILIES.values()))
"""Every keyword a supported family's attention takes its cache under."""


OUTPUT_PROJECTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(family.lora_targets[-1] for family in FAMILIES.values())
)
"""The name of the attention module's output projection in every supported family (the last LoRA target)."""


def output_projection(attention: nn.Module) -> nn.Module:
    """The output projection of a supported family's attention module (``o_proj``, ``c_proj``, ``dense``)."""
    for name in OUTPUT_PROJECTIONS:
        found = getattr(attention, name, None)
        if isinstance(found, nn.Module):
            return found
    raise DoflaError(
        f"{type(attention).__name__} has none of the output projections {', '.join(OUTPUT_PROJECTIONS)}; "
        "use the output_mse loss, which compares the outputs before it."
    )


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

    def decoder_layer_list(self, model: nn.Module) -> nn.ModuleList:
        """The model's own list of decoder layers, to swap entries in (model surgery)."""
        self.decoder_layers(model)  # a clear error where the path is missing
        layers = model.get_submodule(self.family.layers_path)
        if not isinstance(layers, nn.ModuleList):
            raise DoflaError(
                f"`{self.family.layers_path}` of this {self.family.name} model is a {type(layers).__name__}, "
                "not a list of decoder layers; load the model as a causal language model (AutoModelForCausalLM)."
            )
        return layers

    def attention_softcap(self, module: nn.Module) -> float | None:
        """The logit soft-capping of one attention module (Gemma 2 and 3 keep it on the module), or None."""
        if self.family.softcap_attribute is None:
            return None
        return getattr(module, self.family.softcap_attribute, None)

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

    def windowed_layers(self) -> list[int]:
        """The layers whose own attention sees only the last ``sliding_window`` keys: a bounded cache."""
        return [index for index, kind in enumerate(self.layer_kinds) if kind == "sliding"]

    def layers_to_convert(self, layers=None, *, convert_windowed: bool = False) -> list[int]:
        """The layers a plan converts: ``layers`` where given, else every layer whose cache grows with the
        context (full attention), or every layer with ``convert_windowed``. The teacher's own sliding-window
        layers already keep a bounded cache, so by default they stay as they are. A teacher with nothing
        to convert gets a DoflaError."""
        if layers is not None:
            return sorted({int(index) for index in layers})
        if convert_windowed:
            return list(range(self.num_layers))
        growing = [index for index, kind in enumerate(self.layer_kinds) if kind != "sliding"]
        if not growing:
            raise DoflaError(
                f"every layer of this {self.family.name} teacher already attends to a sliding window of "
                f"{self.sliding_window} tokens (a bounded cache), so there is nothing to convert; pass "
                "--convert-windowed (convert_windowed=True) to convert them all, or --layers to choose some."
            )
        return growing

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


def _default_scalings(config, head_dim: int, num_layers: int) -> list[float]:
    """The logit scale per layer from the config's own settings (Gemma's query_pre_attn_scalar, GPT-2's
    scale_attn_weights and scale_attn_by_inverse_layer_idx; other families have none of them)."""
    if getattr(config, "query_pre_attn_scalar", None):
        base = float(config.query_pre_attn_scalar) ** -0.5
    elif not getattr(config, "scale_attn_weights", True):
        base = 1.0
    else:
        base = head_dim**-0.5
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
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
        default_scalings=_default_scalings(config, head_dim, num_layers),
    )
