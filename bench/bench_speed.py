"""Prefill and decode speed, cache/state memory and peak memory at length: every student cell vs the teacher.

One run measures the softmax teacher (SDPA, DynamicCache) and each student converted from it with an
untrained plan (speed does not depend on the weights), at the same settings, and prints ratios against
the teacher of the same run:
- prefill tokens/s at batch 1 and each context (one timed prefill after a warm-up);
- decode tokens/s at each batch and context, over ``--steps`` (16) greedy steps after one warm-up step
  (every row of the batch counts): the teacher's KV cache is filled with random keys and values
  of the right shape (a real prefill at 16k would take minutes; decoding cost does not depend on the
  values); a student's state comes from a real prefill of a short prompt (at least twice its window)
  with its token counter moved on to the context (its state and step do not grow with length; layers
  a student keeps as full softmax get random keys and values up to the context, as the teacher);
- cache/state bytes, and peak resident memory above the loaded model during the row;
- "linear 32/96": the linear cell with layers alternating 32 and 96 features (mean 64, as a DoF
  allocation), against "linear" (64 everywhere, the ``fix`` allocation) at the same mean dimension;
- "no attention (prefill bound)" (asked for by name in ``--cells``; prefill rows only): the teacher with
  its attention replaced by zeros and everything else its own (projections, norms, MLP, cache writes).
  No student that keeps the teacher's projections and MLP prefills faster, so its ratio is the ceiling of
  every student's prefill ratio on the machine.
- "no attention (decode bound)" (asked for by name; decode rows only): the same model decoding with a cache
  that keeps nothing (it counts the context's tokens for the positions and drops each step's keys and
  values), so a step is the teacher's projections, norms, MLP and output head alone: the ceiling of every
  student's decode ratio on the machine.
- any student's name followed by " (compiled whole step)" (decode rows only): that student's whole decoding
  step (every layer, the MLP and the output head) as one ``torch.compile`` program, through
  ``dofla.graph_decode.CapturedDecoder(compiled=True)`` as ``dofla generate --compile`` decodes greedily (the
  first untimed step traces and compiles it);
- "teacher compiled (static cache)" (asked for by name; decode rows only): the teacher's whole decoding step
  under ``torch.compile`` over transformers' StaticCache of random keys and values (two untimed steps
  first, the first compiling), the reference a compiled student's rows ask for;
- "teacher (KV written in place)" (asked for by name; decode rows only): the teacher decoding from the same
  synthetic cache held in dofla's ``GrowingKVLayer`` (the kept softmax layers' cache layer of a partly
  converted student) instead of transformers' ``DynamicLayer``, which copies its whole cache at each step.
A setting that does not fit in memory prints one line and the run goes on with the rest. Every row runs
in its own process (``--isolate rows``, the default), which loads the model, warms up with one short
prefill and measures that row alone, so no row's figure depends on the memory the rows before it left
(``--isolate none``: all rows of a model in one process, faster, for smoke tests).

    python bench/bench_speed.py                       # full run, about 40 min on the idle 2-core CPU
    python bench/bench_speed.py --quick               # 1k context, few steps: a check, not a measurement
    python bench/bench_speed.py --cells linear,window --contexts 1024,4096 --batches 1
    python bench/bench_speed.py --contexts 4096 --batches 1 --prefill-chunks 0 --repeats 3   # medians of 3
    python bench/bench_speed.py --contexts 4096 --batches 1 --prefill-chunks 0 --repeats 3 \
        --cells "gated-delta recipe,gated-delta recipe (compiled whole step)" --position-period 1024 --sinks-at-edge
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from timing import (
    PeakMemory,
    kv_cache_bytes,
    release_freed_memory,
    student_cache_at,
    synthetic_kv_cache,
    time_decode,
    time_prefill,
)
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer

from dofla.convert import (
    convert,
    plan_for,
    set_position_period,
    set_sinks_at_edge,
    unconvert,
)
from dofla.evaluation.logits import available_memory_bytes  # the host's MemAvailable, as the library reads it
from dofla.recipes import plan_for_arguments

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent
MIB = 2.0**20
TEACHER = "teacher"
# name -> (plan_for options, per-layer feature dimensions or None)
STUDENTS = {
    "linear": (dict(kind="linear", cell="linear"), None),
    "linear 32/96": (dict(kind="linear", cell="linear"), (32, 96)),
    "gla": (dict(kind="linear", cell="gla"), None),
    "gated_delta": (dict(kind="linear", cell="gated_delta"), None),
    "window": (dict(kind="hybrid", cell="window"), None),
    # the gated-delta recipe's window and sinks with no memory: what the memory adds to its step
    "window 128+4": (dict(kind="hybrid", cell="window", sinks=4, window=128), None),
    "linear+window": (dict(kind="hybrid", cell="linear"), None),
    # the default (gla) recipe's cell: gla sharing one normalisation with the window and 4 sinks (here and
    # below on plan_for's learnable PRF of --feature-dim features; the recipes use Hedgehog / projection keys,
    # whose one-layer steps cost about the same: bench/bench_layer_step.py)
    "gla+window": (dict(kind="hybrid", cell="gla", sinks=4), None),
    # the gated-delta recipe's cell, alone and with 3 layers kept as full softmax (evenly spaced: which
    # layers does not change the speed)
    "gated_delta+window": (dict(kind="hybrid", cell="gated_delta", sinks=4), None),
    # the gated-delta recipe's window since it measured best: 128 tokens whatever --window says
    "gated_delta+window 128": (dict(kind="hybrid", cell="gated_delta", sinks=4, window=128), None),
    # the recipes' students exactly, as dofla.recipes defines them (their feature maps, windows, sinks and
    # cell options; the rows above use plan_for's PRF map, whose one-token step adds an exponential and a
    # normalisation per layer): gated-delta (projection keys, window 128 + 4 sinks), gated-delta-linear (no
    # window, an 8-token short convolution, the gate on the memory's read-out), gated-delta-retrieval (the
    # gated-delta cell with 4 layers kept as softmax, spread evenly here: which layers does not change the
    # speed)
    "gated-delta recipe": (plan_for_arguments("gated-delta"), None),
    # the same with layers alternating 32 and 96 features (mean 64, as an allocation): what a non-uniform
    # allocation costs its decoding step (compiled: one kernel per dimension)
    "gated-delta recipe 32/96": (plan_for_arguments("gated-delta"), (32, 96)),
    # the gla recipe (the demo's cell): gla over Hedgehog features sharing one normalisation with a window
    # of 64 and 4 sinks
    "gla recipe": (plan_for_arguments("gla"), None),
    "gated-delta-linear recipe": (plan_for_arguments("gated-delta-linear"), None),
    "gated-delta-retrieval recipe": (plan_for_arguments("gated-delta-retrieval"), None),
    # the demo's recipe: the gated-delta cell beside a window of 96 + 4 sinks and a cache of 96 tokens per head
    # read in the window's softmax (the 32 its memory recalls worst, the 64 that drew the most attention)
    "gated-delta-recall recipe": (plan_for_arguments("gated-delta-recall"), None),
    "gated_delta+window (3 softmax)": (
        dict(kind="hybrid", cell="gated_delta", sinks=4, keep_softmax=3),
        None,
    ),
}
DEFAULT_STUDENTS = (
    "linear",
    "linear 32/96",
    "gla",
    "gated_delta",
    "window",
    "gla+window",
    "gated-delta recipe",
    "gated-delta-linear recipe",
    "gated-delta-retrieval recipe",
)
# Not a student: the teacher attending to nothing (see the module docstring); prefill rows only.
NO_ATTENTION = "no attention (prefill bound)"
NO_ATTENTION_DECODE = "no attention (decode bound)"
NO_ATTENTION_MODELS = (NO_ATTENTION, NO_ATTENTION_DECODE)
NO_ATTENTION_IMPLEMENTATION = "bench_no_attention"


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """A transformers attention function that attends to nothing: zeros (B, T, H, Dv), one allocation."""
    batch, heads, length, _ = query.shape
    return query.new_zeros(batch, length, heads, value.shape[-1]), None


AttentionInterface.register(NO_ATTENTION_IMPLEMENTATION, no_attention)
# Not a student: the teacher decoding from the same synthetic cache held in dofla's GrowingKVLayer (new keys
# written in place, not concatenated onto a copy of the cache); decode rows only. What a student gains over
# it is what linearising gains, apart from the cache's implementation.
TEACHER_IN_PLACE = "teacher (KV written in place)"
# Not a student either: the teacher's whole decoding step compiled by torch.compile over transformers'
# StaticCache (what a user compiling the teacher would run); decode rows only. The reference for the
# compiled whole step's rows.
TEACHER_COMPILED = "teacher compiled (static cache)"
# decode rows: the student's whole decoding step as one torch.compile program (dofla.graph_decode's
# CapturedDecoder(compiled=True), what `dofla generate --compile` runs for greedy decoding)
WHOLE_SUFFIX = " (compiled whole step)"


def base_student(name: str) -> str:
    """The student a row's name measures (without the compiled whole step's suffix)."""
    return name.removesuffix(WHOLE_SUFFIX)


def known_model(name: str) -> bool:
    return name in PSEUDO_MODELS or base_student(name) in STUDENTS


PSEUDO_MODELS = (NO_ATTENTION, NO_ATTENTION_DECODE, TEACHER_IN_PLACE, TEACHER_COMPILED)
TEACHERS = (TEACHER, TEACHER_IN_PLACE, TEACHER_COMPILED)


class CountingLayer(DynamicLayer):
    """A cache layer that keeps no keys or values: it counts the tokens it is given (from ``tokens`` already
    seen) and hands each call's keys and values back (for a model whose attention reads none of them)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens

    def update(self, key_states, value_states, *args, **kwargs):
        self.tokens += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens


