"""The settings tree's sections: one dataclass per stage of a ``dofla linearize`` run (``teacher``, ``data``,
``plan``, ``student``, ``distill``, ``lora``, ``evaluate``), each field declared once with :func:`option`
(its default, help text and command-line flag). The stages take their section whole; the root, its
resolution (recipes, files, flags) and its validation are :mod:`dofla.run_config`. This module is plain
data: registry names (cells, losses, allocations...) are checked by :mod:`dofla.run_config`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dofla.config import LayerPlan  # a layer's defaults are its plan's
from dofla.errors import DoflaError

# The largest learning rate taken: Adam's first step is 10x it and a cell may scale it further, and a step
# past float32's 3.4e38 is an overflow inside torch, not a loss that the non-finite step policy can catch.
MAX_LEARNING_RATE = 1e30


def check_learning_rate(value: float, flag: str, example: str) -> None:
    """Refuse a learning rate that is not a positive number, or above :data:`MAX_LEARNING_RATE`."""
    if not (math.isfinite(value) and value > 0):
        name = "learning rate" if flag == "--lr" else flag
        raise DoflaError(f"{name} must be a positive number, got {value}; pass e.g. {flag} {example}.")
    if value > MAX_LEARNING_RATE:
        raise DoflaError(
            f"{flag} {value:g} is above {MAX_LEARNING_RATE:g}, where Adam's float32 steps overflow; pass e.g. "
            f"{flag} {example}."
        )


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    minimum: int | float | None = None,
    choices: str | None = None,
    tokens: bool = False,
    cli: bool = True,
    saved: bool = True,
) -> Any:
    """A config field. flag: its command-line flag when not ``--field-name`` (no dashes: a positional);
    minimum: the smallest value (of each item, for a list); choices: the name of the registry its value is a name in (:data:`dofla.run_config.REGISTRIES`);
    tokens: a token count that may be written like 2M or 500k; cli: False for fields without a flag;
    saved: False for what one invocation asks (``--resume``, ``--overwrite``), which a config file never
    records nor sets."""
    metadata = dict(
        help=help, flag=flag, minimum=minimum, choices=choices, tokens=tokens, cli=cli, saved=saved
    )
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


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
    allocation: str = option("dof", "how feature dimensions are shared between layers", choices="allocation")
    measure: str = option("dof", "statistical measure an allocation shares dimensions by", choices="measure")
    kind: str = option(LayerPlan.kind, "attention kind: linear | hybrid (linear + sliding window)")
    window: int = option(LayerPlan.window, "sliding window of hybrid layers")
    sinks: int = option(LayerPlan.sinks, "first tokens always visible to the window", minimum=0)
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
        choices="softmax_choice",
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

    cell: str = option(LayerPlan.cell, "student cell", choices="cell")
    feature_map: str = option(LayerPlan.feature_map, "feature map", choices="feature_map")
    cell_options: dict[str, Any] = option(
        factory=dict, help="the cell's own options as KEY=VALUE,... (e.g. window_factor=0.95)"
    )
    recall_cache: int = option(
        0,
        "gated_delta hybrid: tokens per head of a recall cache switched on after training (the tokens the "
        "memory recalls worst, read in the window's softmax; no parameters): trained without it, evaluated "
        "and saved with it (0: none)",
        minimum=0,
    )


# how several processes share distillation (dofla.distill.distributed)
SHARDINGS = dict(
    data="each process trains every layer on its slice of each batch; gradients are averaged",
    layers="each process trains its own contiguous block of converted layers on whole batches",
)


@dataclass
class DistillSettings:
    """Stage 1, attention transfer (:func:`dofla.distill.trainer.distill`); fields without a flag are set in a
    config file."""

    loss: str = option("softmax", "distillation loss", choices="loss")
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
        choices="sharding",
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
    weight_decay: float = option(0.0, "AdamW weight decay", cli=False)
    warmup_fraction: float = option(0.05, "share of the steps with a linear warm-up", cli=False)
    min_lr_fraction: float = option(0.1, "floor of the cosine decay, relative to the peak rate", cli=False)
    grad_clip: float = option(1.0, "largest gradient norm (larger ones are scaled down)", cli=False)
    eval_batches: int = option(4, "held-out batches per evaluation", minimum=1, cli=False)
    max_bad_steps: int = option(
        5, "consecutive non-finite steps tolerated (each halves the learning rate)", minimum=1, cli=False
    )
    query_chunk: int = option(128, "query rows per piece of a layer-wise loss", minimum=1, cli=False)
    temperature: float = option(1.0, "temperature of the KL to the teacher's logits", cli=False)

    def validate(self) -> None:
        """What the trainer refuses before any work (registry names and ranges)."""
        from dofla.distill.curriculum import check_length_schedule
        from dofla.distill.losses import LOSSES

        LOSSES[self.loss]  # an unknown name is refused with the registered ones
        if self.tokens <= 0:
            raise DoflaError(f"the token budget must be positive, got {self.tokens}; pass e.g. --tokens 2M.")
        if self.batch_size <= 0:
            raise DoflaError(f"batch size must be positive, got {self.batch_size}; pass e.g. --batch-size 4.")
        check_learning_rate(self.lr, "--lr", "1e-2")
        if not (math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise DoflaError(f"the KL weight must be zero or positive, got {self.kl_weight}.")
        for name in ("eval_every", "checkpoint_every", "patience"):
            if getattr(self, name) < 0:
                raise DoflaError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}.")
        if self.max_bad_steps < 1:
            raise DoflaError(f"max_bad_steps must be at least 1, got {self.max_bad_steps}.")
        check_length_schedule(self.length_schedule)
        if self.cuda_graphs and not LOSSES[self.loss].layerwise:
            raise DoflaError(
                f"--cuda-graphs captures the layer-wise losses one layer at a time; the {self.loss} loss runs "
                "the whole model end to end: drop --cuda-graphs or choose a layer-wise --loss."
            )


@dataclass
class LoraSettings:
    """Stage 2, LoRA on next-token loss, merged (:func:`dofla.distill.lora.train_lora`; its batches are the
    ``distill`` section's size and it checkpoints as often)."""

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
    warmup_fraction: float = option(0.05, "share of the steps with a linear warm-up", cli=False)
    min_lr_fraction: float = option(0.1, "floor of the cosine decay, relative to the peak rate", cli=False)
    grad_clip: float = option(1.0, "largest gradient norm (larger ones are scaled down)", cli=False)
    temperature: float = option(1.0, "temperature of the KL to the teacher's logits", cli=False)
    max_bad_steps: int = option(
        5, "consecutive non-finite steps tolerated (each halves the learning rate)", minimum=1, cli=False
    )

    def validate(self) -> None:
        """Every option's range, checked before any work (the targets need the model:
        :func:`dofla.distill.lora.check_targets`)."""
        if self.rank < 1:
            raise DoflaError(f"--lora-rank must be at least 1, got {self.rank}.")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise DoflaError(f"--lora-alpha must be positive, got {self.alpha}.")
        if self.tokens <= 0:
            raise DoflaError(
                f"the LoRA token budget must be positive, got {self.tokens}; pass e.g. --lora-tokens 200k."
            )
        check_learning_rate(self.lr, "--lora-lr", "1e-3")
        if not (math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise DoflaError(f"--lora-kl must be zero or positive, got {self.kl_weight}.")
        if self.targets is not None and not all(
            isinstance(name, str) and name.strip() for name in self.targets
        ):
            raise DoflaError(f"--lora-targets must be comma-separated module names, got {self.targets}.")
        if self.tokens_per_forward < 1:
            raise DoflaError(
                f"--lora-tokens-per-forward must be at least 1, got {self.tokens_per_forward}; pass e.g. 2048."
            )
        if self.max_bad_steps < 1:
            raise DoflaError(f"max_bad_steps must be at least 1, got {self.max_bad_steps}.")


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
