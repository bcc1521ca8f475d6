"""Attention-transfer training speed against the teacher's own forward, in one run.

Default: the SmolLM2-135M teacher (all 30 layers converted, learnable PRF, feature dim 64, softmax-CE
loss), B = 4, T = 512. Prints training tokens/s (teacher-forced forward + every layer's loss, backward and
AdamW step), the teacher's forward tokens/s at the same shape (the two timed alternately), their ratio (target >= 0.5) and peak memory.
Speed does not depend on the weights' values, so ``--random-weights`` (or a tree without
``dofla.models``) uses random weights of the same shape.

    .venv/bin/python bench/bench_distill.py [--batch-size 4 --seq-len 512 --loss softmax --repeats 3]
    .venv/bin/python bench/bench_distill.py --recipe gated-delta --batch-size 2 --seq-len 1024   # a recipe's
        # students, loss and feature dimension (its plan's kind, cell, map, window, sinks and cell options)
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time

import torch
from bench_generation import SHAPES, recipe_plan_options  # this folder is on the path when the script runs
from transformers import LlamaConfig, LlamaForCausalLM

from dofla import dispatch
from dofla.convert import convert, plan_for
from dofla.distill.graphed import LayerLossGraphs
from dofla.distill.losses import layerwise_loss_names
from dofla.distill.teacher_forcing import freeze_teacher, teacher_forced_step
from dofla.models.surgery import autocast_for
from dofla.recipes import RECIPES

SMOLLM2_135M = dict(
    SHAPES["smollm2-135m"],
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def build_teacher(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    if not args.random_weights:
        try:
            from dofla.models import load_teacher
        except ImportError:
            load_teacher = None
        if load_teacher is not None:
            model = load_teacher("smollm2-135m", dtype="float32", device=args.device).model
            return model.eval(), "smollm2-135m (embedded teacher)"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(args.device).eval()
    return model, "random weights, SmolLM2-135M shape"


def interleaved_seconds(functions: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call of each function, timed alternately (one warm-up call each first), so a
    change of machine load during the run affects all of them alike."""
    for function in functions.values():
        function()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            function()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB (whole process)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--feature-map", default="learnable_prf")
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument("--loss", default="softmax", choices=layerwise_loss_names())
    parser.add_argument("--query-chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument(
        "--recipe",
        default=None,
        choices=sorted(RECIPES),
        help="a recipe's students, loss and budget (overrides those flags)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay each layer's loss and backward from CUDA graphs (dofla.distill.graphed; CUDA only)",
    )
    parser.add_argument("--json", default=None, help="also write the row to this JSON file")
    args = parser.parse_args()
    plan_options = recipe_plan_options(args)
    if args.recipe is not None:
        args.loss = RECIPES[args.recipe].get("distill", {}).get("loss", args.loss)
    device = torch.device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        parser.error("--cuda-graphs replays CUDA graphs: it needs --device cuda")

    teacher, source = build_teacher(args)
    vocab = teacher.config.vocab_size
    tokens = torch.randint(
        0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0)
    )
    tokens = tokens.to(device)
    count = tokens.numel()

    def teacher_forward():  # converted layers run the teacher's softmax here: the teacher's own forward
        with torch.no_grad(), dispatch.teacher_forced(), autocast_for(device):
            teacher(input_ids=tokens, use_cache=False)

    convert(
        teacher, plan_for(teacher, feature_map=args.feature_map, feature_dim=args.feature_dim, **plan_options)
    )
    students = freeze_teacher(teacher)
    groups = [group for index in sorted(students) for group in students[index].parameter_groups(1e-2)]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)

    graphs = LayerLossGraphs(args.loss, query_chunk=args.query_chunk) if args.cuda_graphs else None

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        teacher_forced_step(
            teacher, tokens, students, args.loss, backward=True, query_chunk=args.query_chunk, graphs=graphs
        )
        torch.nn.utils.clip_grad_norm_([p for s in students.values() for p in s.parameters()], 1.0)
        optimizer.step()

    seconds = interleaved_seconds({"teacher": teacher_forward, "train": train_step}, args.repeats, device)
    teacher_seconds, train_seconds = seconds["teacher"], seconds["train"]
    row = dict(
        teacher=source,
        device=str(device),
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        layers=len(students),
        recipe=args.recipe,
        plan=plan_options,
        feature_map=args.feature_map,
        feature_dim=args.feature_dim,
        loss=args.loss,
        cuda_graphs=args.cuda_graphs,
        teacher_forward_tokens_per_s=round(count / teacher_seconds, 1),
        train_tokens_per_s=round(count / train_seconds, 1),
        ratio=round(teacher_seconds / train_seconds, 3),
        peak_memory_mib=round(peak_memory_mib(device), 1),
    )
    print(
        f"{source}, {device}, {torch.get_num_threads()} threads, B={args.batch_size} T={args.seq_len}, "
        f"{len(students)} layers {args.feature_map} F={args.feature_dim}, loss {args.loss}"
        + (", CUDA graphs" if args.cuda_graphs else "")
        + (f", recipe {args.recipe}: {plan_options}" if args.recipe else "")
    )
    print(f"teacher forward      {row['teacher_forward_tokens_per_s']:10.1f} tokens/s")
    print(f"attention transfer   {row['train_tokens_per_s']:10.1f} tokens/s")
    print(f"ratio (train/fwd)    {row['ratio']:10.3f}   (target >= 0.5)")
    print(
        f"peak memory          {row['peak_memory_mib']:10.1f} MiB ({'CUDA allocated' if device.type == 'cuda' else 'process RSS'})"
    )
    if args.json:
        from dofla.io import write_text_atomic

        write_text_atomic(args.json, json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