def counting_cache(model, context: int) -> DynamicCache:
    """A cache whose layers are ``CountingLayer``s at ``context`` tokens (the decode-bound row's)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [CountingLayer(context) for _ in cache.layers]
    return cache


def in_place_kv(cache):
    """``cache`` with every plain DynamicLayer replaced by a GrowingKVLayer holding the same keys and values
    (taken into its buffers at the first update, the untimed warm-up step)."""
    from transformers.cache_utils import DynamicLayer

    from dofla.cache import GrowingKVLayer

    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            growing = GrowingKVLayer()
            growing.lazy_initialization(layer.keys, layer.values)
            growing.keys, growing.values = layer.keys, layer.values
            cache.layers[index] = growing
    return cache


def time_compiled_teacher_decode(model, batch: int, context: int, steps: int) -> dict:
    """The teacher's whole decoding step compiled (``torch.compile`` of its forward, fixed shapes) over
    transformers' StaticCache holding ``context`` random keys and values per layer (as ``synthetic_kv_cache``)
    with room for the steps: two untimed greedy steps (the first compiles), then ``steps`` timed ones."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + steps + 2)
    for index, layer in enumerate(synthetic_kv_cache(model, batch, context).layers):
        cache.update(layer.keys, layer.values, index)
    compiled_forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    device = next(model.parameters()).device
    position = [context]

    def forward(**inputs):  # the static cache's next slot, as generate passes it
        where = torch.tensor(position, device=device)
        position[0] += 1
        return compiled_forward(**inputs, cache_position=where)

    return time_decode(model, cache, batch, steps=steps, warm_up_steps=2, forward=forward)


