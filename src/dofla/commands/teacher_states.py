"""``dofla teacher-states MODEL --data FILE --boundaries 0,8,16 --out DIR``: store the teacher's hidden states
once, for layer-sharded distillation (each process then trains its own layers from them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dofla.commands._common import (
    add_model_arguments,
    add_threads_argument,
    check_at_least,
    check_device_and_dtype,
)

STATES_KIND = "teacher states"  # the kind in the marker of the output folder (dofla.outputs)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "teacher-states",
        help="store the teacher's hidden states entering some layers, for layer-sharded distillation",
        description=(
            "Packs --data and splits off held-out sequences exactly as `dofla linearize` does with the same "
            "--seq-len, --eval-lengths, --heldout-fraction, --heldout-sequences and --seed, "
            "and writes OUT/train and OUT/heldout: the hidden state "
            "entering each --boundaries layer for every sequence, with the token ids. A process training layers "
            "a..b reads them with dofla.distill.hidden_store.TeacherStates and passes them to distill(..., "
            "teacher_states=...); `dofla linearize --sharding layers --teacher-states OUT` does so on every "
            "process. Rerunning an interrupted command finishes it."
        ),
    )
    add_model_arguments(parser)
    parser.add_argument("--data", required=True, help="txt, jsonl or a datasets folder")
    parser.add_argument(
        "--boundaries",
        required=True,
        help="comma-separated layer indices, the first layer of each process's shard, e.g. 0,8,16",
    )
    parser.add_argument("--out", required=True, help="output folder (gets train/ and heldout/)")
    parser.add_argument("--seq-len", type=int, default=512, help="training sequence length")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences per teacher forward and per shard"
    )
    parser.add_argument(
        "--store-dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="precision of the stored states (bfloat16 halves the disk)",
    )
    parser.add_argument(
        "--eval-lengths",
        default=None,
        help="as linearize's --eval-lengths (the text is packed at the longest before it is cut to --seq-len; "
        "default: 1024,2048 where the teacher allows)",
    )
    parser.add_argument("--heldout-fraction", type=float, default=0.1, help="share of sequences held out")
    parser.add_argument(
        "--max-heldout",
        "--heldout-sequences",
        dest="max_heldout",
        type=int,
        default=32,
        help="at most this many held-out rows of the longest length (linearize's --heldout-sequences)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the train / held-out split")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def parse_boundaries(text: str, option: str = "--boundaries") -> list[int]:
    """'0,8,16' -> [0, 8, 16]."""
    from dofla.errors import DoflaError

    try:
        boundaries = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        boundaries = []
    if not boundaries:
        raise DoflaError(f"{option} must be comma-separated numbers like 0,8,16, got {text!r}.")
    return boundaries


def run(args: argparse.Namespace) -> int:
    from dofla import outputs
    from dofla.data import check_data_path
    from dofla.errors import DoflaError

    boundaries = parse_boundaries(args.boundaries)
    check_at_least("--max-heldout", args.max_heldout, 1)
    check_at_least("--seq-len", args.seq_len, 2)
    check_at_least("--batch-size", args.batch_size, 1)
    if not 0 < args.heldout_fraction < 1:
        raise DoflaError(
            f"--heldout-fraction must lie strictly between 0 and 1, got {args.heldout_fraction}."
        )
    check_data_path(args.data)
    check_device_and_dtype(args)
    out = outputs.check_output_folder(args.out, STATES_KIND, inputs=[args.model, args.data])
    with outputs.output_lock(out):
        outputs.claim_output_folder(out, STATES_KIND)
        return _write_states(args, boundaries)


def _run_data(args: argparse.Namespace, teacher):
    """The training and held-out rows `dofla linearize` would make from the same data settings."""
    from dofla.run_config import LinearizeConfig
    from dofla.run_data import prepare_data

    lengths = None if args.eval_lengths is None else parse_boundaries(args.eval_lengths, "--eval-lengths")
    settings = dict(
        out_dir=args.out,
        seed=args.seed,
        data=dict(
            path=args.data,
            seq_len=args.seq_len,
            heldout_fraction=args.heldout_fraction,
            heldout_sequences=args.max_heldout,
        ),
        evaluate=dict(lengths=lengths),
    )
    config = LinearizeConfig.from_dict(settings, source="dofla teacher-states")
    cache = Path(args.out) / "data_cache"
    return prepare_data(
        config, teacher.model, teacher.tokenizer, None, cache, whole_data=True
    )  # all the text


def _write_states(args: argparse.Namespace, boundaries: list[int]) -> int:
    from dofla.distill.hidden_store import write_teacher_states
    from dofla.errors import DoflaError
    from dofla.models import load_teacher

    teacher = load_teacher(args.model, dtype=args.dtype, device=args.device)
    if teacher.tokenizer is None:
        raise DoflaError("the teacher has no tokenizer, which packing --data needs.")
    data = _run_data(args, teacher)
    train, heldout = data.train, data.heldout  # (N, T), (M, T)
    out = Path(args.out)
    for name, part in (("train", train), ("heldout", heldout)):
        write_teacher_states(
            teacher.model,
            part,
            out / name,
            boundaries,
            batch_size=args.batch_size,
            dtype=args.store_dtype,
            progress=not args.no_progress,
        )
        print(f"{name}: {len(part)} sequences of {args.seq_len} tokens, layers {boundaries} -> {out / name}")
    return 0
