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
import dataclasses
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dofla.config import DEFAULT_WINDOW
from dofla.errors import DoflaError

CONFIG_FILE = "config.toml"  # the resolved config in a run folder


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    minimum: int | float | None = None,
    choices: Callable[[], Mapping] | None = None,
    tokens: bool = False,
    cli: bool = True,
    saved: bool = True,
) -> Any:
    """A config field. flag: its command-line flag when not ``--field-name`` (no dashes: a positional);
    minimum: the smallest value (of each item, for a list); choices: the registry its value is a name in;
    tokens: a token count that may be written like 2M or 500k; cli: False for fields without a flag;
    saved: False for what one invocation asks (``--resume``, ``--overwrite``), which a config file never
    records nor sets."""
    metadata = dict(
        help=help, flag=flag, minimum=minimum, choices=choices, tokens=tokens, cli=cli, saved=saved
    )
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# The registries a name is looked up in (imported late: they pull in torch).
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


# ----------------------------------------------------------------------------------------------- sections


@dataclass
class TeacherSettings:
    """The softmax teacher and where it runs."""

    model: str = option(
        "smollm2-135m",
        "teacher: a Hugging Face model folder, a .gguf file, a hub id, or 'smollm2-135m' (embedded default)",
        flag="model",
    )
    dtype: str | None = option(None, "float32 (CPU default) | bfloat16 (CUDA default) | float16")
    device: str | None = option(None, "cpu | cuda | cuda:N (default: cuda if available)")


@dataclass
class DataSettings:
    """The text, its packing and the held-out split (made before anything is cut, never trained on)."""

    path: str | None = option(
        None,
        "txt, jsonl or a datasets folder (default: text sampled from the teacher, cached)",
        flag="--data",
    )
    heldout_path: str | None = option(
        None,
        "held-out text of another source than --data (txt, jsonl or a datasets folder): quality is measured "
        "on it and every row of --data trains (default: held-out rows split off --data before training)",
        flag="--heldout-data",
    )
    seq_len: int = option(512, "training sequence length", minimum=2)
    heldout_fraction: float = option(0.1, "share of the packed rows held out before training")
    heldout_sequences: int = option(32, "held-out rows of the longest length, never trained on", minimum=1)
    sampled_texts: int = option(64, "without --data: texts sampled from the teacher", minimum=1)
    sampled_tokens: int = option(256, "without --data: new tokens per sampled text", minimum=1)
    recall_fraction: float = option(
        0.0,
        "share of training rows that repeat a span of their own text later, beyond the window (trains recall "
        "past the window; held-out rows are left as they are)",
        minimum=0.0,
    )


@dataclass
class PlanSettings:
    """What each layer becomes: the kind, the window, and the feature dimensions by allocation."""

    budget: int = option(64, "mean feature dimension per layer")
    allocation: str = option("dof", "how feature dimensions are shared between layers", choices=_allocations)
    measure: str = option("dof", "statistical measure an allocation shares dimensions by", choices=_measures)
    kind: str = option("linear", "attention kind: linear | hybrid (linear + sliding window)")
    window: int = option(DEFAULT_WINDOW, "sliding window of hybrid layers")
    sinks: int = option(0, "first tokens always visible to the window", minimum=0)
    per_query_head: bool = option(
        False,
        "one feature map and state per query head instead of one per key/value head (more state, and "
        "distinct memories for the query heads of a group)",
        flag="--per-query-head",
    )
    layers: list[int] | None = option(
        None,
        "comma-separated layers to convert (default: every layer whose cache grows; the teacher's own "
        "sliding-window layers stay as they are unless --convert-windowed)",
        minimum=0,
    )
    convert_windowed: bool = option(
        False,
        "without --layers, convert the teacher's own sliding-window layers too (by default they keep their "
        "bounded cache and only the full-attention layers are converted)",
    )
    keep_softmax: int = option(0, "layers left as full softmax, chosen by --softmax-choice", minimum=0)
    softmax_choice: str = option(
        "dof",
        "how the --keep-softmax layers are chosen (measured: by error curves; window: the layers whose cut to "
        "the window costs most at the training length)",
        choices=_softmax_choices,
    )
    position_period: int | None = option(
        None,
        "the converted layers' memories read rotary positions modulo this many tokens after training, so "
        "they never meet positions beyond those they were trained at (0: the true positions; default: the "
        "longest length the run trains at where the teacher has one rotary embedding with fixed frequencies, "
        "else 0)",
        minimum=0,
    )
    sinks_at_edge: bool | None = option(
        None,
        "the hybrid layers' windows see their --sinks from the window's edge (each token's query turned back "
        "to position window + sinks for the sinks' scores) instead of at their true positions, which the "
        "teacher stops reading some thousands of tokens away (trained and saved so; default: on for a hybrid "
        "plan with sinks where the teacher has one rotary embedding with fixed frequencies, else off)",
    )
    dof_points: int = option(1024, "points per head captured for the DoF estimate", minimum=1)
    dof_batches: int = option(2, "training batches the DoF estimate captures from", minimum=1)