def whole_step_forward(model, cache, batch: int, context: int, steps: int):
    """A decoder running the student's whole step compiled (``CapturedDecoder(compiled=True)``) from
    ``cache`` at ``context`` tokens after one ordinary step (as ``generate_greedy`` decodes), with room for the warm-up and timed ``steps`` in layers kept as softmax,
    and a ``time_decode`` forward that steps it."""
    from types import SimpleNamespace

    from dofla.graph_decode import CapturedDecoder

    with torch.no_grad():  # one ordinary step first, as generate_greedy takes: windows into their rings
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    decoder = CapturedDecoder(model, cache, batch, context + 1, compiled=True, steps=steps + 8)

    def forward(input_ids, **ignored):
        return SimpleNamespace(logits=decoder.step(input_ids)[:, None])

    return decoder, forward


def student_plan(model, name: str, feature_dim: int, window: int):
    options, alternating = STUDENTS[base_student(name)]
    options = dict(options)
    window = options.pop("window", window)
    feature_dim = options.pop("feature_dim", feature_dim)
    keep = options.pop("keep_softmax", 0)
    if keep:
        count = model.config.get_text_config().num_hidden_layers
        keep = min(keep, count - 1)
        kept = {int((index + 0.5) * count / keep) for index in range(keep)}
        options["layers"] = [layer for layer in range(count) if layer not in kept]
    plan = plan_for(model, feature_dim=feature_dim, window=window, **options)
    if alternating is not None:
        for index, layer in enumerate(plan.layers):
            layer.feature_dim = alternating[index % len(alternating)]
        plan.metadata["allocation"] = "alternating " + "/".join(str(d) for d in alternating)
    return plan


