"""Prefill and decode speed and cache memory: softmax teacher vs its linear-attention conversion.

Both models are measured in the same run at the same shapes; the script prints ratios.
Speed and memory do not depend on the weights' values, so ``--shape`` builds a randomly initialised
model of a known architecture (useful where the real weights cannot be loaded, e.g. on a remote GPU);
the default loads the embedded teacher itself.

    python bench/bench_generation.py                          # embedded SmolLM2-135M, CPU, float32
    python bench/bench_generation.py --shape llama-1b --device cuda --contexts 4096,16384,65536
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from timing import time_prefill
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from dofla.commands._config_flags import key_values
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.evaluation.speed import measure_generation, random_prompt
from dofla.recipes import RECIPES, plan_for_arguments

LLAMA_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def llama_shape(*sizes: int) -> dict:
    """Keyword arguments of a ``LlamaConfig`` with these ``LLAMA_SIZES`` (head size 64, 128k positions)."""
    return dict(zip(LLAMA_SIZES, sizes, strict=True), head_dim=64, max_position_embeddings=131072)


SHAPES = {
    # Architecture shapes only (no weights): sizes as published in the models' configs.
    "smollm2-135m": llama_shape(576, 1536, 30, 9, 3, 49152),
    "llama-1b": llama_shape(2048, 8192, 16, 32, 8, 128256),
}


def recipe_plan_options(args: argparse.Namespace) -> dict:
    """With ``--recipe``: its plan's kind, cell, window, sinks and cell options for ``plan_for`` (and its
    feature map and budget into ``args``); without, {} (the flags' plan)."""
    if args.recipe is None:
        if args.window is not None or args.cell_options:
            raise SystemExit("--window and --cell-options change a recipe's students: give --recipe too.")
        return {}
    options = plan_for_arguments(args.recipe)
    options.pop("keep_softmax", None)  # --softmax-layers names the kept layers
    args.feature_map = options.pop("feature_map", args.feature_map)
    args.feature_dim = options.pop("feature_dim", args.feature_dim)
    if args.window is not None:
        options["window"] = args.window
    try:  # the syntax of dofla's own --cell-options
        options["options"].update(key_values("--cell-options", args.cell_options or ""))
    except DoflaError as error:
        raise SystemExit(str(error)) from None
    return options


def student_plan(model, args: argparse.Namespace, plan_options: dict):
    """(the student's plan, the layers it keeps as full softmax): every layer but ``--softmax-layers``
    converted as the flags or the recipe say."""
    kept = sorted({int(layer) for layer in args.softmax_layers.split(",")}) if args.softmax_layers else []
    converted = [layer for layer in range(model.config.num_hidden_layers) if layer not in kept]
    plan = plan_for(
        model, feature_map=args.feature_map, feature_dim=args.feature_dim, layers=converted, **plan_options
    )
    return plan, kept


def build_teacher(args: argparse.Namespace) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.shape:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape], tie_word_embeddings=True))
        return model.to(device=args.device, dtype=dtype).eval()
    from dofla.models import load_teacher

    return load_teacher("smollm2-135m", dtype=args.dtype, device=args.device).model


def fitting(measure, *args, **kwargs):
    """``measure(*args, **kwargs)``, or the out-of-memory error it raised (the GPU's cached blocks released,
    so the next row starts clean)."""
    try:
        return measure(*args, **kwargs)
    except torch.OutOfMemoryError as error:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return error


def generation_row(
    model, context: int, batch_size: int, new_tokens: int, graph: bool = False
) -> dict | torch.OutOfMemoryError:
    """``measure_generation``'s row for one context, or the out-of-memory error it raised."""
    return fitting(
        lambda: measure_generation(
            model, context_lengths=[context], batch_size=batch_size, new_tokens=new_tokens, graph=graph
        )[0]
    )


def warm_up(model, contexts: list[int], args, graph: bool = False) -> None:
    """One short generation at every context (kernels compiled and tuned for each length, e.g. Triton's
    autotuning on a GPU, before any timed row); a context that does not fit is left to ``measure_rows``."""
    for context in contexts:
        generation_row(model, context, args.batch_size, 2, graph)


def measure_rows(
    model, contexts: list[int], args, who: str, graph: bool = False, static: bool = False
) -> list[dict | None]:
    """``measure_generation`` (``static``: ``static_teacher_row``) one context at a time: a context that does
    not fit in memory gives None (and one line on stderr) and the others are still measured."""
    rows = []
    for context in contexts:
        if static:
            row = fitting(static_teacher_row, model, context, args.batch_size, args.new_tokens)
        else:
            row = generation_row(model, context, args.batch_size, args.new_tokens, graph)
        if isinstance(row, torch.OutOfMemoryError):
            print(
                f"{who} at {context} tokens, batch {args.batch_size}: out of memory ({row})", file=sys.stderr
            )
            row = None
        rows.append(row)
    return rows


