"""``dofla export MODEL --out DIR``: a converted folder written as a standard Qwen3.5 checkpoint."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from dofla.commands._common import add_threads_argument

    parser = subparsers.add_parser(
        "export",
        help="write a converted model as a standard qwen3_5_text checkpoint (runs without dofla)",
        description="Write a folder saved by `dofla convert` or `dofla linearize` whose layers are all the "
        "gated_delta_net cell (recipe `portable`), on a Llama, Qwen2, Qwen3 or Mistral teacher, as a "
        "standard qwen3_5_text checkpoint (config, safetensors, tokenizer, generation config) that "
        "transformers' AutoModelForCausalLM opens without dofla. Anything that does not map exactly is "
        "refused, naming what differs, with nothing written.",
    )
    parser.add_argument("converted", help="folder written by `dofla convert` or `dofla linearize`")
    parser.add_argument("--out", required=True, help="new or empty folder for the exported checkpoint")
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dofla.export import export_folder

    out = export_folder(args.converted, args.out)
    print(f"exported {args.converted} as a qwen3_5_text checkpoint to {out}")
    return 0