def build_model(args) -> torch.nn.Module:
    if args.tiny:
        from dofla.models import build_tiny_model

        return build_tiny_model("llama", max_position_embeddings=max(args.contexts) + 4096)
    from dofla.models import load_teacher

    return load_teacher(args.teacher, dtype="float32", device="cpu").model.eval()


def out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or "allocate" in text or "out of memory" in text


def fits(needed_bytes: int, what: str, log) -> bool:
    """Refuse (with one line) a setting whose estimated memory exceeds what the system has available."""
    available = available_memory_bytes()
    if available is not None and needed_bytes > 0.9 * available:
        log(
            f"  skipped {what}: needs about {needed_bytes / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
        )
        return False
    return True


def row_settings(args, name: str = TEACHER) -> list[tuple[str, int, int]]:
    """(phase, batch, context) of every row model ``name`` is measured at, in the order they run."""
    prefill = [
        (phase, 1, context)
        for phase in prefill_phases(args)
        for context in args.contexts
        if (phase_chunk(phase) or 0) < context  # a prompt of one piece is the one-forward row
    ]
    if name == NO_ATTENTION:
        return prefill
    decode = [("decode", batch, context) for batch in args.batches for context in args.contexts]
    decode_only = name in (NO_ATTENTION_DECODE, TEACHER_IN_PLACE, TEACHER_COMPILED) or name.endswith(
        WHOLE_SUFFIX
    )
    return decode if decode_only else prefill + decode


def prefill_phase(chunk: int) -> str:
    """A prefill row's phase: "prefill" (one forward) or "prefill/N" (the prompt in pieces of N tokens)."""
    return f"prefill/{chunk}" if chunk else "prefill"


def prefill_phases(args) -> list[str]:
    if args.decode_only:
        return []
    return [prefill_phase(chunk) for chunk in args.prefill_chunks]


def phase_chunk(phase: str) -> int | None:
    """The piece size of a prefill phase (None: one forward)."""
    return int(phase.split("/")[1]) if "/" in phase else None


def measure_row(model, name: str, phase: str, batch: int, context: int, args, log) -> dict:
    """One prefill or decode row of one model (teacher or converted student); a setting that does not fit
    in memory gives a row with ``error="memory"`` and one line in the log."""
    is_teacher, is_prefill = name in TEACHERS, phase.startswith("prefill")
    what = f"{name} {phase} batch {batch} context {context}"
    base = dict(model=name, phase=phase, batch=batch, context=context)
    if is_prefill:
        # the teacher's cache plus one layer's (T, T)-free SDPA work and the MLP activations: a loose bound
        estimate = (
            kv_cache_bytes(model, batch, context) * (2 if is_teacher else 0) + batch * context * 200_000
        )
    else:
        estimate = kv_cache_bytes(model, batch, context + 64) * (2 if is_teacher else 0)
    if not fits(estimate, what, log):
        return dict(base, error="memory")
    try:
        with PeakMemory() as peak:
            if is_prefill:
                result = time_prefill(model, batch, context, chunk_size=phase_chunk(phase))
            elif name == TEACHER_COMPILED:
                result = time_compiled_teacher_decode(model, batch, context, args.steps or 16)
            else:
                if name == NO_ATTENTION_DECODE:
                    cache = counting_cache(model, context)
                elif is_teacher:
                    cache = synthetic_kv_cache(model, batch, context)
                    if name == TEACHER_IN_PLACE:
                        cache = in_place_kv(cache)
                else:
                    fill = min(
                        context, max(128, 2 * STUDENTS[base_student(name)][0].get("window", args.window))
                    )
                    cache = student_cache_at(model, batch, context, fill_tokens=fill)
                decoder, forward = None, None
                if name.endswith(WHOLE_SUFFIX):
                    decoder, forward = whole_step_forward(model, cache, batch, context, args.steps or 64)
                result = time_decode(
                    model,
                    cache,
                    batch,
                    steps=args.steps or None,
                    target_seconds=args.seconds_per_row,
                    # untimed, compiled whole step: the window into its ring, the program compiled
                    warm_up_steps=3 if name.endswith(WHOLE_SUFFIX) else 1,
                    forward=forward,
                )
                if decoder is not None:
                    decoder.finish()
                del cache, decoder
    except (RuntimeError, MemoryError) as error:
        if not out_of_memory(error):
            raise
        log(f"  skipped {what}: out of memory ({str(error).splitlines()[0][:120]})")
        return dict(base, error="memory")
    release_freed_memory()
    if is_prefill:
        log(f"  {what}: {result['tokens_per_second']:.0f} tok/s ({result['seconds']:.1f} s)")
    else:
        log(
            f"  {what}: {result['tokens_per_second']:.1f} tok/s ({result['steps']} steps, "
            f"{result['seconds_per_step'] * 1000:.0f} ms/step)"
        )
    return dict(base, peak_bytes=peak.extra_bytes, **result)


