"""lm-eval's own command line, run after ``import dofla`` so that ``--model hf --model_args pretrained=FOLDER``
opens a converted folder (lm-eval's ``lm_eval`` executable does not import dofla, and lm-eval has no plugin
hook that would): ``python -m dofla.lm_eval_cli`` takes exactly lm-eval's arguments.

    python -m dofla.lm_eval_cli --model hf --model_args pretrained=runs/demo/model --tasks dofla_piqa \\
        --include_path "$(python -c 'import dofla.evaluation.harness as h; print(h.TASKS_PATH)')" \\
        --metadata '{"tasks_dir": "data"}'
"""

from __future__ import annotations

import dofla  # noqa: F401  (registers the "dofla" model type once transformers is imported)


def main() -> None:
    import transformers  # noqa: F401  (the registration runs now, before lm-eval reads the folder)
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