class _StepClock:
    """A logits processor that only notes the time (device synchronised) each decoding step reaches it."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def static_teacher_row(model, context: int, batch_size: int, new_tokens: int) -> dict:
    """The teacher's greedy decoding as ``generate`` runs it with a static KV cache, which transformers
    compiles (torch.compile with CUDA graphs) on CUDA: the strongest decoding of the teacher this library
    does not write itself. One untimed generation first (compilation); decode tokens/s from the times
    between the steps of a second (the prefill excluded)."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    prompt = random_prompt(model, batch_size, context, torch.Generator().manual_seed(0))
    clock = _StepClock(device)
    options = dict(
        max_new_tokens=new_tokens + 1,
        min_new_tokens=new_tokens + 1,
        do_sample=False,
        cache_implementation="static",
        logits_processor=LogitsProcessorList([clock]),
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)  # compiles
        clock.times.clear()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    steps = len(clock.times) - 1  # the first time is the prefill's end
    return {
        "context": context,
        "batch_size": batch_size,
        "decode_tokens_per_second": batch_size * steps / (clock.times[-1] - clock.times[0]),
        "compiled": bool(device.type == "cuda"),
    }


def ceiling_rows(model, contexts: list[int], args) -> list[dict | None]:
    """The teacher's prefill with its attention replaced by zeros (``bench_speed``'s ``no attention``
    model), one context at a time after one untimed prefill: the ceiling of any student that keeps the
    teacher's projections, norms and MLP. None where it did not fit in memory."""
    from bench_speed import NO_ATTENTION_IMPLEMENTATION

    previous = model.config._attn_implementation
    model.set_attn_implementation(NO_ATTENTION_IMPLEMENTATION)
    try:
        rows = []
        for context in contexts:
            fitting(time_prefill, model, args.batch_size, context)
            row = fitting(time_prefill, model, args.batch_size, context)
            rows.append(None if isinstance(row, torch.OutOfMemoryError) else row)
        return rows
    finally:
        model.set_attn_implementation(previous)