def warm_up(model, args) -> None:
    """One short prefill before the first timed row (allocator, threads, lazy initialisation)."""
    time_prefill(model, 1, min(args.contexts), seed=1)


def prepared_model(model, name: str, args, log):
    """The teacher as loaded, or the student ``name`` converted from it (undo with ``unconvert``)."""
    if name == TEACHER:
        log(f"{TEACHER}: softmax SDPA, DynamicCache")
        return model
    if name == TEACHER_IN_PLACE:
        log(f"{TEACHER_IN_PLACE}: softmax SDPA, dofla's GrowingKVLayer in every layer")
        return model
    if name == TEACHER_COMPILED:
        log(f"{TEACHER_COMPILED}: softmax SDPA, StaticCache, the decoding step under torch.compile")
        return model
    if name in NO_ATTENTION_MODELS:
        log(f"{name}: the teacher with its attention replaced by zeros")
        model.set_attn_implementation(NO_ATTENTION_IMPLEMENTATION)
        return model
    plan = student_plan(model, name, args.feature_dim, args.window)
    convert(model, plan)
    if args.position_period:
        set_position_period(model, args.position_period)
    if args.sinks_at_edge and any(layer.sinks for layer in plan.layers):
        set_sinks_at_edge(model, True)
    log(f"{name}: {plan.layers[0].cell} cell, kind {plan.layers[0].kind}")
    return model


def measure_in_process(model, name: str, args, log) -> list[dict]:
    """Every row of one model in this process, one after the other (``--isolate none``)."""
    previous = model.config._attn_implementation
    prepared_model(model, name, args, log)
    try:
        warm_up(model, args)
        return [measure_row(model, name, *setting, args, log) for setting in row_settings(args, name)]
    finally:
        if name in NO_ATTENTION_MODELS:
            model.set_attn_implementation(previous)
        elif name not in TEACHERS:
            unconvert(model)


ROW_FLAG = "--row"


def measure_isolated(name: str, args, log) -> list[dict]:
    """Every row of one model, each in a fresh Python process that loads the model, warms up and measures
    that row alone: no row inherits the memory another row left behind (a teacher's decode after its 16k
    prefill was measured at a third of its speed alone). A process that dies (e.g. killed by the kernel
    for memory) gives a row with ``error="memory"`` and the run goes on."""
    rows = []
    for phase, batch, context in row_settings(args, name):
        spec = json.dumps(dict(model=name, phase=phase, batch=batch, context=context))
        command = [sys.executable, str(Path(__file__).resolve()), *args.argv, ROW_FLAG, spec]
        completed = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        base = dict(model=name, phase=phase, batch=batch, context=context)
        if completed.returncode != 0:
            reason = "killed" if completed.returncode < 0 else f"exit status {completed.returncode}"
            log(f"  skipped {name} {phase} batch {batch} context {context}: its process stopped ({reason})")
            rows.append(dict(base, error="memory" if completed.returncode < 0 else "failed"))
            continue
        rows.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    return rows


def run_one_row(model, spec: str, args, log) -> int:
    """The child side of ``measure_isolated``: measure the row ``spec`` and print it as one JSON line."""
    row = json.loads(spec)
    prepared_model(model, row["model"], args, log)
    warm_up(model, args)
    result = measure_row(model, row["model"], row["phase"], row["batch"], row["context"], args, log)
    print(json.dumps(dict(result, process=os.getpid())))
    return 0


def row_key(row: dict) -> tuple:
    return row["model"], row["phase"], row["batch"], row["context"]


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (model, phase, batch, context) from ``--repeats`` rounds: the sample with the median
    tokens/s (the lower one of an even count), with every sample's tokens/s under ``samples``; a setting
    with no measured sample keeps its first (error) row."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row_key(row), []).append(row)
    combined = []
    for samples in grouped.values():
        measured = sorted(
            (row for row in samples if "tokens_per_second" in row), key=lambda row: row["tokens_per_second"]
        )
        if len(samples) == 1 or not measured:
            combined.append(samples[0])
            continue
        median = measured[(len(measured) - 1) // 2]
        combined.append(dict(median, samples=[row["tokens_per_second"] for row in measured]))
    return combined


def _row(rows, model, phase, batch, context):
    for row in rows:
        if row_key(row) == (model, phase, batch, context):
            return row
    return None


def _ratio(row, teacher, key):
    if row is None or teacher is None or key not in row or key not in teacher:
        return "-"
    return f"{row[key] / teacher[key]:.2f}x"


def _missing(row) -> str:
    """What a table shows for a row without a figure."""
    if row is None:
        return "-"
    return "failed" if row.get("error") == "failed" else "does not fit"


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:,.2f}"


