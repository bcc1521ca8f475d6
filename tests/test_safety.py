"""Safe by default, at the command line: no lost files, no broken model saved, refusals before the work.

Each test drives ``dofla.cli.main`` on tiny model folders, as a user would meet the case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dofla.cli import main
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_model_folder
from dofla.saving import PLAN_FILE, save_converted

RUN = ["--allocation", "fix", "--budget", "4", "--seq-len", "32", "--eval-every", "1", "--no-progress"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny teachers (llama seed 0, llama seed 1, gpt2), a text file and a converted llama folder."""
    root = tmp_path_factory.mktemp("safety")
    teacher = save_tiny_model_folder("llama", root / "teacher")
    text = root / "text.txt"
    text.write_text("\n".join(f"The {i}th line of text talks about rivers and hills." for i in range(80)))
    model = build_tiny_model("llama")
    convert(model, plan_for(model, feature_dim=4))
    save_converted(
        model, root / "converted", tokenizer=build_tiny_tokenizer(), extra_metadata={"teacher": str(teacher)}
    )
    return dict(
        root=root,
        teacher=teacher,
        text=text,
        converted=root / "converted",
        other_weights=save_tiny_model_folder("llama", root / "llama-seed-1", seed=1),
        other_family=save_tiny_model_folder("gpt2", root / "gpt2"),
    )