def profile_prefill(model, context: int, args, top: int = 15) -> str:
    """torch.profiler's top operators of one batch-1 prefill of ``context`` random tokens (by self device
    time on a GPU, self CPU time otherwise) and the aten calls per layer: what the prefill spends its time on."""
    from torch.profiler import ProfilerActivity, profile

    from dofla.prefill import prefill

    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prompt = random_prompt(model, 1, context, torch.Generator().manual_seed(1))
    with torch.no_grad(), profile(activities=activities) as profiler:
        prefill(model, prompt, DynamicCache(config=model.config))
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = profiler.key_averages()
    layers = model.config.get_text_config().num_hidden_layers
    calls = sum(event.count for event in events if event.key.startswith("aten::"))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    device_total = sum(event.self_device_time_total for event in events) / 1e3
    by_host = "" if device.type != "cuda" else events.table(sort_by="self_cpu_time_total", row_limit=top)
    return (
        f"student prefill of {context} tokens, batch 1: {calls / layers:.0f} aten calls per layer, "
        f"{device_total:.1f} ms of device time in all\n" + events.table(sort_by=sort, row_limit=top) + by_host
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated prompt lengths")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--feature-map", default="learnable_prf")
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument("--kind", default="linear", choices=("linear", "hybrid"))
    parser.add_argument(
        "--recipe",
        default=None,
        choices=sorted(RECIPES),
        help="a recipe's students (its kind, cell, feature map, budget, window, sinks and cell options)",
    )
    parser.add_argument(
        "--window", type=int, default=None, help="with --recipe: its students' window instead"
    )
    parser.add_argument(
        "--cell-options",
        default=None,
        metavar="KEY=VALUE,...",
        help="with --recipe: set some of its cell options, as dofla's --cell-options (e.g. heavy_hitters=80)",
    )
    parser.add_argument(
        "--softmax-layers",
        default=None,
        help="comma-separated layers the student keeps as full softmax, with their KV cache (e.g. the layers "
        "a gated-delta-retrieval run kept; the speed does not depend on the weights); default: none",
    )
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument(
        "--profile", action="store_true", help="also print the student prefill's top operators (stderr)"
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="also decode the student through dofla.graph_decode (a CUDA graph on CUDA)",
    )
    parser.add_argument(
        "--teacher-static",
        action="store_true",
        help="also time the teacher's decoding through generate with a static cache (compiled, CUDA graphs, "
        "on CUDA): the graph rows' fairer reference",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also time the teacher's prefill with its attention replaced by zeros: the most any student "
        "keeping the teacher's projections and MLP can reach",
    )
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    contexts = [int(c) for c in args.contexts.split(",")]
    plan_options = recipe_plan_options(args) or dict(kind=args.kind)

    model = build_teacher(args)
    warm_up(model, contexts, args)
    teacher_rows = measure_rows(model, contexts, args, "teacher")
    static_rows = [None] * len(contexts)
    if args.teacher_static:
        static_rows = measure_rows(model, contexts, args, "teacher (static cache)", static=True)
    bound_rows = ceiling_rows(model, contexts, args) if args.ceiling else [None] * len(contexts)
    plan, kept = student_plan(model, args, plan_options)
    convert(model, plan)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    warm_up(model, contexts, args)
    student_rows = measure_rows(model, contexts, args, "student")
    graph_rows = [None] * len(contexts)
    if args.graph:
        warm_up(model, contexts, args, graph=True)
        graph_rows = measure_rows(model, contexts, args, "student (graph)", graph=True)
    if args.profile:
        print(profile_prefill(model, contexts[0], args), file=sys.stderr)

    print(f"command: {' '.join(sys.argv)}")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, device {args.device}, dtype {args.dtype}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(
        f"model: {args.shape or 'smollm2-135m (embedded weights)'}; student: "
        + (f"recipe {args.recipe} {plan_options}, " if args.recipe else f"{args.kind}, ")
        + f"{args.feature_map}, F={args.feature_dim} in "
        + (f"every layer but {kept} (full softmax)" if kept else "every layer")
        + f"; batch {args.batch_size}, "
        f"{args.new_tokens} decoded tokens\n"
    )
    print(
        "| context | prefill tok/s teacher | student | ratio | decode tok/s teacher | student | ratio "
        "| cache MiB teacher | student |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for context, teacher, student in zip(contexts, teacher_rows, student_rows, strict=True):
        if teacher is None or student is None:
            print(f"| {context} | {'teacher' if teacher is None else 'student'} did not fit in memory |")
            continue
        mib = 2.0**20
        print(
            f"| {teacher['context']} | {teacher['prefill_tokens_per_second']:.0f} | "
            f"{student['prefill_tokens_per_second']:.0f} | "
            f"{student['prefill_tokens_per_second'] / teacher['prefill_tokens_per_second']:.2f}x | "
            f"{teacher['decode_tokens_per_second']:.1f} | {student['decode_tokens_per_second']:.1f} | "
            f"{student['decode_tokens_per_second'] / teacher['decode_tokens_per_second']:.2f}x | "
            f"{teacher['cache_bytes_after_decode'] / mib:.1f} | {student['cache_bytes_after_decode'] / mib:.2f} |"
        )
    if args.graph:
        print(
            "\nstudent decoding through dofla.graph_decode (the teacher as above: transformers' decoding, "
            "DynamicCache, no graph)\n\n| context | decode tok/s teacher | student graph | ratio | capture s |"
            "\n|---:|---:|---:|---:|---:|"
        )
        for context, teacher, graphed in zip(contexts, teacher_rows, graph_rows, strict=True):
            if teacher is None or graphed is None:
                print(f"| {context} | did not fit in memory |")
                continue
            print(
                f"| {context} | {teacher['decode_tokens_per_second']:.1f} | "
                f"{graphed['decode_tokens_per_second']:.1f} | "
                f"{graphed['decode_tokens_per_second'] / teacher['decode_tokens_per_second']:.2f}x | "
                f"{graphed['capture_seconds']:.2f} |"
            )
    if args.teacher_static:
        print(
            "\nthe teacher decoding through generate with a static cache (compiled by transformers on CUDA: "
            "CUDA graphs; not compiled on the CPU)\n\n| context | decode tok/s teacher static | student | ratio "
            "| student graph | ratio |\n|---:|---:|---:|---:|---:|---:|"
        )
        for context, static, student, graphed in zip(
            contexts, static_rows, student_rows, graph_rows, strict=True
        ):
            if static is None or student is None:
                print(f"| {context} | did not fit in memory |")
                continue
            rate = static["decode_tokens_per_second"]
            graph_cells = (
                "- | - |"
                if graphed is None
                else f"{graphed['decode_tokens_per_second']:.1f} | "
                f"{graphed['decode_tokens_per_second'] / rate:.2f}x |"
            )
            print(
                f"| {context} | {rate:.1f} | {student['decode_tokens_per_second']:.1f} | "
                f"{student['decode_tokens_per_second'] / rate:.2f}x | {graph_cells}"
            )
    if args.ceiling:
        print(
            "\nprefill ceiling: the teacher with its attention replaced by zeros (no student that keeps the "
            "teacher's projections, norms and MLP prefills faster)\n\n| context | prefill tok/s teacher | no "
            "attention | ceiling ratio | student ratio | share of the ceiling |\n|---:|---:|---:|---:|---:|---:|"
        )
        for context, teacher, bound, student in zip(
            contexts, teacher_rows, bound_rows, student_rows, strict=True
        ):
            if teacher is None or bound is None or student is None:
                print(f"| {context} | did not fit in memory |")
                continue
            rate, top = teacher["prefill_tokens_per_second"], bound["tokens_per_second"]
            mine = student["prefill_tokens_per_second"]
            print(
                f"| {context} | {rate:.0f} | {top:.0f} | {top / rate:.2f}x | {mine / rate:.2f}x | {mine / top:.2f} |"
            )
    if args.json:
        with open(args.json, "w") as stream:
            rows = {"teacher": teacher_rows, "student": student_rows, "student_graph": graph_rows}
            rows["teacher_static"], rows["no_attention"] = static_rows, bound_rows
            json.dump({**rows, "args": vars(args)}, stream, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