def phase_title(phase: str) -> str:
    chunk = phase_chunk(phase)
    return "Prefill, one forward" if chunk is None else f"Prefill in pieces of {chunk} tokens"


def _best_prefill_table(rows, models, args) -> list[str]:
    """Each model's faster prefill (one forward or pieces) against the teacher's faster one."""
    lines = ["### Prefill (batch 1): each model's faster way against the teacher's faster way", ""]
    lines += ["| model | " + " | ".join(f"{c} tok/s | way | ratio" for c in args.contexts) + " |"]
    lines.append("|---|" + "---:|---|---:|" * len(args.contexts))

    def best(model, context):
        found = [_row(rows, model, phase, 1, context) for phase in prefill_phases(args)]
        found = [row for row in found if row is not None and "tokens_per_second" in row]
        return max(found, key=lambda row: row["tokens_per_second"], default=None)

    for model in models:
        cells = []
        for context in args.contexts:
            row, teacher = best(model, context), best(TEACHER, context)
            if row is None:
                cells += ["-", "-", "-"]
            else:
                way = (
                    "one forward"
                    if phase_chunk(row["phase"]) is None
                    else f"pieces of {phase_chunk(row['phase'])}"
                )
                cells += [f"{row['tokens_per_second']:.0f}", way, _ratio(row, teacher, "tokens_per_second")]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def tables(rows: list[dict], models: list[str], args) -> str:
    """The markdown tables: prefill, decode (per batch), memory, and the non-uniform vs fix comparison."""
    header = "| model | " + " | ".join(f"{c} tok/s | ratio" for c in args.contexts) + " |"
    lines = []
    for phase in prefill_phases(args):
        lines += [
            f"### {phase_title(phase)} (batch 1): tokens/s and ratio to the teacher's same prefill",
            "",
        ]
        lines += [header, "|---|" + "---:|---:|" * len(args.contexts)]
        for model in models:
            cells = []
            for context in args.contexts:
                row, teacher = _row(rows, model, phase, 1, context), _row(rows, TEACHER, phase, 1, context)
                if row is None or "tokens_per_second" not in row:
                    cells += [_missing(row), "-"]
                else:
                    cells += [f"{row['tokens_per_second']:.0f}", _ratio(row, teacher, "tokens_per_second")]
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
        lines.append("")
    if len(args.prefill_chunks) > 1:
        lines += _best_prefill_table(rows, models, args)
    lines = lines[:-1]
    for batch in args.batches:
        lines += ["", f"### Decode, batch {batch}: tokens/s (all rows together) and ratio to the teacher", ""]
        lines += [header, "|---|" + "---:|---:|" * len(args.contexts)]
        for model in models:
            cells = []
            for context in args.contexts:
                row = _row(rows, model, "decode", batch, context)
                teacher = _row(rows, TEACHER, "decode", batch, context)
                if row is None or "tokens_per_second" not in row:
                    cells += [_missing(row), "-"]
                else:
                    cells += [f"{row['tokens_per_second']:.1f}", _ratio(row, teacher, "tokens_per_second")]
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    big = max(args.batches)
    memory = [
        ("decode", big, "cache_bytes", f"decode batch {big}: cache/state MiB (teacher's ÷ student's)"),
        ("decode", big, "peak_bytes", f"decode batch {big}: peak MiB above the loaded model"),
    ] + [
        (phase, 1, "peak_bytes", f"{phase_title(phase).lower()} batch 1: peak MiB above the loaded model")
        for phase in prefill_phases(args)
    ]
    for phase, batch, key, title in memory:
        lines += ["", f"### {title}", "", "| model | " + " | ".join(str(c) for c in args.contexts) + " |"]
        lines.append("|---|" + "---:|" * len(args.contexts))
        for model in models:
            cells = []
            for context in args.contexts:
                row, teacher = (
                    _row(rows, model, phase, batch, context),
                    _row(rows, TEACHER, phase, batch, context),
                )
                if row is None or row.get(key) is None:
                    cells.append("-")
                elif key == "cache_bytes" and model != TEACHER and teacher and teacher.get(key) and row[key]:
                    cells.append(f"{_mib(row[key])} ({teacher[key] / row[key]:.0f}x)")
                else:
                    cells.append(_mib(row[key]))
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    settings = [(phase, 1, c) for phase in prefill_phases(args) for c in args.contexts] + [
        ("decode", b, c) for b in args.batches for c in args.contexts
    ]
    if "linear" in models and "linear 32/96" in models:
        lines += [
            "",
            "### Non-uniform allocation (layers alternating 32/96 features) vs fix (64 everywhere)",
            "",
        ]
        lines += ["| setting | fix tok/s | 32/96 tok/s | 32/96 ÷ fix |", "|---|---:|---:|---:|"]
        for phase, batch, context in settings:
            fix, mixed = (
                _row(rows, "linear", phase, batch, context),
                _row(rows, "linear 32/96", phase, batch, context),
            )
            if fix and mixed and "tokens_per_second" in fix and "tokens_per_second" in mixed:
                lines.append(
                    f"| {phase} B{batch} {context} | {fix['tokens_per_second']:.1f} | "
                    f"{mixed['tokens_per_second']:.1f} | {mixed['tokens_per_second'] / fix['tokens_per_second']:.3f} |"
                )
    return "\n".join(lines + spread_table(rows, models))


