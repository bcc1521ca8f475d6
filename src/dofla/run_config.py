"""The configuration of a ``dofla linearize`` run: one section per stage, saved to and read from TOML.

:class:`LinearizeConfig` (the root) holds the run-level settings (``out_dir``, ``recipe``, ``seed``...) and
one dataclass per stage: ``teacher``, ``data``, ``plan``, ``student``, ``distill``, ``lora``, ``evaluate``.
Each field is declared with :func:`option`: its default, its help text and, where it differs from
``--field-name``, its command-line flag. ``dofla linearize`` generates its flags from these fields
(:mod:`dofla.commands._config_flags`) and checks ranges and registry names from them (:meth:`validate`),
so a new option is one field here plus the stage code that reads it.

Resolution, lowest first: the defaults, the recipe (a partial config by section,
:data:`dofla.recipes.RECIPES`), then the explicit settings (a config file, then command-line flags):
explicit settings always win. :meth:`LinearizeConfig.from_dict` resolves a nested dict,
:func:`load_config` a TOML file; :func:`save_config` writes the full resolved config, which every run
leaves in its folder (``config.toml``) and which loads back to the same config.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dofla.errors import DoflaError
from dofla.setting_values import Setting, flatten, merge, typed
from dofla.settings import (
    SECTIONS,
    SHARDINGS,
    DataSettings,
    DistillSettings,
    EvaluateSettings,
    LoraSettings,
    PlanSettings,
    StudentSettings,
    TeacherSettings,
    option,
)

CONFIG_FILE = "config.toml"  # the resolved config in a run folder


# The registries a setting's value is a name in, by the name its option gives (imported late: they pull in
# torch).
def _allocations():
    from dofla.dof import ALLOCATIONS

    return ALLOCATIONS


def _softmax_choices():
    from dofla.dof import SOFTMAX_CHOICES

    return SOFTMAX_CHOICES


def _measures():
    from dofla.dof import MEASURES

    return MEASURES


def _cells():
    from dofla.cells import CELLS

    return CELLS


def _feature_maps():
    from dofla.feature_maps import FEATURE_MAPS

    return FEATURE_MAPS


def _losses():
    from dofla.distill.losses import LOSSES

    return LOSSES


def _recipes():
    from dofla.recipes import RECIPES

    return RECIPES


REGISTRIES: dict[str, Callable[[], Mapping]] = dict(
    allocation=_allocations,
    softmax_choice=_softmax_choices,
    measure=_measures,
    cell=_cells,
    feature_map=_feature_maps,
    loss=_losses,
    recipe=_recipes,
    sharding=lambda: SHARDINGS,
)


# ------------------------------------------------------------------------------------------------ the root


@dataclass
class LinearizeConfig:
    """Every setting of ``dofla linearize`` (saved as the run's config.toml and in result.json).

    Build one with :meth:`from_dict` (or :func:`load_config`) so a recipe fills only what was not set;
    constructed directly, list the dotted names you set in ``overrides`` to keep a recipe off them.
    """

    out_dir: str = option(help="output folder (model/, report.md, checkpoints)", flag="--out")
    recipe: str | None = option(None, "preset recipe (see README)", choices="recipe")
    seed: int = option(0, "seed of sampling, splitting, initialisation and training")
    resume: bool = option(False, "continue an interrupted run in --out (command line only)", saved=False)
    overwrite: bool = option(
        False,
        "replace dofla's own earlier run (model, report, checkpoints) in --out (files dofla did not write are "
        "never touched; command line only: a config file never sets it)",
        saved=False,
    )
    progress: bool = option(True, "progress bars")
    command: str | None = option(None, "the command line recorded in the report", cli=False)
    teacher: TeacherSettings = field(default_factory=TeacherSettings)
    data: DataSettings = field(default_factory=DataSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)
    student: StudentSettings = field(default_factory=StudentSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    evaluate: EvaluateSettings = field(default_factory=EvaluateSettings)
    # dotted names set explicitly ("distill.tokens"): a recipe never changes them; not a setting itself
    overrides: list[str] = field(default_factory=list, compare=False, metadata=dict(config=False))

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any], source: str = "the settings") -> LinearizeConfig:
        """Defaults, then the recipe ``settings["recipe"]`` names, then ``settings`` (nested by section).

        Values are checked against the fields' types; an unknown key is refused naming the valid ones.
        ``source`` names where the settings came from in errors (e.g. the file).
        """
        values = checked_settings(settings, source)
        if values.get("out_dir") is None:
            raise DoflaError("no output folder: pass --out DIR or set out_dir at the top of the config file.")
        explicit = sorted(flatten(values))
        sections = {name: SECTIONS[name](**values.pop(name, {})) for name in SECTIONS}
        config = cls(**values, **sections, overrides=explicit)
        config.apply_recipe()
        return config

    def to_dict(self) -> dict[str, Any]:
        """Every setting of the run, nested by section (what config.toml and result.json hold); not what
        one invocation asked (``resume``, ``overwrite``)."""
        data = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in SECTIONS:
                data[item.name] = {sub.name: copy.deepcopy(getattr(value, sub.name)) for sub in fields(value)}
            elif item.metadata.get("config", True) and item.metadata.get("saved", True):
                data[item.name] = copy.deepcopy(value)
        return data

    def get(self, key: str) -> Any:
        """The value of a dotted name: ``config.get("distill.tokens")``."""
        owner, name = self._owner(key)
        return getattr(owner, name)

    def set(self, key: str, value: Any) -> None:
        owner, name = self._owner(key)
        setattr(owner, name, value)

    def _owner(self, key: str) -> tuple[Any, str]:
        section, _, name = key.rpartition(".")
        return (getattr(self, section) if section else self), name

    def apply_recipe(self) -> None:
        """Set the recipe's values, except those named in ``overrides`` (idempotent); a table of options
        set explicitly (``student.cell_options``) goes over the recipe's key by key, so
        ``--cell-options mix=adaptive`` keeps the recipe's other cell options."""
        if self.recipe is None:
            return
        recipe = checked_settings(_recipes()[self.recipe], f"recipe {self.recipe!r}")
        for key, value in flatten(recipe).items():
            if key not in self.overrides:
                self.set(key, copy.deepcopy(value))
            elif isinstance(value, dict) and isinstance(self.get(key), dict):
                self.set(key, {**copy.deepcopy(value), **self.get(key)})

    def validate(self) -> None:
        """Everything that can be checked before a model is loaded, in one sentence each."""
        from dofla.data import check_data_path
        from dofla.distill.curriculum import check_length_schedule
        from dofla.distill.losses import check_kernel_loss
        from dofla.models.loading import resolve_device, resolve_dtype

        for setting in settings_of(type(self)):
            check_setting(setting, self.get(setting.key))
        self.validate_plan()
        check_kernel_loss(self.distill.loss, self.student.cell, self.plan.sinks)
        check_length_schedule(self.distill.length_schedule, self.data.seq_len)
        check_data_path(self.data.path)
        check_data_path(self.data.heldout_path, "--heldout-data")
        if not 0 < self.data.heldout_fraction < 1:
            raise DoflaError(f"the held-out fraction must lie in (0, 1), got {self.data.heldout_fraction}.")
        if self.data.recall_fraction > 1:
            raise DoflaError(f"--recall-fraction must lie in [0, 1], got {self.data.recall_fraction}.")
        if self.lora.needle_fraction > 1:
            raise DoflaError(f"--lora-needles must lie in [0, 1], got {self.lora.needle_fraction}.")
        if (
            self.lora.needle_fraction > 0
            and not self.lora.enabled
            and "lora.needle_fraction" in self.overrides
        ):
            raise DoflaError("--lora-needles sets rows of the LoRA stage; add --lora or leave it at 0.")
        if self.distill.teacher_states is not None and self.data.recall_fraction > 0:
            raise DoflaError(
                "--teacher-states holds the rows as packed, without the repeated spans of --recall-fraction; "
                "drop one of the two."
            )
        device = resolve_device(self.teacher.device)
        resolve_dtype(self.teacher.dtype, device)
        if self.distill.cuda_graphs and device.type != "cuda":
            raise DoflaError(
                f"--cuda-graphs replays the training's layers from CUDA graphs, which needs a CUDA device, and "
                f"this run is on {device}; drop --cuda-graphs or pass --device cuda."
            )
        self.distill.validate()
        if self.lora.enabled:
            self.lora.validate()
        if self.distill.teacher_states is not None and self.distill.length_schedule:
            raise DoflaError(
                "--teacher-states holds the rows at --seq-len, which the shorter stages of --length-schedule "
                "do not train on; drop one of the two."
            )
        if self.distill.teacher_states is not None and self.distill.sharding != "layers":
            raise DoflaError(
                "--teacher-states starts each process's forward at its first layer, which only layer sharding "
                "has; add --sharding layers or drop --teacher-states."
            )
        if self.distill.sharding == "layers" and not _losses()[self.distill.loss].layerwise:
            raise DoflaError(
                f"--sharding layers trains each process's layers on their own, which the {self.distill.loss} "
                "loss (the whole model end to end) cannot; choose a layer-wise --loss or --sharding data."
            )
        if self.resume and self.overwrite:
            raise DoflaError(
                "--resume continues the run in --out and --overwrite discards it; pass only one."
            )
        step = self.distill.batch_size * self.data.seq_len
        if step > self.distill.tokens:  # else one step would train many times the tokens asked
            raise DoflaError(
                f"one step of --batch-size {self.distill.batch_size} x --seq-len {self.data.seq_len} is {step:,} "
                f"tokens, more than --tokens {self.distill.tokens:,}; lower --batch-size or raise --tokens."
            )

    def validate_plan(self) -> None:
        """The ``recipe``, ``plan`` and ``student`` settings (what ``dofla convert`` takes too), checked before
        a model is loaded, in one sentence each."""
        from dofla.cells.recall_cache import check_recall_cache_run
        from dofla.config import LayerPlan, check_feature_budget

        for setting in settings_of(type(self)):
            if setting.key == "recipe" or setting.key.partition(".")[0] in ("plan", "student"):
                check_setting(setting, self.get(setting.key))
        check_feature_budget(self.plan.budget)
        plan = LayerPlan(
            kind=self.plan.kind, window=self.plan.window, sinks=self.plan.sinks, cell=self.student.cell
        )
        plan.validate(0, 1, 1)
        if self.plan.sinks_at_edge and (self.plan.kind != "hybrid" or not self.plan.sinks):
            raise DoflaError(
                "--sinks-at-edge moves the sinks of hybrid layers' windows; give --kind hybrid with --sinks N "
                "(N > 0), or leave it off."
            )
        check_recall_cache_run(
            self.student.recall_cache,
            self.student.cell,
            self.plan.kind,
            self.student.cell_options,
            self.plan.position_period,
        )


# ------------------------------------------------------------------------------------ settings, one by one


def settings_of(cls: type = LinearizeConfig) -> list[Setting]:
    """Every setting of the tree, run-level ones first, then each section's in order."""
    found = []
    for item in fields(cls):
        if item.name in SECTIONS:
            hints = typing.get_type_hints(SECTIONS[item.name])
            found += [
                Setting(f"{item.name}.{sub.name}", sub, hints[sub.name])
                for sub in fields(SECTIONS[item.name])
            ]
        elif item.metadata.get("config", True):
            found.append(Setting(item.name, item, typing.get_type_hints(cls)[item.name]))
    return found


def checked_settings(settings: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``settings`` with each value checked against its field's type (ints may be given for floats, token
    counts as '2M'); an unknown section or key is refused with the valid ones."""
    by_key = {setting.key: setting for setting in settings_of()}
    top = [key for key in by_key if "." not in key]
    checked: dict[str, Any] = {}
    for key, value in settings.items():
        if key in SECTIONS:
            if not isinstance(value, Mapping):
                raise DoflaError(f"[{key}] in {source} must be a table of settings, got {value!r}.")
            valid = [name for name in by_key if name.startswith(f"{key}.")]
            for name in value:
                if f"{key}.{name}" not in by_key:
                    names = ", ".join(sorted(entry.split(".", 1)[1] for entry in valid))
                    raise DoflaError(f"unknown setting {name!r} in [{key}] of {source}; valid ones: {names}.")
            checked[key] = {name: typed(by_key[f"{key}.{name}"], item) for name, item in value.items()}
        elif key in top:
            checked[key] = typed(by_key[key], value)
        else:
            raise DoflaError(
                f"unknown setting {key!r} at the top of {source}; valid ones: {', '.join(sorted(top))} and the "
                f"sections {', '.join(f'[{name}]' for name in SECTIONS)}."
            )
    return checked


def check_setting(setting: Setting, value: Any) -> None:
    """A value's range (``minimum``) and, for a name, its registry; one sentence if it is refused."""
    minimum = setting.field.metadata.get("minimum")
    if minimum is not None and value is not None:
        for item in value if isinstance(value, list) else [value]:
            if not item >= minimum:  # also refuses NaN
                raise DoflaError(f"{setting.named} must be at least {minimum}, got {item}.")
    choices = setting.field.metadata.get("choices")
    if choices is not None and value is not None:
        registry = REGISTRIES[choices]()
        if value not in registry:
            kind = getattr(registry, "kind", setting.field.name.replace("_", " "))
            raise DoflaError(f"unknown {kind} {value!r}; choose one of: {', '.join(sorted(registry))}.")


# ------------------------------------------------------------------------------------------------- TOML


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(value: Any) -> str:
    """One TOML value of the simple types a config holds: bool, int, float, str, list, table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value).replace("\x7f", "\\u007f")  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        items = [f"{_toml_key(key)} = {_toml_value(item)}" for key, item in value.items() if item is not None]
        return "{" + ", ".join(items) + "}"
    raise DoflaError(f"cannot write {value!r} ({type(value).__name__}) to TOML.")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def to_toml(config: LinearizeConfig) -> str:
    """The whole resolved config as TOML; a setting that is None (its automatic choice) is left out."""
    data = config.to_dict()
    lines = ["# dofla linearize run configuration (load it with: dofla linearize --config FILE)", ""]
    lines += [
        f"{key} = {_toml_value(value)}"
        for key, value in data.items()
        if key not in SECTIONS and value is not None
    ]
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        lines += [
            f"{key} = {_toml_value(value)}" for key, value in data[section].items() if value is not None
        ]
    return "\n".join(lines) + "\n"


def save_config(config: LinearizeConfig, path: str | Path) -> Path:
    """Write the resolved config as TOML, atomically."""
    from dofla.io import write_text_atomic

    return write_text_atomic(path, to_toml(config))


def read_settings(path: str | Path) -> dict[str, Any]:
    """The settings a TOML file holds, as a nested dict (not yet resolved), without what only a command line
    asks (``resume``, ``overwrite``: a config saved by an older dofla may hold them; reusing it for another
    run must never discard that run)."""
    path = Path(path)
    if path.is_dir():
        raise DoflaError(
            f"the config file {path} is a folder; give the TOML file (e.g. {path / CONFIG_FILE})."
        )
    try:
        with open(path, "rb") as stream:
            settings = tomllib.load(stream)
    except OSError as error:
        raise DoflaError(f"cannot read the config file {path}: {error.strerror or error}.") from error
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise DoflaError(f"the config file {path} is not valid TOML: {error}.") from error
    unsaved = [setting.key for setting in settings_of() if not setting.field.metadata.get("saved", True)]
    return {key: value for key, value in settings.items() if key not in unsaved}


def load_config(path: str | Path, **changes: Any) -> LinearizeConfig:
    """The config a TOML file describes (a run's config.toml gives that run's config); ``changes`` (nested
    like the file) win over it."""
    return LinearizeConfig.from_dict(merge(read_settings(path), changes), source=str(path))
