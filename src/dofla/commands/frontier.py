"""``dofla frontier``: a grid of allocations × budgets × softmax layers through ``dofla linearize``, plotted."""

from __future__ import annotations

import argparse
import shlex
import sys

from dofla.commands._common import (
    add_device_arguments,
    add_threads_argument,
    integer_list,
)
from dofla.config import DEFAULT_WINDOW, LayerPlan

FRONTIER_KIND = "frontier grid"  # the kind in the marker of the grid's folder (dofla.outputs)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "frontier",
        help="run a grid of allocations, budgets and softmax layers and plot quality against cost",
        description="Writes OUT/cells/NAME/ (one linearize run per grid cell; finished cells are skipped), "
        "OUT/frontier.json, OUT/frontier.md and OUT/frontier.png.",
    )
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="teacher (as for dofla linearize)")
    parser.add_argument("--out", required=True, help="the grid's folder (an earlier grid there is continued)")
    parser.add_argument("--allocations", default="fix,measured", help="comma-separated allocations")
    parser.add_argument("--budgets", default="32", help="comma-separated mean feature budgets per layer")
    parser.add_argument("--softmax-layers", default="0", help="comma-separated K: layers kept as softmax")
    parser.add_argument(
        "--softmax-choices",
        default="uniform,measured",
        help="how K > 0 layers are chosen (uniform, dof, measured)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a TOML run configuration (e.g. a run's config.toml) every cell shares; the grid sets each cell's "
        "allocation, budget, layers, output folder and evaluation length",
    )
    parser.add_argument("--tokens", default=None, help="distillation tokens per cell (default 20k)")
    parser.add_argument("--seq-len", type=int, default=None, help="training length (default 512)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 4")
    parser.add_argument(
        "--kind", default=None, choices=("linear", "hybrid"), help=f"default {LayerPlan.kind}"
    )
    parser.add_argument("--cell", default=None, help="student cell (default linear)")
    parser.add_argument("--feature-map", default=None, help=f"default {LayerPlan.feature_map}")
    parser.add_argument("--loss", default=None, help="default output_mse")
    parser.add_argument("--window", type=int, default=None, help=f"default {DEFAULT_WINDOW}")
    parser.add_argument("--data", default=None, help="text (default: text sampled from the teacher, cached)")
    parser.add_argument("--heldout-sequences", type=int, default=None, help="held-out rows (default 32)")
    parser.add_argument(
        "--dof-batches",
        type=int,
        default=None,
        help="calibration batches for error curves and DoF (default 2)",
    )
    parser.add_argument("--eval-length", type=int, default=1024, help="held-out length of the frontier")
    parser.add_argument(
        "--decode-tokens", type=int, default=16, help="tokens decoded to time decoding (0: none)"
    )
    parser.add_argument("--seed", type=int, default=None, help="default 0")
    add_device_arguments(parser)
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dofla import outputs
    from dofla.data import check_data_path
    from dofla.frontier import FrontierConfig, run_frontier
    from dofla.run_config import read_settings
    from dofla.setting_values import merge, token_count

    given = dict(
        seed=args.seed,
        teacher=dict(dtype=args.dtype, device=args.device),
        data=dict(path=args.data, seq_len=args.seq_len, heldout_sequences=args.heldout_sequences),
        plan=dict(kind=args.kind, window=args.window, dof_batches=args.dof_batches),
        student=dict(cell=args.cell, feature_map=args.feature_map),
        distill=dict(
            tokens=None if args.tokens is None else token_count("--tokens", args.tokens),
            batch_size=args.batch_size,
            loss=args.loss,
        ),
    )
    given = {  # only what was typed, so a --config file keeps the rest
        key: {name: value for name, value in value.items() if value is not None}
        if isinstance(value, dict)
        else value
        for key, value in given.items()
        if value is not None
    }
    from_file = read_settings(args.config) if args.config else {}
    settings = merge(from_file, given)
    config = FrontierConfig(
        out_dir=args.out,
        model=args.model,
        allocations=[name.strip() for name in args.allocations.split(",") if name.strip()],
        budgets=integer_list(args.budgets, "--budgets", minimum=1),
        softmax_counts=integer_list(args.softmax_layers, "--softmax-layers", minimum=0),
        softmax_choices=[name.strip() for name in args.softmax_choices.split(",") if name.strip()],
        settings=settings,
        eval_length=args.eval_length,
        decode_tokens=args.decode_tokens,
        command="dofla frontier " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
    )
    config.validate()
    check_data_path(settings.get("data", {}).get("path"))
    # a folder of the user's, an input's or another command's is refused now, before the teacher loads
    out = outputs.check_output_folder(
        args.out, FRONTIER_KIND, inputs=[args.model, settings.get("data", {}).get("path"), args.config]
    )
    with outputs.output_lock(out):
        outputs.claim_output_folder(out, FRONTIER_KIND)
        summary = run_frontier(config)
    print(f"dofla frontier: {len(summary['rows'])} cells finished; see {args.out}/frontier.md")
    return 0
