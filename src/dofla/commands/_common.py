"""Arguments shared by several sub-commands."""

from __future__ import annotations

import argparse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2-135m",
        help="teacher: a Hugging Face model folder, a .gguf file, a hub id, or 'smollm2-135m' (embedded default)",
    )
    parser.add_argument(
        "--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16"
    )
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