def spread_table(rows: list[dict], models: list[str]) -> list[str]:
    """With ``--repeats``: each row's tokens/s over its samples and its ratio range against the teacher's
    median (the tables above use the medians)."""
    repeated = [row for row in rows if len(row.get("samples", ())) > 1]
    if not repeated:
        return []
    lines = [
        "",
        "### Spread over the repeats: tokens/s min / median / max, and ratio to the teacher's median",
        "",
        "| model | phase | batch | context | samples | tok/s min / median / max | x teacher min - max |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in sorted(repeated, key=lambda row: (models.index(row["model"]), *row_key(row)[1:])):
        samples = row["samples"]
        teacher = _row(rows, TEACHER, row["phase"], row["batch"], row["context"])
        ratio = "-"
        if teacher is not None and "tokens_per_second" in teacher:
            base = teacher["tokens_per_second"]
            ratio = f"{samples[0] / base:.2f}x - {samples[-1] / base:.2f}x"
        lines.append(
            f"| {row['model']} | {row['phase']} | {row['batch']} | {row['context']} | {len(samples)} | "
            f"{samples[0]:.1f} / {row['tokens_per_second']:.1f} / {samples[-1]:.1f} | {ratio} |"
        )
    return lines


def plot(rows: list[dict], models: list[str], args, path: Path) -> None:
    """tokens/s (prefill, decode per batch) and memory (state, peak) against context, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(phase, 1, "tokens_per_second", f"{phase} tok/s (B=1)") for phase in prefill_phases(args)]
    panels += [("decode", b, "tokens_per_second", f"decode tok/s (B={b})") for b in args.batches]
    panels += [
        ("decode", max(args.batches), "cache_bytes", f"cache/state MiB (decode, B={max(args.batches)})")
    ]
    panels += [
        ("decode", max(args.batches), "peak_bytes", f"peak MiB above model (decode, B={max(args.batches)})")
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), layout="constrained")
    for axis, (phase, batch, key, title) in zip(axes, panels, strict=True):
        for model in models:
            points = [
                (row["context"], row[key] / (MIB if key.endswith("bytes") else 1.0))
                for row in rows
                if row["model"] == model and row["phase"] == phase and row["batch"] == batch and row.get(key)
            ]
            if points:
                style = dict(color="black", linewidth=2.5) if model == TEACHER else {}
                axis.plot(*zip(*points, strict=True), marker="o", label=model, **style)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context (tokens)")
        axis.set_title(title, fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
    handles = {
        label: handle
        for axis in axes
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True)
    }
    if handles:
        figure.legend(
            handles.values(), handles.keys(), loc="outside lower center", ncol=len(handles), fontsize=8
        )
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher", default="smollm2-135m", help="embedded teacher name (or a path)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke test)")
    parser.add_argument("--contexts", default="1024,4096,16384", help="comma-separated context lengths")
    parser.add_argument("--batches", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument(
        "--cells",
        default=",".join([TEACHER_IN_PLACE, *DEFAULT_STUDENTS]),
        help=f"students: {', '.join(STUDENTS)} (each also as 'NAME{WHOLE_SUFFIX}', "
        "decode rows); or "
        f"{' or '.join(map(repr, PSEUDO_MODELS))}",
    )
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument(
        "--position-period",
        type=int,
        default=0,
        help="the students' memories read rotary positions modulo this many tokens (what linearize gives "
        "rotary models by default: the trained length; 0: true positions)",
    )
    parser.add_argument(
        "--sinks-at-edge",
        action="store_true",
        help="the students' windows see their sinks from the window's edge (plan option sinks_at_edge)",
    )
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument(
        "--steps", type=int, default=16, help="timed decode steps per row after one warm-up step (0: by time)"
    )
    parser.add_argument(
        "--seconds-per-row", type=float, default=4.0, help="decode time per row with --steps 0"
    )
    parser.add_argument(
        "--prefill-chunks",
        default="0,2048",
        help="comma-separated prefill ways: 0 = one forward, N = the prompt in pieces of N tokens (as "
        "generate(prefill_chunk_size=N)); each model is measured every way",
    )
    parser.add_argument("--decode-only", action="store_true", help="decode rows only (no prefill rows)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="1k context only, batch 1 and 2, 2 decode steps")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for speed.json and the plot")
    parser.add_argument("--plot", default=str(REPOSITORY / "docs" / "results" / "speed" / "speed.png"))
    parser.add_argument(
        "--isolate",
        choices=("rows", "none"),
        default="rows",
        help="rows: every row in its own process (default); none: all rows of a model in this process",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over every row (the models interleaved round by round); tables give each row's median "
        "sample and a table of the spread",
    )
    parser.add_argument(ROW_FLAG, default=None, help=argparse.SUPPRESS)  # internal: one row, printed as JSON
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.quick:
        args.contexts, args.batches, args.steps, args.prefill_chunks = "1024", "1,2", 2, "0"
    args.contexts = [int(c) for c in str(args.contexts).split(",")]
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.prefill_chunks = [int(c) for c in str(args.prefill_chunks).split(",")]
    names = [name.strip() for name in args.cells.split(",") if name.strip()]
    unknown = [name for name in names if not known_model(name)]
    if unknown:
        parser.error(f"unknown student {unknown[0]!r}; known: {', '.join([*STUDENTS, *PSEUDO_MODELS])}")

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    if args.row is not None:
        return run_one_row(build_model(args), args.row, args, log)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    models = [TEACHER, *names]
    rows = []
    model = build_model(args) if args.isolate == "none" else None
    for round_index in range(args.repeats):
        if args.repeats > 1:
            log(f"round {round_index + 1} of {args.repeats}")
        for name in models:
            if model is None:
                rows += measure_isolated(name, args, log)
            else:
                rows += measure_in_process(model, name, args, log)
                # a tiny model leaves nothing worth 0.5 s of collection
                release_freed_memory(collect=not args.tiny)
    samples, rows = rows, median_rows(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = Path(args.plot)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, models, args, plot_path)
    record = {"args": vars(args), "rows": rows, **({"samples": samples} if args.repeats > 1 else {})}
    (out / "speed.json").write_text(json.dumps(record, indent=1, default=str))

    print(f"command: {' '.join([Path(__file__).name, *args.argv])}")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, float32; load average before the run: {load}; "
        f"run took {time.time() - started:.0f} s"
    )
    print(
        f"model: {'tiny random Llama' if args.tiny else args.teacher}; students untrained, F={args.feature_dim}, "
        f"window {args.window}"
        f"{f'; students read positions modulo {args.position_period}' if args.position_period else ''}"
        f"{'; windows see their sinks from the edge' if args.sinks_at_edge else ''}"
        "; teacher decode from a synthetic (random) KV cache of the context length; "
        "student decode from a real prefill of twice its window (at least 128 tokens, at most the context) with the "
        "token count set to the context (state size and step work do not depend on it; layers kept as softmax "
        "get random keys and values up to the context); decode: "
        f"{args.steps or 'timed'} steps after 1 warm-up step; "
        f"{f'{args.repeats} rounds, each row its median sample; ' if args.repeats > 1 else ''}"
        f"{'every row in its own process' if args.isolate == 'rows' else 'all rows of a model in one process'}; "
        f"plot: {plot_path.name}\n"
    )
    print(tables(rows, models, args))
    failed = [row for row in samples if row.get("error") == "failed"]
    if failed:
        print(f"{len(failed)} rows failed (their errors are above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
