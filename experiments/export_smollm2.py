"""The embedded SmolLM2 converted with the `portable` recipe, exported, and run by plain transformers in a
process that never imports dofla: the logits and greedy continuations of both sides, in float32 and in
float64.

The student is the recipe's plan at its initialisation (no training: the export maps weights, whatever
their values, so equality does not need a trained student; the text is not meant to read well). Steps:
convert with the recipe's plan, save the student (`save_converted`, student only), `dofla export` it as
written (float32), load the saved student again in float64 and export that (so the norms' ``weight - 1``
is exact), then for each dtype compare dofla's logits and greedy continuation with those of
``experiments/plain_transformers_run.py`` run on the export in a fresh interpreter without dofla on its
path. Note that transformers' Qwen3.5 code computes its RMSNorms and the delta rule in float32 whatever the
model's dtype (and Llama's RMSNorm, which dofla's student keeps, also normalises in float32), so the
float64 run removes float32 rounding everywhere else, not there.

    PYTHONPATH=src python experiments/export_smollm2.py [--work DIR] [--tokens 64] [--new-tokens 16]

(``--teacher`` runs it on another Llama-like teacher, e.g. a tiny one in tests/test_experiments.py;
``--student RUN/model`` on a saved student, e.g. a trained `portable` run's, instead of the teacher's
untrained conversion.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RUNNER = Path(__file__).resolve().parent / "plain_transformers_run.py"
TEXT = Path(__file__).resolve().parents[1] / "src" / "dofla" / "demo_text" / "wikipedia_heldout.txt"


def prompts(tokenizer, tokens: int, rows: int = 2) -> torch.Tensor:
    """``rows`` prompts of ``tokens`` tokens each from the shipped held-out Wikipedia text."""
    paragraphs = [line.strip() for line in TEXT.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = []
    for paragraph in paragraphs:
        encoded = tokenizer(paragraph)["input_ids"]
        if len(encoded) >= tokens:
            ids.append(encoded[:tokens])
        if len(ids) == rows:
            break
    return torch.tensor(ids)


def run_plain(folder: Path, ids: torch.Tensor, work: Path, dtype: str, new_tokens: int) -> dict:
    (work / "ids.json").write_text(json.dumps(ids.tolist()))
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    environment["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, str(RUNNER), str(folder), str(work / "ids.json"), str(work / "plain.json")]
    subprocess.run(
        command + ["--new-tokens", str(new_tokens), "--dtype", dtype], check=True, env=environment, cwd=work
    )
    return json.loads((work / "plain.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--work", help="folder for the student and the exports (default: a temporary one)")
    parser.add_argument(
        "--student", help="a saved student (all layers gated_delta_net) instead of converting --teacher"
    )
    parser.add_argument("--tokens", type=int, default=64, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    from dofla.cli import main as dofla_main
    from dofla.convert import convert, plan_for
    from dofla.export import export_model
    from dofla.loading import load_converted
    from dofla.models import load_teacher
    from dofla.recipes import plan_for_arguments
    from dofla.saving import save_converted

    torch.manual_seed(0)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="export-smollm2-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.student:
        student = Path(args.student)
    else:
        student = work / "student"
        teacher = load_teacher(args.teacher, dtype="float32", device="cpu")
        arguments = plan_for_arguments("portable")
        arguments.pop("keep_softmax", None)
        convert(teacher.model, plan_for(teacher.model, **arguments))
        save_converted(
            teacher.model,
            student,
            tokenizer=teacher.tokenizer,
            extra_metadata={"teacher": args.teacher},
            student_only=True,
        )
        del teacher
    assert dofla_main(["export", str(student), "--out", str(work / "exported-float32")]) == 0
    wide, tokenizer, _ = load_converted(student, dtype="float64", device="cpu")
    export_model(wide, work / "exported-float64", tokenizer=tokenizer)
    del wide
    ids = prompts(tokenizer, args.tokens)
    print(
        f"prompts: {tuple(ids.shape)} tokens of {TEXT.name}; greedy continuation of {args.new_tokens} tokens"
    )
    results, dofla_logits, plain_logits_of = {}, {}, {}
    for dtype in ("float32", "float64"):
        model, tokenizer, _ = load_converted(student, dtype=dtype, device="cpu")
        model.eval()
        started = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
            continuation = model.generate(
                ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
            )[:, ids.shape[1] :]
        dofla_s = time.perf_counter() - started
        started = time.perf_counter()
        plain = run_plain(work / f"exported-{dtype}", ids, work, dtype, args.new_tokens)
        plain_s = time.perf_counter() - started
        plain_logits = torch.tensor(plain["logits"], dtype=logits.dtype)
        difference = (plain_logits - logits).abs().max().item()
        same_text = plain["continuation"] == continuation.tolist()
        agree = (plain_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
        results[dtype] = difference
        dofla_logits[dtype], plain_logits_of[dtype] = logits.double(), plain_logits.double()
        print(
            f"{dtype}: plain transformers class {plain['model_class']}, dofla imported there: "
            f"{plain['dofla_imported']}; max |logit difference| {difference:.3g} (largest |logit| "
            f"{logits.abs().max().item():.3g}); argmax agreement {agree:.4f}; same greedy continuation: "
            f"{same_text} (dofla {dofla_s:.0f} s, plain transformers {plain_s:.0f} s)"
        )
        if dtype == "float32":
            text = tokenizer.decode(continuation[0])
            print(
                f"greedy continuation of prompt 0 ({'the student' if args.student else 'untrained student'}): {text!r}"
            )

    def largest(a: torch.Tensor, b: torch.Tensor) -> str:
        return f"{(a - b).abs().max().item():.3g}"

    teacher_logits = {}
    for dtype in ("float32", "float64"):
        model = load_teacher(args.teacher, dtype=dtype, device="cpu").model
        with torch.no_grad():
            teacher_logits[dtype] = model(ids, use_cache=False).logits.double()
            residual = model(ids, use_cache=False, output_hidden_states=True).hidden_states
        biggest = max(state.abs().max().item() for state in residual)
    print(
        "float32 rounding alone (max |logit difference| between a model run in float32 and in float64): "
        f"the teacher (transformers' Llama) {largest(*teacher_logits.values())}, the dofla student "
        f"{largest(*dofla_logits.values())}, the export in plain transformers "
        f"{largest(*plain_logits_of.values())}; the teacher's residual stream reaches |x| = {biggest:.3g}"
    )
    target = 1e-4
    print(
        f"target max |logit difference| <= {target:g}: float64 {'met' if results['float64'] <= target else 'MISSED'}, "
        f"float32 {'met' if results['float32'] <= target else 'missed'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
