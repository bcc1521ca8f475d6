"""Converted folders open with ``AutoModelForCausalLM.from_pretrained`` (no ``trust_remote_code``).

``import dofla`` registers :class:`DoflaConfig` (``model_type`` ``"dofla"``) with ``AutoConfig`` and
:class:`DoflaForCausalLM` with ``AutoModelForCausalLM``. A converted folder's ``config.json`` is a
``DoflaConfig``: the teacher's config (``base_config``) and the conversion plan (``plan``). Opening it runs
:func:`dofla.loading.load_converted` (strict keys, teacher fingerprint) and returns the converted model: an
instance of the teacher's own class (e.g. ``LlamaForCausalLM``) whose class gains :class:`dofla.saving.ConvertedModel`,
so ``generate()`` works unchanged and ``save_pretrained`` writes a converted folder again.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from dofla._registration import MODEL_TYPE
from dofla.errors import DoflaError

# from_pretrained keyword arguments that do not change how a local converted folder is read; a value that
# is None, False or "" is accepted for any other argument (lm-eval passes gguf_file=None and the like).
_IGNORED_ARGUMENTS = frozenset(
    {
        "revision",
        "code_revision",
        "_commit_hash",
        "trust_remote_code",  # never used: dofla runs no remote code
        "cache_dir",
        "force_download",
        "proxies",
        "local_files_only",
        "token",
        "low_cpu_mem_usage",
        "adapter_kwargs",  # transformers fills it in (the revision) for every folder
        "_from_auto",
    }
)


class DoflaConfig(PreTrainedConfig):
    """A converted model's config: the teacher's config as a dict (``base_config``) and the plan (``plan``)."""

    model_type = MODEL_TYPE

    def __init__(self, base_config: dict | None = None, plan: dict | None = None, **kwargs):
        self.base_config = dict(base_config or {})
        self.plan = dict(plan or {})
        super().__init__(**kwargs)

    def teacher_config(self) -> PreTrainedConfig:
        """The teacher's config, as its own config class (``LlamaConfig``...)."""
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = self.base_config.get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise DoflaError(
                f"the converted model's base config has model_type {model_type!r}, which this transformers does "
                "not know; the folder's config.json is damaged: save the model again."
            )
        return CONFIG_MAPPING[model_type].from_dict(self.base_config)


def _dtype(value) -> torch.dtype | None:
    """None for 'auto' or None (each tensor keeps its stored dtype), else a torch dtype."""
    if value is None or value == "auto":
        return None
    from dofla.models.loading import resolve_dtype

    if not isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    return resolve_dtype(value, torch.device("cpu"))


def _device(device_map) -> str | None:
    """A single device from transformers' ``device_map`` forms (a name, an index, ``{"": device}``, 'auto')."""
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise DoflaError(
                "a converted dofla model loads onto one device; pass device_map='cpu', 'cuda:0' or {'': device}, "
                f"not {device_map!r}."
            )
        device_map = device_map[""]
    if device_map == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, int):
        return f"cuda:{device_map}"
    return str(device_map)


class DoflaForCausalLM(PreTrainedModel):
    """The ``AutoModelForCausalLM`` entry for ``model_type`` "dofla": never instantiated itself.

    ``from_pretrained(folder)`` returns :func:`dofla.loading.load_converted`'s model; ``_from_config``
    (``AutoModelForCausalLM.from_config``) builds the teacher's architecture from the config with fresh
    weights and converts it with the config's plan.
    """

    config_class = DoflaConfig

    def __init__(self, *args, **kwargs):
        raise DoflaError(
            "DoflaForCausalLM is not built directly; use AutoModelForCausalLM.from_pretrained(folder) or "
            "AutoModelForCausalLM.from_config(DoflaConfig) after `import dofla`."
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        from dofla.loading import load_converted

        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            raise DoflaError(
                f"{pretrained_model_name_or_path} is not a local folder; converted dofla models load from the "
                "folder `dofla convert` or `dofla linearize` wrote."
            )
        if model_args:
            raise DoflaError("a converted dofla model takes no positional arguments besides its folder.")
        dtype = _dtype(kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None))
        device = _device(kwargs.pop("device_map", None))
        teacher = kwargs.pop("teacher", None)
        attn_implementation = kwargs.pop("attn_implementation", None)
        refused = sorted(
            name
            for name, value in kwargs.items()
            if name not in _IGNORED_ARGUMENTS and value not in (None, False, "", {})
        )
        if refused:
            raise DoflaError(
                f"a converted dofla model cannot be loaded with {', '.join(refused)}; load it without "
                "(dtype, device_map and attn_implementation are supported)."
            )
        model, _, _ = load_converted(path, teacher=teacher, dtype=dtype, device=device)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        return model

    @classmethod
    def _from_config(cls, config: DoflaConfig, **kwargs):
        from dofla.config import ConversionPlan
        from dofla.convert import convert

        dtype = _dtype(kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None))
        model = AutoModelForCausalLM.from_config(config.teacher_config(), trust_remote_code=False, **kwargs)
        convert(model, ConversionPlan.from_dict(config.plan))
        return model.to(dtype) if dtype is not None else model


def register() -> None:
    """Register the "dofla" model type with transformers' auto classes (done by ``import dofla``)."""
    AutoConfig.register(MODEL_TYPE, DoflaConfig, exist_ok=True)
    AutoModelForCausalLM.register(DoflaConfig, DoflaForCausalLM, exist_ok=True)


register()
