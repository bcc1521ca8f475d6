"""``dofla linearize``: the main job, from a softmax teacher to a saved, evaluated linear-attention model."""

from __future__ import annotations

import argparse
import shlex
import sys

from dofla.commands._common import (
    add_model_arguments,
    add_overwrite_argument,
    check_at_least,
    check_device_and_dtype,
    check_feature_budget,
    integer_list,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "linearize",
        help="DoF -> plan -> convert -> distill (-> LoRA) -> evaluate -> save, with a report",
        description=(
            "Convert a causal LM's softmax attention to linear (or linear + sliding window) attention, "
            "distil it layer by layer from the teacher, evaluate held-out perplexity and write DIR/report.md."
        ),
    )
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, help="output folder (model/, report.md, checkpoints)")
    parser.add_argument(
        "--recipe", default=None, help="preset recipe: dof-paper | lolcats | gated-delta | gla (see README)"
    )
    parser.add_argument(
        "--budget", type=int, default=64, help="mean feature dimension per layer (default 64)"
    )
    parser.add_argument(
        "--allocation",
        choices=["fix", "dof", "dof_clip", "headwise"],
        default=None,
        help="dimension allocation (default dof)",
    )
    parser.add_argument("--measure", default="dof", help="statistical measure for --allocation dof")
    parser.add_argument("--feature-map", default=None, help="learnable_prf (default) | prf | hedgehog | ...")
    parser.add_argument(
        "--kind", choices=["linear", "hybrid"], default=None, help="attention kind (default linear)"
    )
    parser.add_argument(
        "--window", type=int, default=None, help="sliding window of hybrid layers (default 64)"
    )
    parser.add_argument(
        "--cell", default=None, help="student cell: linear (default, LoLCATs) | gla (with forgetting) | ..."
    )
    parser.add_argument(
        "--sinks", type=int, default=None, help="first tokens always visible to the window (default 0)"
    )
    parser.add_argument(
        "--eval-lengths",
        default=None,
        help="comma-separated held-out lengths beyond --seq-len (default 1024,2048 where the teacher allows)",
    )
    parser.add_argument(
        "--heldout-sequences",
        type=int,
        default=32,
        help="held-out rows of the longest length, never trained on (default 32)",
    )
    parser.add_argument(
        "--passkey-trials",
        type=int,
        default=2,
        help="pass-key trials per length and depth in the report (0: no pass-key test)",
    )
    parser.add_argument(
        "--loss",
        choices=["softmax", "l2", "output_mse", "direct"],
        default=None,
        help="distillation loss (default softmax)",
    )
    parser.add_argument(
        "--tokens", default=None, help="distillation token budget, e.g. 2M, 500k (default 2M)"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="training sequence length (default 512)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2, help="base learning rate (maps may set their own)")
    parser.add_argument(
        "--data", default=None, help="txt, jsonl or a datasets folder (default: teacher samples)"
    )
    parser.add_argument(
        "--lora", action="store_true", default=None, help="stage 2: LoRA on next-token loss, merged"
    )
    parser.add_argument("--lora-tokens", default="200k", help="LoRA token budget")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=16)
    parser.add_argument("--lora-targets", default=None, help="comma-separated module names (default q/k/v/o)")
    parser.add_argument(
        "--lora-lr", type=float, default=None, help="LoRA learning rate (default 1e-3; lolcats 3e-3)"
    )
    parser.add_argument(
        "--lora-kl",
        type=float,
        default=None,
        help="LoRA stage: weight of KL to the teacher's logits added to next-token loss (default 0; lolcats 1)",
    )
    parser.add_argument(
        "--lora-baseline",
        action="store_true",
        help="also train the same LoRA stage on the unconverted teacher and report its perplexity "
        "(the LoRA stage adapts to the training text too; this separates the two effects)",
    )
    parser.add_argument(
        "--kl-weight", type=float, default=None, help="--loss direct: weight of KL to the teacher's logits"
    )
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--patience", type=int, default=0, help="early-stopping patience (0 = off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    add_overwrite_argument(parser, "run (model, report, checkpoints)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def token_count(option: str, text: str) -> int:
    """A token budget like 2M, 500k or 100000; refused (one sentence) unless a positive finite count."""
    from dofla.errors import DoflaError
    from dofla.pipeline import parse_tokens

    try:
        tokens = parse_tokens(text)
    except (OverflowError, DoflaError):  # 'inf' overflows int(); 'nan' and words are not numbers
        tokens = None
    if tokens is None or tokens <= 0:
        raise DoflaError(
            f"{option} must be a positive number of tokens like 2M, 500k or 100000, got {text!r}."
        )
    return tokens


def lora_targets(text: str | None) -> list[str] | None:
    from dofla.errors import DoflaError

    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise DoflaError(
            f"--lora-targets must be comma-separated module names like q_proj,v_proj, got {text!r}."
        )
    return names


def config_from_args(args: argparse.Namespace):
    """The :class:`dofla.pipeline.LinearizeConfig` of a parsed command line (options checked on the way)."""
    from dofla.pipeline import LinearizeConfig

    check_feature_budget(args.budget)
    check_at_least("--batch-size", args.batch_size, 1)
    check_at_least("--lora-rank", args.lora_rank, 1)
    check_at_least("--lora-alpha", args.lora_alpha, 1)
    for option in ("eval_every", "checkpoint_every", "patience"):
        check_at_least(f"--{option.replace('_', '-')}", getattr(args, option), 0)
    check_device_and_dtype(args)
    check_at_least("--heldout-sequences", args.heldout_sequences, 1)
    check_at_least("--passkey-trials", args.passkey_trials, 0)

    # Options a recipe presets: only those the user gave explicitly override the recipe.
    recipe_options = (
        "allocation",
        "feature_map",
        "kind",
        "cell",
        "window",
        "sinks",
        "loss",
        "lora",
        "lora_lr",
        "kl_weight",
        "seq_len",
        "tokens",
    )
    explicit = {name: getattr(args, name) for name in recipe_options if getattr(args, name) is not None}
    if args.lora_kl is not None:
        explicit["lora_kl_weight"] = args.lora_kl
    if "tokens" in explicit:
        explicit["tokens"] = token_count("--tokens", explicit["tokens"])
    if "seq_len" in explicit:
        check_at_least("--seq-len", explicit["seq_len"], 2)
    if args.sinks is not None:
        check_at_least("--sinks", args.sinks, 0)
    return LinearizeConfig(
        out_dir=args.out,
        model=args.model,
        recipe=args.recipe,
        budget=args.budget,
        measure=args.measure,
        batch_size=args.batch_size,
        lr=args.lr,
        data=args.data,
        eval_lengths=None
        if args.eval_lengths is None
        else integer_list(args.eval_lengths, "--eval-lengths", minimum=2),
        max_heldout_sequences=args.heldout_sequences,
        passkey_trials=args.passkey_trials,
        lora_tokens=token_count("--lora-tokens", args.lora_tokens),
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=lora_targets(args.lora_targets),
        lora_baseline=args.lora_baseline,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        patience=args.patience,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        command="dofla " + " ".join(shlex.quote(argument) for argument in sys.argv[1:]),
        overrides=sorted(explicit),
        **explicit,
    )


def run(args: argparse.Namespace) -> int:
    from dofla.pipeline import linearize

    result = linearize(config_from_args(args))
    print(f"held-out perplexity: teacher {result.teacher_ppl:.3f}, student {result.student_ppl:.3f}")
    if result.lora_teacher_ppl is not None:
        print(f"teacher after the same LoRA stage: {result.lora_teacher_ppl:.3f}")
    print(f"model:  {result.out_dir}")
    print(f"report: {result.report_path}")
    return 0
