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
        "transformers' AutoModelForCausalLM opens without dofla, ending with one all-zero attention layer "
        "(an exact identity; see --all-linear). Anything that does not map exactly is "
        "refused, naming what differs, with nothing written.",
    )
    parser.add_argument("converted", help="folder written by `dofla convert` or `dofla linearize`")
    parser.add_argument("--out", required=True, help="new or empty folder for the exported checkpoint")
    parser.add_argument(
        "--all-linear",
        action="store_true",
        help="write the converted layers alone (layer_types all linear_attention), without the all-zero "
        "attention layer the export otherwise ends with (an exact identity that lets transformers' generate "
        "use its cache and llama.cpp's runtime run the model; neither runs an all-linear Qwen3.5 today)",
    )
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dofla.export import export_folder

    out = export_folder(args.converted, args.out, all_linear=args.all_linear)
    print(f"exported {args.converted} as a qwen3_5_text checkpoint to {out}")
    return 0