@dataclass
class StudentSettings:
    """The student module of each converted layer."""

    cell: str = option("linear", "student cell", choices=_cells)
    feature_map: str = option("learnable_prf", "feature map", choices=_feature_maps)
    cell_options: dict[str, Any] = option(
        factory=dict, help="the cell's own options as KEY=VALUE,... (e.g. window_factor=0.95)"
    )


# how several processes share distillation (dofla.distill.distributed)
SHARDINGS = dict(
    data="each process trains every layer on its slice of each batch; gradients are averaged",
    layers="each process trains its own contiguous block of converted layers on whole batches",
)


@dataclass
class DistillSettings:
    """Stage 1, attention transfer (the same names as :class:`dofla.distill.trainer.DistillConfig`)."""

    loss: str = option("softmax", "distillation loss", choices=_losses)
    tokens: int = option(2_000_000, "distillation token budget, e.g. 2M or 500k", tokens=True)
    batch_size: int = option(4, "sequences per step (also of LoRA, DoF capture and evaluation)", minimum=1)
    lr: float = option(1e-2, "base learning rate (feature maps may set their own)")
    eval_every: int = option(50, "steps between held-out evaluations (0: only at the end)", minimum=0)
    checkpoint_every: int = option(50, "steps between checkpoints (0: none)", minimum=0)
    patience: int = option(0, "evaluations without improvement before stopping early (0: off)", minimum=0)
    kl_weight: float = option(0.0, "--loss direct: weight of KL to the teacher's logits")
    length_schedule: list[tuple[int, float]] | None = option(
        None,
        "length curriculum: LENGTH:SHARE stages, shortest first, ending at --seq-len, shares of --tokens "
        "summing to 1, e.g. 256:0.5,512:0.5; a shorter stage's batch holds about as many tokens "
        "(--batch-size x seq-len / LENGTH sequences) (default: none, every step at --seq-len)",
    )
    sharding: str = option(
        "data",
        "how --nproc / torchrun processes share distillation: data (each a slice of every batch) | layers "
        "(each its own block of converted layers, on whole batches)",
        choices=lambda: SHARDINGS,
    )
    cuda_graphs: bool = option(
        False,
        "on a CUDA device, replay each converted layer's loss and backward from CUDA graphs captured at the "
        "first step (the same training, without launching each of its operators from Python)",
    )
    teacher_states: str | None = option(
        None,
        "with --sharding layers: a `dofla teacher-states` folder (train/, heldout/) with a boundary at each "
        "process's first layer; each process starts its forward there instead of at the embeddings",
    )


@dataclass
class LoraSettings:
    """Stage 2, LoRA on next-token loss, merged (the same names as :class:`dofla.distill.lora.LoraConfig`)."""

    enabled: bool = option(False, "stage 2: LoRA on next-token loss, merged into the weights", flag="--lora")
    tokens: int = option(200_000, "LoRA token budget, e.g. 200k", flag="--lora-tokens", tokens=True)
    rank: int = option(8, "LoRA rank", flag="--lora-rank", minimum=1)
    alpha: int = option(16, "LoRA alpha", flag="--lora-alpha", minimum=1)
    targets: list[str] | None = option(
        None, "comma-separated module names (default: the family's q/k/v/o)", flag="--lora-targets"
    )
    lr: float = option(1e-3, "LoRA learning rate", flag="--lora-lr")
    train_students: bool = option(
        False,
        "also train the converted layers' own parameters (feature maps, gates, mixes) end to end in the LoRA "
        "stage, on next-token loss (default: only the adapters)",
        flag="--lora-train-students",
    )
    kl_weight: float = option(
        0.0, "weight of KL to the teacher's logits added to the next-token loss", flag="--lora-kl"
    )
    tokens_per_forward: int = option(
        2048,
        "most tokens per forward/backward: a batch is split into pieces of whole sequences, gradients summed "
        "(the same step with the activation memory of one piece)",
        flag="--lora-tokens-per-forward",
        minimum=1,
    )
    needle_fraction: float = option(
        0.0,
        "share of the LoRA stage's rows that state a few five-digit facts and end by asking for them, more "
        "than the window back (teaches the pass-key kind of retrieval on next-token loss; attention transfer "
        "and held-out rows are left as they are)",
        flag="--lora-needles",
        minimum=0.0,
    )
    seq_len: int | None = option(
        None,
        "length of the LoRA stage's rows, cut from the same training text (default: --seq-len); longer rows "
        "train the adapters and needle rows at longer contexts. At most the packed rows' length (the longest "
        "of --seq-len and --eval-lengths the data fills twice)",
        flag="--lora-seq-len",
        minimum=2,
    )
    baseline: bool = option(
        False,
        "also train the same LoRA stage on the unconverted teacher and report its perplexity (the LoRA stage "
        "adapts to the training text too; this separates the two effects)",
        flag="--lora-baseline",
    )


