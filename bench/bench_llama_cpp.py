"""An exported student in llama.cpp's runtime beside its teacher in the same runtime: the same predictions as
transformers, and decode speed and state at long contexts.

The student is a ``dofla export`` folder (a standard ``qwen3_5_text`` checkpoint); the teacher is the
embedded SmolLM2-135M (or ``--teacher``), saved as a Hugging Face folder. Both are converted to float32 GGUF
files by llama.cpp's own converter (``--converter``: ``convert_hf_to_gguf.py`` of a llama.cpp tree, its
``gguf-py`` beside it; the ``llama-cpp-python`` source distribution vendors one) and run by llama.cpp
through the ``llama_cpp_py_sync`` bindings (``--runtime``: the folder holding that package; see
docs/export.md for setting it up), each in a process of its own. Nothing here imports dofla in those
processes.

1. Agreement: the logits of every position of a prompt of the shipped Wikipedia text, llama.cpp against
   transformers (the export opened with transformers alone), max |difference| and top-1 agreement, and a
   greedy continuation of both; the teacher's GGUF against the teacher, as the runtime's own float32 floor.
2. Speed: at each ``--contexts`` length, a prompt of that many tokens prefilled, then ``--new-tokens``
   tokens decoded greedily one at a time; seconds per decoded token and the bytes of the sequence's state
   (``llama_state_seq_get_size``: what the runtime would save of that sequence, its KV cache and recurrent
   state), teacher and student in the same run, with their ratios.

    python bench/bench_llama_cpp.py --student EXPORTED --converter LLAMA_CPP/convert_hf_to_gguf.py \\
        --runtime RUNTIME_DIR --work WORK --contexts 4096,16384 --new-tokens 32 --threads 2 \\
        [--preload LIB] [--out bench/results/llama_cpp.md]

``--preload``: a library loaded before the runtime (LD_PRELOAD), for machines whose C library is older than
the one the runtime's wheel was built for (docs/export.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TEXT = HERE.parents[1] / "src" / "dofla" / "demo_text" / "wikipedia_heldout.txt"


# ---------------------------------------------------------------- the worker (runs in llama.cpp's process)
def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    from llama_cpp_py_sync import Llama
    from llama_cpp_py_sync._cffi_bindings import get_ffi

    ffi = get_ffi()
    request = json.loads(Path(args.request).read_text())
    ids, new = request["ids"], request["new_tokens"]
    llm = Llama(
        args.gguf, n_ctx=len(ids) + new + 16, n_batch=512, n_threads=args.threads, verbose=False, seed=0
    )
    lib, ctx, vocab = llm._lib, llm._ctx, llm.n_vocab

    def decode(tokens: list[int], start: int, all_logits: bool) -> list[np.ndarray]:
        """Tokens at positions start.. in chunks of 512; the logits of every token or of the last."""
        rows = []
        for offset in range(0, len(tokens), 512):
            chunk = tokens[offset : offset + 512]
            wanted = [i for i in range(len(chunk)) if all_logits or offset + i == len(tokens) - 1]
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for i, token in enumerate(chunk):
                    batch.token[i], batch.pos[i] = token, start + offset + i
                    batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                    batch.logits[i] = 1 if i in wanted else 0
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for i in wanted:
                    pointer = lib.llama_get_logits_ith(ctx, i)
                    rows.append(np.frombuffer(ffi.buffer(pointer, vocab * 4), dtype=np.float32).copy())
            finally:
                lib.llama_batch_free(batch)
        return rows

    started = time.perf_counter()
    rows = decode(ids, 0, request["all_logits"])
    prefill = time.perf_counter() - started
    continuation, steps, position = [], [], len(ids)
    last = rows[-1]
    for _ in range(new):
        token = int(last.argmax())
        continuation.append(token)
        started = time.perf_counter()
        last = decode([token], position, False)[-1]
        steps.append(time.perf_counter() - started)
        position += 1
    state = int(lib.llama_state_seq_get_size(ctx, 0))
    if request["all_logits"]:
        np.save(args.logits, np.stack(rows))
    Path(args.result).write_text(
        json.dumps(dict(continuation=continuation, prefill_s=prefill, step_s=steps, state_bytes=state))
    )


# ---------------------------------------------------------------- the driver
def run_worker(gguf: Path, ids: list[int], new: int, all_logits: bool, args, work: Path, name: str) -> dict:
    request, result, logits = (
        work / f"{name}.request.json",
        work / f"{name}.result.json",
        work / f"{name}.npy",
    )
    request.write_text(json.dumps(dict(ids=ids, new_tokens=new, all_logits=all_logits)))
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["PYTHONPATH"] = str(Path(args.runtime).resolve())
    if args.preload:
        environment["LD_PRELOAD"] = str(Path(args.preload).resolve())
    command = [sys.executable, str(HERE), "--worker", "--gguf", str(gguf), "--request", str(request)]
    command += ["--result", str(result), "--logits", str(logits), "--threads", str(args.threads)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed on {gguf.name} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    out = json.loads(result.read_text())
    if all_logits:
        import numpy as np

        out["logits"] = np.load(logits)
    return out


def to_gguf(folder: Path, gguf: Path, converter: Path, options=()) -> Path:
    """``folder`` converted by llama.cpp's converter to a float32 GGUF (``options``: more of its flags)."""
    if gguf.is_file():
        return gguf
    root = converter.resolve().parent
    environment = dict(os.environ, PYTHONPATH=f"{root / 'gguf-py'}{os.pathsep}{root}")
    command = [sys.executable, str(converter), str(folder), "--outfile", str(gguf), "--outtype", "f32"]
    done = subprocess.run(command + list(options), env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {folder}:\n{done.stderr[-3000:]}")
    return gguf


def transformers_reference(folder: Path, ids: list[int], new: int) -> dict:
    """Logits of every position and a greedy continuation (with the model's cache), transformers alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        logits = model(prompt, use_cache=False).logits[0].numpy()
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return dict(logits=logits, continuation=out[0, len(ids) :].tolist())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--request", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)
    parser.add_argument("--student", help="a `dofla export` folder")
    parser.add_argument("--teacher", default="smollm2-135m", help="the student's teacher (dofla's spec)")
    parser.add_argument("--converter", help="llama.cpp's convert_hf_to_gguf.py (its gguf-py beside it)")
    parser.add_argument("--runtime", help="folder holding the llama_cpp_py_sync package")
    parser.add_argument("--preload", default=None, help="a library to LD_PRELOAD in the runtime's process")
    parser.add_argument("--work", help="folder for the converted files (kept and reused)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--greedy-tokens", type=int, default=24)
    parser.add_argument("--contexts", default="4096,16384")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="markdown file to write the tables to")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    for name in ("student", "converter", "runtime", "work"):
        if not getattr(args, name):
            raise SystemExit(f"--{name} is needed (see the script's help).")
    if not (Path(args.runtime) / "llama_cpp_py_sync").is_dir():
        raise SystemExit(f"--runtime {args.runtime} holds no llama_cpp_py_sync package; see docs/export.md.")
    contexts = [int(item) for item in args.contexts.split(",") if item.strip()]
    command = "bench/bench_llama_cpp.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from dofla.models import load_teacher

    teacher_folder = work / "teacher_hf"
    if not (teacher_folder / "config.json").is_file():
        loaded = load_teacher(args.teacher, dtype="float32")
        loaded.model.save_pretrained(teacher_folder)
        loaded.tokenizer.save_pretrained(teacher_folder)
    student_folder = Path(args.student)
    converter = Path(args.converter)
    ggufs = {
        "teacher": (teacher_folder, to_gguf(teacher_folder, work / "teacher-f32.gguf", converter)),
        "student": (
            student_folder,
            to_gguf(student_folder, work / "student-f32.gguf", converter, ["--no-mtp"]),
        ),
    }
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_folder)
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False).input_ids[
        : args.prompt_tokens
    ]
    lines = [
        "# An exported student in llama.cpp beside its teacher",
        "",
        f"Command: `{command}`. {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{args.threads} threads, float32 weights, llama.cpp's default f16 KV cache.",
        "",
        f"## Agreement with transformers ({len(ids)} tokens of {TEXT.name}, every position)",
        "",
        "| model | max abs logit difference | largest abs logit | top-1 agreement | distinct top-1 tokens | "
        f"same greedy {args.greedy_tokens} tokens |",
        "|---|---:|---:|---:|---:|---|",
    ]
    agreement = {}
    for name, (folder, gguf) in ggufs.items():
        runtime = run_worker(gguf, ids, args.greedy_tokens, True, args, work, f"{name}-agree")
        reference = transformers_reference(folder, ids, args.greedy_tokens)
        difference = float(np.abs(runtime["logits"] - reference["logits"]).max())
        top1 = float((runtime["logits"].argmax(-1) == reference["logits"].argmax(-1)).mean())
        same = runtime["continuation"] == reference["continuation"]
        agreement[name] = dict(
            max_abs_difference=difference,
            top1=top1,
            same_greedy=same,
            runtime_text=tokenizer.decode(runtime["continuation"]),
            transformers_text=tokenizer.decode(reference["continuation"]),
        )
        largest = float(np.abs(reference["logits"]).max())
        distinct = len(set(reference["logits"].argmax(-1).tolist()))
        lines.append(
            f"| {name} | {difference:.2e} | {largest:.1f} | {top1:.4f} | {distinct} | {'yes' if same else 'no'} |"
        )
        print(lines[-1], flush=True)
    for name, item in agreement.items():
        lines.append(
            f"\n{name}, llama.cpp: {item['runtime_text']!r}; transformers: {item['transformers_text']!r}"
        )
    lines += [
        "",
        f"## Decode speed and state ({args.new_tokens} tokens decoded after the prompt)",
        "",
        "| context | teacher ms/token | student ms/token | student speed-up | teacher state MiB | "
        "student state MiB | prefill s teacher / student |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    speed = {}
    generator = np.random.default_rng(0)
    for context in contexts:
        prompt = generator.integers(100, len(tokenizer) - 100, size=context).tolist()
        measured = {
            name: run_worker(gguf, prompt, args.new_tokens, False, args, work, f"{name}-{context}")
            for name, (_, gguf) in ggufs.items()
        }
        per_token = {name: float(np.median(item["step_s"])) for name, item in measured.items()}
        speed[context] = {name: {**item, "median_step_s": per_token[name]} for name, item in measured.items()}
        teacher, student = measured["teacher"], measured["student"]
        lines.append(
            f"| {context} | {1e3 * per_token['teacher']:.2f} | {1e3 * per_token['student']:.2f} | "
            f"{per_token['teacher'] / per_token['student']:.2f}x | {teacher['state_bytes'] / 2**20:.2f} | "
            f"{student['state_bytes'] / 2**20:.2f} | {teacher['prefill_s']:.1f} / {student['prefill_s']:.1f} |"
        )
        print(lines[-1], flush=True)
    lines.append(
        "\nms/token: the median over the decoded tokens. State: `llama_state_seq_get_size` of the sequence after "
        "the last token (the runtime's KV cache and recurrent state for it)."
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        Path(args.out).with_suffix(".json").write_text(
            json.dumps(dict(command=command, agreement=agreement, speed=speed), indent=2, default=float)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
