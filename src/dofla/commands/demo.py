"""``dofla demo``: the main job on the embedded default teacher, sized for a 2-core CPU.

Measures DoF, allocates feature dimensions, converts, distils, evaluates against the teacher,
saves the model, writes a report, and finally generates a sentence with the saved model.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    from dofla.commands._common import add_threads_argument

    parser = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on the embedded default teacher (SmolLM2-135M), CPU-sized",
        description="Linearize the embedded SmolLM2-135M with a small token budget on real text shipped with "
        "dofla (trained on web text, measured on encyclopedia text it never saw) and print where the report is.",
    )
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted demo from its checkpoint (done by itself when --out holds one)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="discard an earlier demo run in --out and start over"
    )
    parser.add_argument(
        "--data",
        default=None,
        help="distillation text (default: 100 web documents shipped with dofla); held-out rows are then split "
        "off it unless --heldout-data is given",
    )
    parser.add_argument(
        "--heldout-data",
        default=None,
        help="held-out text of another source (default: three Wikipedia articles shipped with dofla, when "
        "--data is not given)",
    )
    parser.add_argument(
        "--prompt", default="The history of the city begins", help="prompt for the final sample"
    )
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dofla.demo import demo_config
    from dofla.loading import load_converted
    from dofla.pipeline import linearize

    config = demo_config(Path(args.out))
    config.overwrite = args.overwrite
    checkpoint = Path(args.out) / "distill" / "checkpoints" / "latest.json"
    if args.resume or (checkpoint.is_file() and not args.overwrite):
        if not args.resume:
            print(f"continuing the demo run in {args.out} (pass --overwrite to start over)")
        config.resume = True
    if args.data is not None:  # '' too: refused, not read as the current folder
        config.data.path = args.data
        config.data.heldout_path = None  # the shipped held-out text could be the text given
    if args.heldout_data is not None:
        config.data.heldout_path = args.heldout_data
    result = linearize(config)
    print(f"\nreport: {result.report_path}")
    print(f"held-out perplexity: teacher {result.teacher_ppl:.2f}, student {result.student_ppl:.2f}")
    if result.lora_teacher_ppl is not None:
        print(
            f"teacher after the same LoRA stage: {result.lora_teacher_ppl:.2f} (the LoRA stage also adapts to "
            "the text; compare the student with this too)"
        )

    model, tokenizer, _ = load_converted(result.out_dir)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    print(f"student says: {tokenizer.decode(output[0], skip_special_tokens=True)}")
    return 0