@dataclass
class EvaluateSettings:
    """What the report measures on held-out data after training."""

    lengths: list[int] | None = option(
        None,
        "comma-separated held-out lengths beyond --seq-len (default: 1024,2048 where the teacher allows)",
        flag="--eval-lengths",
        minimum=2,
    )
    passkey_lengths: list[int] | None = option(
        None,
        "comma-separated pass-key context lengths (default: 256 to 2048 where the teacher allows)",
        minimum=1,
    )
    passkey_trials: int = option(2, "pass-key trials per length and depth (0: no pass-key test)", minimum=0)
    recall: bool = option(
        True,
        "score recall beyond the window on the held-out rows of every length (a span of each row repeated "
        "past the window: teacher, window baseline and student)",
    )
    error_sequences: int = option(8, "held-out sequences of the per-layer attention error", minimum=0)
    edge_sinks: bool = option(
        False,
        "also the window baselines whose sinks are seen from the window's edge instead of their true positions "
        "(rotary teachers): a stronger no-training cache beyond about 4,096 tokens",
    )


SECTIONS: dict[str, type] = dict(
    teacher=TeacherSettings,
    data=DataSettings,
    plan=PlanSettings,
    student=StudentSettings,
    distill=DistillSettings,
    lora=LoraSettings,
    evaluate=EvaluateSettings,
)


# ------------------------------------------------------------------------------------------------ the root


@dataclass
class LinearizeConfig:
    """Every setting of ``dofla linearize`` (saved as the run's config.toml and in result.json).

    Build one with :meth:`from_dict` (or :func:`load_config`) so a recipe fills only what was not set;
    constructed directly, list the dotted names you set in ``overrides`` to keep a recipe off them.
    """

    out_dir: str = option(help="output folder (model/, report.md, checkpoints)", flag="--out")
    recipe: str | None = option(None, "preset recipe (see README)", choices=_recipes)
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

    def distill_config(self):
        """The trainer's :class:`~dofla.distill.trainer.DistillConfig`: the ``distill`` section's values."""
        from dofla.distill.trainer import DistillConfig

        return same_named(DistillConfig, self.distill, seed=self.seed, progress=self.progress)

    def lora_config(self):
        """The LoRA stage's :class:`~dofla.distill.lora.LoraConfig`: the ``lora`` section's values."""
        from dofla.distill.lora import LoraConfig

        return same_named(
            LoraConfig,
            self.lora,
            batch_size=self.distill.batch_size,
            seed=self.seed,
            progress=self.progress,
            checkpoint_every=self.distill.checkpoint_every,
        )

    def validate(self) -> None:
        """Everything that can be checked before a model is loaded, in one sentence each."""
        from dofla.config import LayerPlan, check_feature_budget
        from dofla.data import check_data_path
        from dofla.distill.curriculum import check_length_schedule
        from dofla.distill.losses import check_kernel_loss
        from dofla.models.loading import resolve_device, resolve_dtype

        for setting in settings_of(type(self)):
            check_setting(setting, self.get(setting.key))
        check_feature_budget(self.plan.budget)
        plan = LayerPlan(
            kind=self.plan.kind, window=self.plan.window, sinks=self.plan.sinks, cell=self.student.cell
        )
        plan.validate(0, 1, 1)
        check_kernel_loss(self.distill.loss, self.student.cell, self.plan.sinks)
        if self.plan.sinks_at_edge and (self.plan.kind != "hybrid" or not self.plan.sinks):
            raise DoflaError(
                "--sinks-at-edge moves the sinks of hybrid layers' windows; give --kind hybrid with --sinks N "
                "(N > 0), or leave it off."
            )
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
        self.distill_config().validate()
        if self.lora.enabled:
            self.lora_config().validate()
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