def dead_pid() -> int:
    """The id of a process that has ended (for temporaries a killed dofla left behind)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def listing(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


# ----------------------------------------------------------------------------------- 1. no lost files


def test_convert_never_deletes_or_replaces_what_dofla_did_not_write(world, tmp_path, capsys):
    teacher = world["teacher"]
    convert_to = ["convert", str(teacher), "--feature-dim", "4", "--out"]
    foreign = tmp_path / "thesis"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "thesis.txt").write_text("three years of work")
    (foreign / "sub" / "data.csv").write_text("1,2,3")
    before = listing(foreign)
    assert main([*convert_to, str(foreign)]) == 1
    assert "already holds files dofla did not write (sub, thesis.txt)" in capsys.readouterr().err
    assert listing(foreign) == before

    teacher_files = listing(teacher)
    assert main([*convert_to, str(teacher)]) == 1  # the teacher's own folder
    assert "is an input of this command" in capsys.readouterr().err
    assert main([*convert_to, f"{teacher.parent}/."]) == 1  # a parent of the input
    assert "holds the input" in capsys.readouterr().err
    assert listing(teacher) == teacher_files

    out = tmp_path / "model"
    assert main([*convert_to, str(out)]) == 0
    capsys.readouterr()
    assert main([*convert_to, str(out)]) == 1
    assert "already holds a converted model; pass --overwrite" in capsys.readouterr().err
    (out / "notes.txt").write_text("mine")
    assert main([*convert_to, str(out), "--overwrite"]) == 1
    assert "holds files dofla did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    stale = tmp_path / f".model.dofla-{dead_pid()}-x1abcdef.tmp"  # a save killed halfway
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1000))
    assert main([*convert_to, str(out), "--overwrite"]) == 0
    assert not stale.exists() and sorted(path.name for path in tmp_path.iterdir()) == ["model", "thesis"]


def test_a_run_folder_is_never_discarded_silently(world, tmp_path, capsys, monkeypatch):
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "256"]
    out = tmp_path / "run"
    assert main([*run[:2], "--out", str(out), "--resume"]) == 1  # before any work: no teacher is loaded
    assert "--resume: no checkpoint in" in capsys.readouterr().err and not out.exists()

    assert main([*run, "--out", str(out)]) == 0
    capsys.readouterr()
    (out / "notes.txt").write_text("my notes on this run")
    log = (out / "distill" / "log.jsonl").read_bytes()
    assert main([*run, "--out", str(out)]) == 1
    assert "holds an earlier run (a checkpoint at step-00000002); pass --resume" in capsys.readouterr().err
    assert (out / "distill" / "log.jsonl").read_bytes() == log
    assert main([*run, "--out", str(out), "--resume", "--overwrite"]) == 1
    assert "pass only one" in capsys.readouterr().err

    pid = dead_pid()  # leftovers of a run killed while saving its model and a checkpoint
    (out / f".model.dofla-{pid}-ab_12345.tmp").mkdir()
    (out / "distill" / "checkpoints" / f".step-00000004.dofla-{pid}-cd_12345.tmp").mkdir()
    assert main([*run, "--out", str(out), "--overwrite", "--seed", "1"]) == 0
    capsys.readouterr()
    assert (out / "notes.txt").read_text() == "my notes on this run"
    assert not [path for path in out.rglob("*.dofla-*")]
    assert sorted(path.name for path in (out / "distill" / "checkpoints").iterdir()) == [
        "latest.json",
        "step-00000002",
    ]
    result = strict_json((out / "result.json").read_text())
    assert result["config"]["seed"] == 1  # one run's files only
    steps = [strict_json(line)["step"] for line in (out / "distill" / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 2, 2]  # a step and its evaluation, once each

    (out / "distill" / "checkpoints" / "step-00000002" / "trainable.safetensors").write_bytes(b"\x00" * 64)
    assert main([*run, "--out", str(out), "--resume", "--seed", "1"]) == 1
    assert "could not read the checkpoint" in capsys.readouterr().err


def test_a_second_process_on_one_output_folder_is_refused(world, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom dofla.outputs import output_lock\n"
            "with output_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n",
            str(out),
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--out", str(out)]
        assert main(run) == 1
        assert f"another dofla process (pid {holder.pid}) is writing to" in capsys.readouterr().err
    finally:
        holder.kill()  # like kill -9: the system releases the lock, nothing stale is left
        holder.wait()
    from dofla.outputs import output_lock

    with output_lock(out):
        pass


# ------------------------------------------------------------------------------ 2. never a broken model


def test_a_lora_stage_that_diverges_stops_and_saves_nothing(world, tmp_path, capsys):
    out = tmp_path / "run"
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    with pytest.warns(UserWarning, match="LoRA stage, layer 0, step 2: loss nan"):
        code = main([*run, "--out", str(out), "--lora", "--lora-lr", "1e30", "--lora-tokens", "1k"])
    assert code == 1
    error = capsys.readouterr().err
    assert "LoRA stage, layer 0, step 6: 5 steps in a row had a non-finite loss" in error
    assert "nothing was saved: lower --lora-lr" in error
    assert not (out / "model").exists() and not (out / "result.json").exists()


def test_non_finite_weights_are_never_saved_and_json_is_always_valid(tmp_path):
    from dofla.io import to_json, write_json_atomic

    model = build_tiny_model("llama")
    convert(model, plan_for(model, feature_dim=4))
    with torch.no_grad():
        next(p for name, p in model.named_parameters() if "dofla_student" in name).fill_(float("nan"))
    with pytest.raises(DoflaError, match="holds NaN or infinite values .*it was not saved"):
        save_converted(model, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert (
        to_json({"loss": float("nan"), "curve": [1.0, float("inf")]})
        == '{"loss": null, "curve": [1.0, null]}'
    )
    write_json_atomic(tmp_path / "result.json", {"student_ppl": float("nan")})
    assert strict_json((tmp_path / "result.json").read_text()) == {"student_ppl": None}


# -------------------------------------------------------------------------- 3. loading fails loudly


def test_missing_or_unexpected_teacher_weights_are_named(world, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "teacher"
    shutil.copytree(world["teacher"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    kept = {name: tensor for name, tensor in tensors.items() if ".layers.1." not in name}
    kept["model.extra.weight"] = torch.ones(2)
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert main(["info", str(folder)]) == 1
    error = capsys.readouterr().err
    assert "9 missing (model.layers.1.input_layernorm.weight" in error
    assert "1 unexpected (model.extra.weight)" in error

    (folder / "config.json").write_text("[]")
    assert main(["info", str(folder)]) == 1
    assert "holds a JSON list, not an object of settings" in capsys.readouterr().err


# ------------------------------------------------------------------- 5. options checked before the work


NOT_LOADED = "no-such-model"  # a refusal naming the option, not this missing model, came before loading


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--lora", "--lora-lr", "-1"], "--lora-lr must be a positive number, got -1.0"),
        (["--lora", "--lora-rank", "0"], "--lora-rank must be at least 1, got 0"),
        (["--lora", "--lora-kl", "-1"], "--lora-kl must be zero or positive"),
        (["--lora", "--lora-tokens", "inf"], "--lora-tokens must be a positive number of tokens"),
        (
            ["--tokens", "inf"],
            "--tokens must be a positive number of tokens like 2M, 500k or 100000, got 'inf'",
        ),
        (["--tokens", "nan"], "--tokens must be a positive number of tokens"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--budget", "100000"], "at most 8192; got 100000"),
        (["--lr", "nan"], "learning rate must be a positive number, got nan"),
        (["--lr", "3e38"], "--lr 3e+38 is above 1e+30, where Adam's float32 steps overflow"),
        (["--lora", "--lora-lr", "1e31"], "--lora-lr 1e+31 is above 1e+30"),
        (["--loss", "direct", "--kl-weight", "-1"], "the KL weight must be zero or positive"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--lora-targets", "q_proj,,v_proj"], "--lora-targets must be comma-separated names"),
        (["--eval-lengths", "1024,x"], "--eval-lengths must be comma-separated integers of at least 2"),
        (["--sinks", "-1"], "--sinks must be at least 0, got -1"),
        (["--cell", "nope"], "unknown cell 'nope'"),
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--heldout-sequences", "0"], "--heldout-sequences must be at least 1, got 0"),
        (["--cell", "gla", "--loss", "softmax"], "use a layer loss such as output_mse"),
        (["--batch-size", "1000", "--tokens", "1k"], "is 512,000 tokens, more than --tokens 1,000"),
        (["--data", ""], "--data is empty (an unset shell variable?)"),
    ],
)
def test_linearize_options_are_checked_before_loading(tmp_path, capsys, arguments, message):
    assert main(["linearize", NOT_LOADED, "--out", str(tmp_path / "out"), *arguments]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command, message",
    [
        (
            ["dof", NOT_LOADED, "--lambda", "inf"],
            "--lambda must be a finite positive number like 2^-4, got inf",
        ),
        (["dof", NOT_LOADED, "--lambda", "nan"], "--lambda must be a finite positive number"),
        (["dof", NOT_LOADED, "--sequences", "-1"], "--sequences must be at least 1, got -1"),
        (["dof", NOT_LOADED, "--device", "tpu"], "unknown device 'tpu'"),
        (["dof", NOT_LOADED, "--min-dim", "1000"], "--min-dim 1000 is above the mean budget --budget 64"),
        (["evaluate", NOT_LOADED, "--passkey", "64", "--threads", "100000"], "--threads 100000 is more than"),
        (
            ["convert", NOT_LOADED, "--feature-dim", "1000000000", "--out", "new"],
            "--budget must be a positive number of features per layer, at most 8192; got 1000000000",
        ),
        (["evaluate", NOT_LOADED, "--sequences", "-1"], "--sequences must be at least 1, got -1"),
        (["evaluate", NOT_LOADED, "--passkey", "64", "--device", "tpu"], "unknown device 'tpu'"),
        (["evaluate", NOT_LOADED], "nothing to evaluate: give --data"),
        (
            ["evaluate", NOT_LOADED, "--passkey", "long"],
            "--passkey must be comma-separated integers of at least 1",
        ),
        (["generate", NOT_LOADED, "--prompt", ""], "--prompt is empty"),
        (["generate", NOT_LOADED, "--prompt", "Hi", "--device", "tpu"], "unknown device 'tpu'"),
        (["generate", NOT_LOADED, "--prompt", "Hi", "--prefill-chunk", "-1"], "--prefill-chunk must be 0"),
        (["generate", NOT_LOADED, "--prompt", "Hi", "--position-period", "-3"], "--position-period must be"),
        (
            ["evaluate", NOT_LOADED, "--passkey", "64", "--position-period", "-3"],
            "--position-period must be a number of tokens",
        ),
        (["generate", NOT_LOADED, "--prompt-file", "no-such-prompt.txt"], "is not a file"),
        (["generate", NOT_LOADED, "--prompt", "Hi", "--graph", "--sample"], "--graph decodes greedily"),
        (["generate", NOT_LOADED, "--prompt", "Hi", "--graph", "--compile"], "give one"),
        (
            ["generate", NOT_LOADED, "--prompt", "Hi", "--graph", "--device", "cpu"],
            "--graph needs a CUDA GPU (it replays a CUDA graph); on a CPU use --compile",
        ),
    ],
)
def test_other_commands_check_options_before_loading(tmp_path, capsys, command, message):
    out = ["--out", str(tmp_path / "out")] if command[0] == "dof" else []
    assert main([*command, *out]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_sentence(world, capsys):
    assert main(["generate", str(world["converted"]), "--prompt", "Hi", "--device", "cuda"]) == 1
    assert "CUDA is not available here; use --device cpu" in capsys.readouterr().err
    assert main(["evaluate", str(world["converted"]), "--device", "cuda:0", "--passkey", "64"]) == 1
    assert "CUDA is not available here" in capsys.readouterr().err


def test_unwritable_outputs_are_refused_before_the_work(world, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = ["linearize", NOT_LOADED, "--out", str(blocker / "run")]
    assert main(run) == 1
    assert "which is a file; choose another folder" in capsys.readouterr().err
    assert main(["evaluate", NOT_LOADED, "--passkey", "64", "--json", str(tmp_path)]) == 1
    assert f"--json {tmp_path} is a folder; give a file name" in capsys.readouterr().err
    assert main(["evaluate", NOT_LOADED, "--passkey", "64", "--json", str(blocker / "r.json")]) == 1
    assert "which is a file; choose another path" in capsys.readouterr().err


def test_lora_targets_and_the_tokenizer_are_checked_before_training(world, tmp_path, capsys, monkeypatch):
    import dofla.pipeline

    def too_late(*args, **kwargs):
        raise AssertionError("the check came after the teacher's perplexity")

    monkeypatch.setattr(dofla.pipeline, "perplexity", too_late)
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN]
    assert main([*run, "--out", str(tmp_path / "a"), "--lora", "--lora-targets", "bogus"]) == 1
    assert (
        "--lora-targets names bogus, which this model has no linear layer called" in capsys.readouterr().err
    )
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(world["teacher"] / name, no_tokenizer / name)
    run[1] = str(no_tokenizer)
    assert main([*run, "--out", str(tmp_path / "b")]) == 1
    assert "has no usable tokenizer, which reading --data or sampling text needs" in capsys.readouterr().err


def test_sequence_lengths_beyond_the_context_are_refused(world, tmp_path, capsys):
    data = ["--data", str(world["text"]), "--seq-len", "1000"]
    assert main(["evaluate", str(world["converted"]), *data]) == 1
    assert "a context of 1000 tokens is longer than the teacher's maximum of 512" in capsys.readouterr().err
    states = [
        "teacher-states",
        str(world["teacher"]),
        *data,
        "--boundaries",
        "0",
        "--out",
        str(tmp_path / "s"),
    ]
    assert main(states) == 1
    assert "--seq-len 1000 is beyond the model's context of 512 tokens" in capsys.readouterr().err


# --------------------------------------------------------------------- 7. evaluate --teacher is checked


def test_evaluate_refuses_a_teacher_the_model_was_not_converted_from(world, capsys):
    evaluate = ["evaluate", str(world["converted"]), "--data", str(world["text"]), "--seq-len", "32"]
    assert main([*evaluate, "--teacher", str(world["other_family"])]) == 1
    assert "its model_type is gpt2, the recorded teacher's is llama" in capsys.readouterr().err
    assert main([*evaluate, "--teacher", str(world["other_weights"])]) == 1
    error = capsys.readouterr().err
    assert "same architecture but other weights" in error and "--any-teacher" in error
    assert main([*evaluate, "--sequences", "2"]) == 0  # its recorded teacher
    capsys.readouterr()
    assert (
        main([*evaluate, "--sequences", "2", "--teacher", str(world["other_weights"]), "--any-teacher"]) == 0
    )
    assert "Held-out quality at length" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- 9. smaller items


def test_damaged_or_escaping_files_are_one_sentence(world, tmp_path, capsys):
    from dofla.distill.checkpoint import latest_checkpoint

    escaping = tmp_path / "converted"
    shutil.copytree(world["converted"], escaping)
    record = json.loads((escaping / PLAN_FILE).read_text())
    (escaping / PLAN_FILE).write_text(json.dumps({**record, "weights": "../../secret.safetensors"}))
    assert main(["generate", str(escaping), "--prompt", "Hi"]) == 1
    assert "names the weights file '../../secret.safetensors'" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.json").write_text('{"step": 1, "folder": "../../elsewhere"}')
    with pytest.raises(DoflaError, match="not a checkpoint folder name"):
        latest_checkpoint(tmp_path / "checkpoints")

    for name, content in (
        ("latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1")),
        ("latin1.json", '["caf\xe9"]'.encode("latin-1")),
        ("binary.txt", b"GGUF\x00\x01\x02" + bytes(64)),
    ):
        (tmp_path / name).write_bytes(content)
        dof = ["dof", str(world["teacher"]), "--data", str(tmp_path / name), "--out", str(tmp_path / "dof")]
        assert main(dof) == 1
        error = capsys.readouterr().err
        assert error.startswith(f"dofla: error: {tmp_path / name} ")  # before loading the model
        assert "is not UTF-8 text (byte 0xe9 at offset" in error or "holds a NUL byte at offset 4" in error


def test_dof_shows_its_first_use_progress_and_does_not_overwrite_silently(world, tmp_path, capsys):
    out = tmp_path / "dof"
    dof = ["dof", str(world["teacher"]), "--out", str(out), "--sequences", "1", "--seq-len", "16"]
    dof += ["--num-points", "16", "--budget", "4"]
    assert main(dof) == 0  # no --data: the text shipped with dofla
    error = capsys.readouterr().err
    assert "reading 1 calibration sequences of 16 tokens" in error
    assert "the web text shipped with dofla" in (out / "dof.md").read_text()
    assert "capturing q/k on 1 x 16 tokens, then estimating" in error
    plan = (out / "plan.json").read_bytes()
    assert main(dof) == 1
    assert "already holds a DoF report; pass --overwrite" in capsys.readouterr().err
    assert (out / "plan.json").read_bytes() == plan
    assert main([*dof, "--overwrite"]) == 0


def test_a_lock_file_left_by_a_killed_process_does_not_block(tmp_path):
    """A lock file whose holder was killed (its flock released by the system) does not block a new run."""
    from dofla.outputs import output_lock

    (tmp_path / ".out.dofla-lock").write_text(f"{dead_pid()}\n")
    started = time.monotonic()
    with output_lock(tmp_path / "out"):
        assert (tmp_path / ".out.dofla-lock").read_text() == f"{os.getpid()}\n"
    assert time.monotonic() - started < 1 and not (tmp_path / ".out.dofla-lock").exists()


def test_the_demo_continues_its_own_interrupted_run_and_says_so(tmp_path, capsys, monkeypatch):
    import dofla.pipeline

    seen = []

    def stop(config, **kwargs):
        seen.append((config.resume, config.overwrite))
        raise DoflaError("stopped here")

    monkeypatch.setattr(dofla.pipeline, "linearize", stop)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 1  # a fresh folder: a fresh run
    (out / "distill" / "checkpoints").mkdir(parents=True)
    (out / "distill" / "checkpoints" / "latest.json").write_text('{"step": 10, "folder": "step-00000010"}')
    assert main(["demo", "--out", str(out)]) == 1
    assert f"continuing the demo run in {out} (pass --overwrite to start over)" in capsys.readouterr().out
    assert main(["demo", "--out", str(out), "--overwrite"]) == 1
    assert seen == [(False, False), (True, False), (False, True)]


# ------------------------------------------------------------ 10. one output policy, inputs never written


def test_evaluate_never_writes_over_an_input_or_a_file_it_did_not_write(world, tmp_path, capsys):
    evaluate = ["evaluate", str(world["converted"]), "--data", str(world["text"]), "--lengths", "16"]
    evaluate += ["--sequences", "2", "--error-sequences", "0", "--sinks", "0"]
    before = {name: listing(world[name]) for name in ("teacher", "converted")}
    text = world["text"].read_bytes()
    for target, message in (
        (world["teacher"] / "config.json", f"lies in the input {world['teacher']}"),
        (world["converted"] / "config.json", f"lies in the input {world['converted']}"),
        (world["text"], "is an input of this command"),
    ):
        assert main([*evaluate, "--json", str(target), "--overwrite"]) == 1
        assert message in capsys.readouterr().err
    assert main([*evaluate, "--plot", str(world["teacher"] / "loss.png")]) == 1
    assert f"lies in the input {world['teacher']}" in capsys.readouterr().err
    assert {name: listing(world[name]) for name in ("teacher", "converted")} == before
    assert world["text"].read_bytes() == text

    mine, figure = tmp_path / "mine.json", tmp_path / "figure.png"
    mine.write_text('{"my": "numbers"}')
    figure.write_bytes(b"\x89PNG my holiday photo")
    for option, path in (("--json", mine), ("--plot", figure)):
        assert main([*evaluate, option, str(path)]) == 1
        assert "already exists; choose a new path, or pass --overwrite" in capsys.readouterr().err
        assert main([*evaluate, option, str(path), "--overwrite"]) == 1
        assert "was not written by dofla, so --overwrite leaves it alone" in capsys.readouterr().err
    assert mine.read_text() == '{"my": "numbers"}' and figure.read_bytes() == b"\x89PNG my holiday photo"

    results, plot = tmp_path / "results.json", tmp_path / "loss.png"
    assert main([*evaluate, "--json", str(results), "--plot", str(plot)]) == 0
    capsys.readouterr()
    assert (
        main([*evaluate, "--json", str(results), "--plot", str(plot)]) == 1
    )  # its own: only with --overwrite
    assert "already exists" in capsys.readouterr().err
    assert main([*evaluate, "--json", str(results), "--plot", str(plot), "--overwrite"]) == 0
    assert json.loads(results.read_text())["made_by"] == "dofla"


def test_dof_overwrite_removes_only_its_own_files(world, tmp_path, capsys, monkeypatch):
    from dofla.outputs import remove_known_files

    out = tmp_path / "dof"
    dof = ["dof", str(world["teacher"]), "--data", str(world["text"]), "--out", str(out), "--sequences", "1"]
    dof += ["--seq-len", "16", "--num-points", "16", "--budget", "4"]
    assert main(dof) == 0
    capsys.readouterr()
    (out / "my_figure.png").write_bytes(b"mine")
    (out / "photos").mkdir()
    (out / "photos" / "holiday.png").write_bytes(b"mine too")
    assert main([*dof, "--overwrite"]) == 0
    assert (out / "my_figure.png").read_bytes() == b"mine"
    assert (out / "photos" / "holiday.png").read_bytes() == b"mine too"
    assert (out / "plan.json").is_file() and (out / "dims_per_layer.png").is_file()

    (tmp_path / "a" / "deep").mkdir(parents=True)  # a pattern's * never crosses a folder
    for name in ("a/x.png", "a/deep/y.png", "a/deep/keep.txt", "a/checkpoints/step-1/w.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    remove_known_files(tmp_path / "a", ["*.png", "checkpoints/*"])  # a folder pattern covers what it holds
    left = sorted(path.relative_to(tmp_path).as_posix() for path in (tmp_path / "a").rglob("*"))
    assert left == ["a/deep", "a/deep/keep.txt", "a/deep/y.png"]


def test_frontier_writes_only_into_its_own_marked_and_locked_folder(world, tmp_path, capsys, monkeypatch):
    import dofla.frontier
    from dofla.outputs import read_marker

    ran = []
    monkeypatch.setattr(dofla.frontier, "run_frontier", lambda config: ran.append(config) or {"rows": []})
    frontier = ["frontier", str(world["teacher"]), "--data", str(world["text"]), "--out"]
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.txt").write_text("three years")
    (thesis / "frontier.md").write_text("my notes")
    assert main([*frontier, str(thesis)]) == 1
    assert "already holds files dofla did not write (frontier.md, thesis.txt)" in capsys.readouterr().err
    assert main([*frontier, str(world["teacher"])]) == 1
    assert "is an input of this command" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([*frontier, str(blocker)]) == 1
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main([*frontier, str(world["converted"])]) == 1  # another command's output
    assert "holds a dofla converted model output, not a frontier grid" in capsys.readouterr().err
    assert not ran  # all refused before the teacher would load

    grid = tmp_path / "grid"
    assert main([*frontier, str(grid)]) == 0 and len(ran) == 1
    assert read_marker(grid)["kind"] == "frontier grid"
    assert main([*frontier, str(grid)]) == 0  # its own grid is continued
    assert (thesis / "frontier.md").read_text() == "my notes"


def test_a_reused_run_config_never_discards_the_other_run(world, tmp_path, capsys):
    from dofla.run_config import CONFIG_FILE, LinearizeConfig, load_config, save_config

    config = LinearizeConfig.from_dict(dict(out_dir="A", overwrite=True))
    save_config(config, tmp_path / CONFIG_FILE)
    saved = (tmp_path / CONFIG_FILE).read_text()
    assert "overwrite" not in saved and "resume" not in saved
    (tmp_path / "old.toml").write_text('out_dir = "A"\noverwrite = true\nresume = true\n')  # an older save
    reused = load_config(tmp_path / "old.toml", out_dir="B")
    assert (reused.overwrite, reused.resume) == (False, False)

    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*run, "--out", str(first), "--overwrite"]) == 0
    assert main([*run, "--out", str(second), "--seed", "1"]) == 0
    capsys.readouterr()
    model = listing(second / "model")
    assert main(["linearize", "--config", str(first / CONFIG_FILE), "--out", str(second)]) == 1
    assert "holds an earlier run" in capsys.readouterr().err
    assert listing(second / "model") == model


def test_only_dofla_temporaries_are_removed_as_stale(tmp_path):
    from dofla.io import remove_stale_temporaries, write_text_atomic

    pid = dead_pid()
    notes = tmp_path / f".notes.dofla-{pid}-v1.txt"
    notes.write_text("my notes")
    stale = tmp_path / f".notes.dofla-{pid}-abc_1234.tmp"
    stale.write_text("half")
    remove_stale_temporaries(tmp_path)
    assert notes.read_text() == "my notes" and not stale.exists()
    write_text_atomic(tmp_path / "notes", "new")
    assert notes.read_text() == "my notes"


# --------------------------------------------------------------------- 11. no silently wrong results


def test_empty_data_paths_and_empty_texts_are_refused(world, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(world["root"])  # a folder holding text.txt, which an empty --data would read
    run = ["linearize", NOT_LOADED, *RUN, "--tokens", "128", "--out", str(tmp_path / "run")]
    assert main([*run, "--data", ""]) == 1
    assert "--data is empty (an unset shell variable?)" in capsys.readouterr().err
    for command in (
        ["dof", NOT_LOADED, "--out", str(tmp_path / "dof")],
        ["evaluate", NOT_LOADED, "--passkey", "64"],
        ["teacher-states", NOT_LOADED, "--boundaries", "1", "--out", str(tmp_path / "states")],
        ["frontier", NOT_LOADED, "--out", str(tmp_path / "grid")],
    ):
        assert main([*command, "--data", ""]) == 1
        assert "--data is empty" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n' * 1000 + '{"text": "   "}\n')
    assert main([*run, "--data", str(empty)]) == 1  # before the teacher loads: no "no-such-model" error
    assert f"{empty} holds no text (every record is empty)" in capsys.readouterr().err
    mount_point = tmp_path / "mnt"  # an empty mount point, or a folder the text was never copied into
    mount_point.mkdir()
    assert main([*run, "--data", str(mount_point)]) == 1
    assert f"the folder {mount_point} holds no .txt, .jsonl or .json files" in capsys.readouterr().err

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refused)  # as for another user's folder (the tests may run as root)
    assert main([*run, "--data", str(mount_point)]) == 1
    assert f"cannot read the data {mount_point}: Permission denied" in capsys.readouterr().err
    monkeypatch.undo()
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.txt")
        assert main([*run, "--data", str(tmp_path / "pipe.txt")]) == 1
        assert "is neither a file nor a folder" in capsys.readouterr().err


def test_nan_weights_are_named_when_a_teacher_or_a_converted_model_loads(world, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "converted"
    shutil.copytree(world["converted"], damaged)
    weights = damaged / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(key for key in sorted(tensors) if "feature_map" in key or "student" in key)
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert main(["generate", str(damaged), "--prompt", "Hi"]) == 1
    error = capsys.readouterr().err
    assert f"hold NaN or infinite values (first in {name})" in error and "convert or train" in error

    teacher = tmp_path / "teacher"
    shutil.copytree(world["teacher"], teacher)
    weights = next(teacher.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    run = ["linearize", str(teacher), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    dof = ["dof", str(teacher), "--data", str(world["text"]), "--out", str(tmp_path / "dof")]
    convert_to = ["convert", str(teacher), "--feature-dim", "4", "--out", str(tmp_path / "model")]
    for command in (["info", str(teacher)], [*run, "--out", str(tmp_path / "run")], dof, convert_to):
        assert main(command) == 1
        error = capsys.readouterr().err
        assert "NaN or infinite values (first in" in error and "the teacher is damaged" in error


# --------------------------------------------------------- 12. sizes, disks and damaged files: one sentence


def test_write_failures_of_any_library_are_one_sentence_and_keep_the_old_file(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    import dofla.io
    from dofla.io import save_safetensors_atomic, write_atomic

    target = tmp_path / "weights.safetensors"
    save_safetensors_atomic({"w": torch.ones(2)}, target)
    before = target.read_bytes()

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(DoflaError, match=f"could not write {target}: Error while serializing"):
        save_safetensors_atomic({"w": torch.zeros(2)}, target)
    assert target.read_bytes() == before and sorted(tmp_path.iterdir()) == [target]

    def torch_save_fails(path):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file"
        )

    with pytest.raises(DoflaError, match="could not write .*optimizer.pt: .*PytorchStreamWriter failed"):
        write_atomic(tmp_path / "optimizer.pt", torch_save_fails)
    monkeypatch.setattr(dofla.io.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 4))
    with pytest.raises(DoflaError, match="needs 0.0 MiB and the disk holding .* has 0.0 MiB free"):
        save_safetensors_atomic({"w": torch.zeros(2)}, target)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(DoflaError, match=f"could not write {blocker / 'x.json'}: "):
        dofla.io.write_text_atomic(blocker / "x.json", "{}")


def test_sizes_are_checked_against_the_model_before_the_work(world, tmp_path, capsys):
    convert = ["convert", str(world["teacher"]), "--out", str(tmp_path / "out")]
    assert main([*convert, "--kind", "hybrid", "--window", "100000000000"]) == 1
    assert "the window of 100000000000 tokens (+ 0 sinks) is longer than the teacher's context of 512" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()
    model = build_tiny_model("llama")
    plan = plan_for(model, feature_dim=4).to_dict()
    for value, message in (
        ("abc", "feature_dim must be a whole number, got 'abc'"),
        (2.7, "feature_dim must be a whole number, got 2.7"),
        (True, "feature_dim must be a whole number, got True"),
        (10**9, "feature dimension 1000000000 is above the most dofla builds, 8192"),
    ):
        plan["layers"][0]["feature_dim"] = value
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        assert main([*convert, "--plan", str(tmp_path / "plan.json")]) == 1
        assert message in capsys.readouterr().err
    dof = ["dof", str(world["teacher"]), "--data", str(world["text"]), "--out", str(tmp_path / "dof")]
    assert main([*dof, "--keep-softmax", "99"]) == 1
    error = capsys.readouterr().err
    assert "--keep-softmax 99 leaves nothing to convert in a 2-layer model" in error
    assert "capturing" not in error


def test_damaged_model_folders_and_config_files_are_one_sentence(world, tmp_path, capsys):
    for damage, message in (
        (lambda folder: (folder / "config.json").unlink(), "config.json is missing or damaged"),
        (lambda folder: (folder / "config.json").write_text("[]"), "config.json is missing or damaged"),
        (
            lambda folder: (folder / "model.safetensors").write_bytes(
                (folder / "model.safetensors").read_bytes()[:300]
            ),
            "model.safetensors is corrupt or truncated",
        ),
    ):
        folder = tmp_path / f"converted-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(world["converted"], folder)
        damage(folder)
        assert main(["generate", str(folder), "--prompt", "Hi"]) == 1
        assert message in capsys.readouterr().err
    (tmp_path / "binary.toml").write_bytes(b"\x00\xff\xfe binary")
    assert main(["linearize", NOT_LOADED, "--config", str(tmp_path / "binary.toml"), "--out", "x"]) == 1
    assert "binary.toml is not valid TOML" in capsys.readouterr().err


def test_pickled_weights_are_refused_unless_allowed(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "pickled"
    model = build_tiny_model("llama")
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    build_tiny_tokenizer().save_pretrained(folder)
    assert main(["info", str(folder)]) == 1
    error = capsys.readouterr().err
    assert "holds only pickled weights (pytorch_model.bin), which dofla does not load" in error
    assert "DOFLA_ALLOW_PICKLE=1" in error
    monkeypatch.setenv("DOFLA_ALLOW_PICKLE", "1")
    assert main(["info", str(folder)]) == 0


def test_a_teacher_config_with_impossible_sizes_is_one_sentence(world, tmp_path, capsys):
    for name, value in (("num_attention_heads", 0), ("hidden_size", "64"), ("num_hidden_layers", True)):
        teacher = tmp_path / f"teacher-{name}"
        shutil.copytree(world["teacher"], teacher)
        config = json.loads((teacher / "config.json").read_text())
        (teacher / "config.json").write_text(json.dumps({**config, name: value}))
        assert main(["info", str(teacher)]) == 1
        assert f"sets {name} to {value!r}, which is not a positive whole number" in capsys.readouterr().err


def test_cell_options_that_are_not_numbers_are_one_sentence(world, tmp_path, capsys):
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    run += ["--cell", "gated_delta", "--kind", "hybrid", "--window", "8", "--loss", "output_mse"]
    assert main([*run, "--cell-options", "beta=abc", "--out", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert "the gated_delta cell cannot read its options {'beta': 'abc'}" in error


def test_gguf_files_and_the_cache_are_checked_before_loading(world, tmp_path, capsys, monkeypatch):
    import gguf
    import numpy

    from dofla.models.tiny import save_tiny_gguf

    mamba = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(mamba), "mamba")
    writer.add_block_count(2)
    writer.add_tensor("x", numpy.zeros(4, dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["info", str(mamba)]) == 1
    assert "holds a 'mamba' model, which has no softmax attention dofla converts" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DOFLA_CACHE", str(blocker))
    assert main(["info", str(save_tiny_gguf(tmp_path / "tiny.gguf"))]) == 1
    assert f"cannot make dofla's cache folder {blocker / 'teachers'}" in capsys.readouterr().err

    import transformers
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setenv("DOFLA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full_disk)
    assert main(["info", str(tmp_path / "tiny.gguf")]) == 1
    error = capsys.readouterr().err
    assert "could not cache the de-quantised teacher in" in error and "Error while serializing" in error
    assert not [path for path in (tmp_path / "cache" / "teachers").iterdir()]  # no half-written copy


def test_a_weight_of_the_wrong_shape_and_a_linked_out_are_named(world, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    teacher = tmp_path / "teacher"
    shutil.copytree(world["teacher"], teacher)
    weights = next(teacher.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(key for key in sorted(tensors) if "q_proj" in key)
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert main(["info", str(teacher)]) == 1
    assert f"1 of the wrong shape ({name})" in capsys.readouterr().err

    link = tmp_path / "link"
    link.symlink_to(world["converted"], target_is_directory=True)
    before = listing(world["converted"])
    assert (
        main(["convert", str(world["teacher"]), "--feature-dim", "4", "--out", str(link), "--overwrite"]) == 1
    )
    assert f"--out {link} is a symbolic link to {world['converted']}" in capsys.readouterr().err
    assert listing(world["converted"]) == before and link.is_symlink()


def test_an_empty_mount_point_as_the_model_folder_is_refused_before_converting(
    world, tmp_path, capsys, monkeypatch
):
    import dofla.convert

    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    mounted = Path.is_mount
    monkeypatch.setattr(Path, "is_mount", lambda self: self == mount_point or mounted(self))

    def too_late(*args, **kwargs):
        raise AssertionError("the check came after the teacher was converted")

    monkeypatch.setattr(dofla.convert, "convert", too_late)
    assert main(["convert", str(world["teacher"]), "--feature-dim", "4", "--out", str(mount_point)]) == 1
    error = capsys.readouterr().err
    assert f"{mount_point} is a mount point, which a saved model cannot replace" in error
    assert f"give a folder inside it, e.g. {mount_point / 'model'}" in error


def test_a_run_without_room_for_its_model_stops_before_training(world, tmp_path, capsys, monkeypatch):
    import dofla.io

    monkeypatch.setattr(dofla.io.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000))
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    assert main([*run, "--out", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert "the converted model this run saves needs" in error and "has 0.0 MiB free" in error
    assert not (tmp_path / "run" / "distill").exists()


# ------------------------------------------------------------- 13. data read only as far as the run needs


def test_a_large_data_file_is_read_only_as_far_as_the_run_needs(world, tmp_path, capsys, monkeypatch):
    import dofla.data
    import dofla.text_files

    big = tmp_path / "big.txt"  # one line of 24 MiB: one text no tokenizer call may get whole
    big.write_text("The river runs past the hill and on to the old mill. " * 460_000)
    tokenised = []
    tokenise = dofla.data._tokenise

    def counted(tokenizer, pieces, eos, ids):  # one tokenizer call: its pieces' lengths
        tokenised.extend(len(piece) for piece, _ in pieces)
        return tokenise(tokenizer, pieces, eos, ids)

    decoded = []  # the bytes read as text (the blank-line scan reads the file's bytes and keeps none)
    decode = dofla.text_files._decoded

    def counted_bytes(raw, path, offset, start=0, end=None):
        decoded.append((len(raw) if end is None else end) - start)
        return decode(raw, path, offset, start, end)

    monkeypatch.setattr(dofla.data, "_tokenise", counted)
    monkeypatch.setattr(dofla.text_files, "_decoded", counted_bytes)
    run = ["linearize", str(world["teacher"]), "--data", str(big), *RUN, "--tokens", "256"]
    assert main([*run, "--out", str(tmp_path / "run")]) == 0
    assert "(read as far as the 10,272 tokens this run needs)" in (tmp_path / "run" / "report.md").read_text()
    assert max(tokenised) <= dofla.data.TOKENIZE_CHARS and sum(tokenised) < big.stat().st_size / 10
    assert max(decoded) <= 1 << 20 and sum(decoded) < big.stat().st_size / 4  # the one line, in pieces

    tokenised.clear()
    evaluate = [
        "evaluate",
        str(world["converted"]),
        "--data",
        str(big),
        "--lengths",
        "16",
        "--sequences",
        "2",
    ]
    assert main([*evaluate, "--error-sequences", "0", "--sinks", "0"]) == 0
    assert max(tokenised) <= dofla.data.TOKENIZE_CHARS and sum(tokenised) < big.stat().st_size / 10
    capsys.readouterr()


def test_many_texts_are_read_only_until_the_tokens_are_there(world, tmp_path):
    from dofla.data import iter_texts, read_tokens

    lines = tmp_path / "many.jsonl"
    lines.write_text(
        "".join(json.dumps({"text": f"text number {i} about rivers."}) + "\n" for i in range(200_000))
    )
    taken = []

    def counted(texts):
        for text in texts:
            taken.append(text)
            yield text

    read = read_tokens(build_tiny_tokenizer(), counted(iter_texts(lines)), limit=1000)
    assert not read.complete and read.texts == len(taken) < 200_000 / 4 and len(read.ids) >= 1000
    assert taken[-1] == f"text number {len(taken) - 1} about rivers."  # in order, nothing skipped


def test_a_prompt_file_larger_than_the_model_can_take_is_one_sentence(world, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("x" * 9000)
    assert main(["generate", str(world["converted"]), "--prompt-file", str(prompt)]) == 1
    assert (
        f"--prompt-file {prompt} holds 9,000 bytes, more than a prompt of this model can be (8,192 bytes: 4 "
        "times the model's context of 512 tokens" in capsys.readouterr().err
    )
    prompt.write_text("x" * (2 << 20))
    assert main(["generate", NOT_LOADED, "--prompt-file", str(prompt)]) == 1
    assert "(1,048,576 bytes: its config names no context)" in capsys.readouterr().err
    prompt.write_text("The river")
    assert (
        main(["generate", str(world["converted"]), "--prompt-file", str(prompt), "--max-new-tokens", "2"])
        == 0
    )


def test_a_distillation_step_that_cannot_fit_in_memory_is_refused_before_training(
    world, tmp_path, capsys, monkeypatch
):
    import dofla.evaluation.logits

    monkeypatch.setattr(dofla.evaluation.logits, "available_memory_bytes", lambda device=None: 1 << 20)
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "1M"]
    assert main([*run, "--batch-size", "128", "--out", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert "one distillation step of --batch-size 128 x --seq-len 32 tokens needs more than 0.0 GiB" in error
    assert "pass --batch-size 32 or less" in error and not (tmp_path / "run" / "distill").exists()


def test_a_batch_draws_one_permutation_per_pass_over_the_data():
    from dofla.distill.trainer import batch_indices

    drawn = batch_indices(0, 200_000, 50_000, seed=0)  # it drew one permutation per slot: about a minute
    assert len(drawn) == 200_000 and torch.bincount(torch.tensor(drawn)).tolist() == [4] * 50_000
    assert batch_indices(0, 7, 3, seed=1)[:3] == batch_indices(0, 3, 3, seed=1)  # the same order as before


def test_a_recall_cache_beyond_the_context_is_refused_before_training(world, tmp_path, capsys):
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    run += ["--cell", "gated_delta", "--kind", "hybrid", "--window", "8", "--loss", "output_mse"]
    assert main([*run, "--recall-cache", "1000000000", "--out", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert "--recall-cache 1000000000 keeps more tokens per head than the teacher's context of 512" in error
    assert not (tmp_path / "run" / "distill").exists()


def test_recall_cache_options_that_add_up_beyond_the_context_are_refused_before_training(
    world, tmp_path, capsys
):
    run = ["linearize", str(world["teacher"]), "--data", str(world["text"]), *RUN, "--tokens", "128"]
    run += ["--cell", "gated_delta", "--kind", "hybrid", "--window", "8", "--loss", "output_mse"]
    run += ["--cell-options", "recall_cache=300,heavy_hitters=300"]  # each within the context of 512
    assert main([*run, "--out", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert (
        "the cell options recall_cache + heavy_hitters 600 keeps more tokens per head than the teacher's"
        in error
    )
    assert not (tmp_path / "run" / "distill").exists()
