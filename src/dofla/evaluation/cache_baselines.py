"""The teacher with a bounded cache of the student's state size: the no-training baselines at equal bytes.

A converted model is worth having only if, holding as many bytes between tokens as these, it does better
than the unmodified teacher whose KV cache is cut to the same size:

- ``streaming``: StreamingLLM, the last keys plus the first ``sinks`` tokens
  (:func:`dofla.evaluation.window_baseline.window_restricted`);
- ``heavy-hitter``: H2O, the sinks, the recent keys and the most attended ones
  (:func:`dofla.evaluation.heavy_hitter.heavy_hitter_restricted`).

The student's state is measured as the tensor storage its cache holds after a prefill of a row of the
evaluated length (:func:`held_state_bytes`, :func:`dofla.cache.held_bytes`); the cache budget in tokens per
layer is the number of the teacher's keys and values that fit in those bytes (:func:`equal_bytes_tokens`).
In the layers a student keeps as full softmax the baselines keep the teacher's whole cache too, and those
layers' bytes are taken off the budget first. The baselines run as masks over transformers' ordinary cache,
so their bytes are computed from the tokens they keep (:func:`baseline_bytes`), not measured.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from dofla.cache import held_bytes
from dofla.errors import DoflaError
from dofla.evaluation.heavy_hitter import DEFAULT_BLOCK, heavy_hitter_restricted
from dofla.evaluation.window_baseline import window_restricted

CACHE_BASELINES = ("streaming", "heavy-hitter")
MIB = 2**20


@dataclass(frozen=True)
class CacheBaseline:
    """One bounded-cache baseline: ``name`` in :data:`CACHE_BASELINES`; ``tokens``: the keys each restricted
    layer keeps (the window plus the sinks, or the heavy-hitter budget); ``sinks``: the first tokens kept."""

    name: str
    tokens: int
    sinks: int

    @property
    def block(self) -> int:
        """Prompt tokens between evictions of the heavy-hitter cache: at most a quarter of what it keeps."""
        return max(1, min(DEFAULT_BLOCK, (self.tokens - self.sinks) // 4))

    @property
    def kind_label(self) -> str:
        return "StreamingLLM" if self.name == "streaming" else "heavy hitters (H2O)"

    @property
    def label(self) -> str:
        if self.name == "streaming":
            return f"StreamingLLM {self.tokens - self.sinks} + {self.sinks} sinks"
        return f"heavy hitters (H2O) {self.tokens}"

    def summary(self) -> dict:
        return {**asdict(self), "label": self.label}

    @contextmanager
    def applied(self, teacher: torch.nn.Module, layers: Sequence[int] | None) -> Iterator[torch.nn.Module]:
        """The teacher running this baseline in ``layers`` (None: all)."""
        if self.name == "streaming":
            with window_restricted(teacher, self.tokens - self.sinks, self.sinks, layers=layers):
                yield teacher
        else:
            with heavy_hitter_restricted(teacher, self.tokens, self.sinks, layers, block=self.block):
                yield teacher


def check_cache_budget(budget: int, lengths: Sequence[int], sinks: int) -> None:
    """A cache budget (tokens per layer) given by the user: refused with one sentence when it is not a
    positive number of tokens, leaves no room beyond the sinks, or is not smaller than the shortest
    evaluated context (the teacher's whole KV cache there: nothing would be evicted)."""
    if int(budget) < 1:
        raise DoflaError(f"the cache budget must be a positive number of tokens, got {budget}.")
    if int(budget) <= int(sinks) + 1:
        raise DoflaError(
            f"a cache budget of {budget} tokens leaves no window beyond {sinks} sink tokens; give at least "
            f"{int(sinks) + 2}."
        )
    shortest = min(int(length) for length in lengths) if lengths else None
    if shortest is not None and int(budget) >= shortest:
        raise DoflaError(
            f"a cache budget of {budget} tokens is not smaller than the {shortest}-token context (the teacher's "
            f"whole KV cache there); give fewer than {shortest} tokens or longer contexts."
        )


def kv_bytes_per_token(teacher: torch.nn.Module) -> int:
    """Bytes one token's keys and values take in one softmax layer of the teacher (its dtype)."""
    config = teacher.config.get_text_config()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * kv_heads * head_dim * next(teacher.parameters()).element_size()


@torch.no_grad()
def held_state_bytes(model: torch.nn.Module, row: torch.Tensor) -> int:
    """The storage ``model``'s cache holds after a prefill of ``row`` (1, T) token ids (bytes)."""
    cache = DynamicCache(config=model.config)
    keep_last = (
        {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    )
    device = next(model.parameters()).device
    model(input_ids=row[:1].to(device), past_key_values=cache, use_cache=True, **keep_last)
    return held_bytes(cache)


def _layer_counts(teacher: torch.nn.Module, layers: Sequence[int] | None, length: int) -> tuple[int, int]:
    """(layers the baselines restrict, keys the layers kept as they are hold at ``length`` tokens: every
    key, or the last ``sliding_window`` in the teacher's own sliding-window layers)."""
    from dofla.models import get_adapter

    adapter = get_adapter(teacher)
    restricted = set(range(adapter.num_layers)) if layers is None else {int(layer) for layer in layers}
    kept = [
        min(int(length), int(adapter.sliding_window)) if kind == "sliding" else int(length)
        for index, kind in enumerate(adapter.layer_kinds)
        if index not in restricted
    ]
    return len(restricted), sum(kept)


def equal_bytes_tokens(
    teacher: torch.nn.Module, state_bytes: int, length: int, layers: Sequence[int] | None
) -> int:
    """The keys per restricted layer a teacher's cache can keep in ``state_bytes`` at ``length`` tokens,
    after the layers kept as they are (not in ``layers``) take theirs (``length``, or their own window)."""
    restricted, kept_keys = _layer_counts(teacher, layers, length)
    per_token = kv_bytes_per_token(teacher)
    left = int(state_bytes) - kept_keys * per_token
    return max(0, left // (per_token * max(restricted, 1)))


def baseline_bytes(teacher: torch.nn.Module, tokens: int, length: int, layers: Sequence[int] | None) -> int:
    """Bytes of a teacher cache keeping ``tokens`` keys in each restricted layer and, in the others, every
    key (or the last ``sliding_window`` of the teacher's own window layers), at ``length`` tokens (the
    heavy-hitter scores, a few bytes per kept key, are left out)."""
    restricted, kept_keys = _layer_counts(teacher, layers, length)
    per_token = kv_bytes_per_token(teacher)
    return (restricted * min(int(tokens), int(length)) + kept_keys) * per_token


def heavy_hitter_obstacle(teacher: torch.nn.Module, layers: Sequence[int] | None) -> str | None:
    """Why the heavy-hitter baseline cannot run on ``teacher``'s restricted ``layers`` (None: it can): it runs
    plain softmax layers only, not soft-capped ones (Gemma 2) or the teacher's own sliding windows."""
    from dofla.models import get_adapter

    adapter = get_adapter(teacher)
    chosen = range(adapter.num_layers) if layers is None else [int(layer) for layer in layers]
    modules = adapter.attention_modules(teacher)
    if any(adapter.attention_softcap(modules[index]) for index in chosen):
        return "this teacher soft-caps its attention scores"
    windowed = [index for index in chosen if adapter.layer_kinds[index] == "sliding"]
    if windowed:
        return f"layers {windowed} keep the teacher's own sliding window"
    return None


def cache_baselines_at(
    teacher: torch.nn.Module,
    tokens: int,
    length: int,
    sinks: int,
    notes: set[str],
    layers: Sequence[int] | None = None,
) -> list[CacheBaseline]:
    """The equal-bytes baselines keeping ``tokens`` keys per restricted layer (``layers``, None: all) at
    ``length`` (none, with a note in ``notes``, when that leaves no window beyond the sinks; no heavy
    hitters, with a note, where :func:`heavy_hitter_obstacle` says they cannot run)."""
    if tokens < int(sinks) + 2:
        notes.add(
            f"at {length} tokens the student's state holds {tokens} keys per layer of the teacher's cache, too "
            f"few for a window beyond {sinks} sinks: no equal-bytes baseline there."
        )
        return []
    if tokens >= length:
        notes.add(
            f"at {length} tokens the student's state holds as many bytes as the teacher's whole KV cache: its "
            "equal-bytes baselines keep every key there (they are the teacher)."
        )
    names = list(CACHE_BASELINES)
    obstacle = heavy_hitter_obstacle(teacher, layers)
    if obstacle:
        notes.add(f"no heavy-hitter (H2O) baseline: it runs plain softmax layers, and {obstacle}.")
        names.remove("heavy-hitter")
    return [CacheBaseline(name, int(tokens), int(sinks)) for name in names]


def equal_bytes_baselines(
    teacher: torch.nn.Module,
    student: torch.nn.Module | None,
    row: torch.Tensor,
    length: int,
    sinks: int,
    layers: Sequence[int] | None,
    budget: int | None,
    notes: set[str],
) -> tuple[dict[str, int], list[CacheBaseline]]:
    """After a prefill of ``row`` (1, T) at ``length`` tokens: the bytes the teacher's cache and the student's
    (where given) hold, ``{"teacher": ..., "student": ...}``, and the bounded-cache baselines keeping
    ``budget`` keys per restricted layer, or where no budget is given as many as fit in the student's bytes
    (none without either; :func:`cache_baselines_at`, its notes in ``notes``)."""
    measured = {"teacher": held_state_bytes(teacher, row)}
    if student is not None:
        measured["student"] = held_state_bytes(student, row)
    tokens = budget
    if tokens is None and student is not None:
        tokens = equal_bytes_tokens(teacher, measured["student"], length, layers)
    baselines = [] if tokens is None else cache_baselines_at(teacher, tokens, length, sinks, notes, layers)
    return measured, baselines


def bytes_label(count: int | None) -> str:
    """Bytes in MiB for a table cell."""
    return "-" if count is None else f"{count / MIB:.2f}"