def same_named(cls: type, section: Any, **extra: Any) -> Any:
    """``cls(...)`` from the fields of ``section`` that ``cls`` also has, plus ``extra``."""
    names = {item.name for item in fields(cls)}
    values = {item.name: copy.deepcopy(getattr(section, item.name)) for item in fields(section)}
    return cls(**{name: value for name, value in values.items() if name in names}, **extra)


# ------------------------------------------------------------------------------------ settings, one by one


@dataclass(frozen=True)
class Setting:
    """One field of the tree: ``key`` is its dotted name ("lora.rank"), ``flag`` its command-line flag."""

    key: str
    field: dataclasses.Field
    hint: Any  # the field's type, e.g. int or list[int] | None

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag") or "--" + self.field.name.replace("_", "-")

    @property
    def where(self) -> str:
        """How errors name it: the flag, and its place in a config file."""
        section, _, name = self.key.rpartition(".")
        return f"{self.flag} ({name} in [{section}])" if section else f"{self.flag} ({name})"

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default


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


def flatten(settings: Mapping[str, Any]) -> dict[str, Any]:
    """{"distill": {"tokens": 5}, "seed": 1} -> {"distill.tokens": 5, "seed": 1}."""
    flat = {}
    for key, value in settings.items():
        if key in SECTIONS:
            flat.update({f"{key}.{name}": item for name, item in value.items()})
        else:
            flat[key] = value
    return flat


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Nested settings, later layers winning key by key (sections merged, not replaced)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in SECTIONS and isinstance(value, Mapping):
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    return merged


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


def unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed): ``list[int] | None`` -> (list[int], True)."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in typing.get_args(hint):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None)), True
    return hint, False


def _is(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) is tuple:  # a fixed-size pair like (length, share), a list in TOML
        parts = typing.get_args(kind)
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(parts)
            and all(_is(item, part) for item, part in zip(value, parts, strict=True))
        )
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _as(value: Any, kind: Any) -> Any:
    """``value`` (which :func:`_is` of ``kind``) as ``kind``: an int given for a float becomes a float."""
    if typing.get_origin(kind) is tuple:
        return tuple(_as(item, part) for item, part in zip(value, typing.get_args(kind), strict=True))
    return kind(value)


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        return "[" + ", ".join(part.__name__ for part in typing.get_args(kind)) + "] pairs"
    return kind.__name__


def _describe(hint: Any) -> str:
    kind, optional = unwrap(hint)
    origin = typing.get_origin(kind)
    if origin is list:
        text = f"a list of {_type_name(typing.get_args(kind)[0])}"
    elif origin is dict:
        text = "a table"
    else:
        text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    return text + (" (or left out)" if optional else "")


def typed(setting: Setting, value: Any) -> Any:
    """``value`` for ``setting`` if its type fits (an int given for a float becomes a float), else an error."""
    kind, optional = unwrap(setting.hint)
    if value is None and optional:
        return None
    if setting.field.metadata.get("tokens") and isinstance(value, str):
        return token_count(setting.flag, value)
    origin = typing.get_origin(kind)
    if origin is list:
        item = typing.get_args(kind)[0]
        if isinstance(value, (list, tuple)) and all(_is(entry, item) for entry in value):
            return [_as(entry, item) for entry in value]
    elif origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif _is(value, kind):
        return kind(value)
    raise DoflaError(f"{setting.where} must be {_describe(setting.hint)}, got {value!r}.")


def check_setting(setting: Setting, value: Any) -> None:
    """A value's range (``minimum``) and, for a name, its registry; one sentence if it is refused."""
    minimum = setting.field.metadata.get("minimum")
    if minimum is not None and value is not None:
        for item in value if isinstance(value, list) else [value]:
            if not item >= minimum:  # also refuses NaN
                raise DoflaError(f"{setting.flag} must be at least {minimum}, got {item}.")
    choices = setting.field.metadata.get("choices")
    if choices is not None and value is not None:
        registry = choices()
        if value not in registry:
            kind = getattr(registry, "kind", setting.field.name.replace("_", " "))
            raise DoflaError(f"unknown {kind} {value!r}; choose one of: {', '.join(sorted(registry))}.")


def token_count(option: str, text: str | int) -> int:
    """A token budget like 2M, 500k or 100000; refused (one sentence) unless a positive finite count."""
    from dofla.data import parse_tokens

    try:
        tokens = parse_tokens(text)
    except (OverflowError, DoflaError):  # 'inf' overflows int(); 'nan' and words are not numbers
        tokens = None
    if tokens is None or tokens <= 0:
        raise DoflaError(
            f"{option} must be a positive number of tokens like 2M, 500k or 100000, got {text!r}."
        )
    return tokens


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
