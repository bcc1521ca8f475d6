"""lm-eval's own command line, run after ``import dofla`` so that ``--model hf --model_args pretrained=FOLDER``
opens a converted folder (lm-eval's ``lm_eval`` executable does not import dofla, and lm-eval has no plugin
hook that would): ``python -m dofla.lm_eval_cli`` takes exactly lm-eval's arguments.

    python -m dofla.lm_eval_cli --model hf --model_args pretrained=runs/demo/model --tasks dofla_piqa \\
        --include_path "$(python -c 'import dofla.evaluation.harness as h; print(h.TASKS_PATH)')" \\
        --metadata '{"tasks_dir": "data"}'
"""

from __future__ import annotations

import dofla  # noqa: F401  (registers the "dofla" model type once transformers is imported)


def pretrained_folders(argv: list[str]) -> list[str]:
    """The ``pretrained=`` values of ``--model_args`` in lm-eval arguments."""
    folders = []
    for index, argument in enumerate(argv):
        value = None
        if argument == "--model_args" and index + 1 < len(argv):
            value = argv[index + 1]
        elif argument.startswith("--model_args="):
            value = argument.split("=", 1)[1]
        for part in (value or "").split(","):
            if part.strip().startswith("pretrained="):
                folders.append(part.strip().removeprefix("pretrained="))
    return folders


def main(argv: list[str] | None = None) -> int:
    import sys

    import transformers  # noqa: F401  (the registration runs now, before lm-eval reads the folder)

    from dofla.loading import saved_before_auto_config

    argv = sys.argv[1:] if argv is None else argv
    for folder in pretrained_folders(argv):
        if saved_before_auto_config(folder):
            print(
                f"dofla: error: {folder} was saved before converted folders held a dofla config.json, so "
                "transformers would open it as the plain teacher; re-save it first (README: 'Loading with "
                "transformers').",
                file=sys.stderr,
            )
            return 1
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
