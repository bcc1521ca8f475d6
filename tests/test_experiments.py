"""Smoke runs of every script in experiments/ on a tiny model folder and a small text: each runs end to end
through the public stages it composes and writes the outputs its documentation names."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dofla.models import save_tiny_model_folder

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def experiment(name: str):
    """experiments/NAME.py as a module (the folder is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama folder (2 layers, 4 query / 2 key-value heads) and about 6k characters of text."""
    root = tmp_path_factory.mktemp("experiments")
    folder = save_tiny_model_folder("llama", root / "tiny-llama")
    text = root / "text.txt"
    text.write_text(
        "\n".join(f"Line {i}: the river bends past hill {i % 7} and mill {i % 5}." for i in range(120))
    )
    return str(folder), str(text)


def test_dof_study(tiny, tmp_path):
    folder, text = tiny
    arguments = ["--model", folder, "--data", text, "--out", str(tmp_path), "--sequences", "2"]
    arguments += ["--seq-len", "32", "--budget", "4", "--points", "32", "--capture-points", "64"]
    arguments += ["--big-j-layers", "0,1", "--error-feature-dims", "4", "--error-sequences", "2"]
    assert experiment("dof_study").main(arguments) == 0
    results = json.loads((tmp_path / "dof_study.json").read_text())
    assert set(results) >= {"default", "sweep", "big_j", "measures", "error"}
    assert set(results["measures"]) == {"dof_trace", "attention_rank"}
    assert "2^-4" in results["sweep"]["J=32,subset seed 0"]
    assert "over the 2 layers" in (tmp_path / "dof_study.md").read_text()
    assert "Command: `python experiments/dof_study.py" in experiment("dof_study").render_default(
        str(tmp_path / "dof_study.json")
    )


def test_allocation_study(tiny, tmp_path):
    folder, text = tiny
    arguments = ["--model", folder, "--data", text, "--out", str(tmp_path), "--budget", "4"]
    arguments += ["--tokens", "128", "--seq-len", "16", "--batch-size", "2", "--dof-points", "32"]
    arguments += ["--heldout", "2", "--measures", "dof,dof_trace"]
    assert experiment("allocation_study").main(arguments) == 0
    record = json.loads((tmp_path / "allocation_study.json").read_text())
    assert [row["allocation"] for row in record["rows"]] == ["Fix", "DoF (dof)", "DoF (dof_trace)"]
    assert all(sum(row["feature_dims"]) == 4 * 2 for row in record["rows"])  # mean budget 4 over 2 layers
    assert "| Fix |" in (tmp_path / "allocation_study.md").read_text()


def test_lora_sweep(tiny, tmp_path):
    folder, text = tiny
    arguments = ["--model", folder, "--data", text, "--out", str(tmp_path), "--tokens", "64"]
    arguments += ["--lora-tokens", "64", "--batch-size", "2", "--seq-len", "16", "--variants", "lr1e-3"]
    arguments += ["--teacher-variants", "lr1e-3", "--report-sequences", "2", "--validation-sequences", "2"]
    experiment("lora_sweep").main(arguments)
    rows = json.loads((tmp_path / "lora_sweep.json").read_text())["variants"]
    assert [row["name"] for row in rows] == ["teacher+lr1e-3", "lr1e-3"]
    assert "Best student on the validation split: `lr1e-3`" in (tmp_path / "lora_sweep.md").read_text()


def test_recipes_script_and_summary(tiny, tmp_path, capsys):
    """recipes.sh's dofla command lines, recorded by a stand-in DOFLA and run here in-process (three fresh
    interpreters would take most of a minute), then summarize_results.py over the run folders."""
    from dofla.cli import main

    folder, text = tiny
    calls = tmp_path / "calls.jsonl"
    recorder = tmp_path / "record-dofla"
    recorder.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    recorder.chmod(0o755)
    options = ["--seq-len", "64", "--batch-size", "4", "--budget", "4", "--eval-every", "0"]
    subprocess.run(
        ["bash", str(EXPERIMENTS / "recipes.sh"), text, str(tmp_path / "runs"), "256", *options],
        env=dict(os.environ, MODEL=folder, DOFLA=str(recorder)),
        check=True,
    )
    for line in calls.read_text().splitlines():
        assert main(json.loads(line)) == 0
    runs = sorted(path.parent.name for path in (tmp_path / "runs").glob("*/result.json"))
    assert runs == ["dof-paper", "fix", "lolcats"]
    capsys.readouterr()
    assert experiment("summarize_results").main([str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out
    assert "| dof-paper | linear | learnable_prf | dof (dof) |" in table
    assert "| lolcats | hybrid | hedgehog | fix | output_mse | 256 |" in table


def test_cells_at_length(tiny, tmp_path):
    folder, text = tiny
    arguments = ["--model", folder, "--data", text, "--out", str(tmp_path), "--tokens", "128"]
    arguments += ["--seq-len", "16", "--eval-length", "32", "--window", "4", "--sinks", "2", "--heldout", "2"]
    arguments += ["--variants", "gla:hedgehog:8:0.9,gated_delta:projection:8:0.9", "--batch-size", "2"]
    assert experiment("cells_at_length").main(arguments) == 0
    results = json.loads((tmp_path / "cells_at_length.json").read_text())
    assert len(results["variants"]) == 2
    for measured in results["variants"].values():
        models = measured["trained"]["by_length"]["32"]["models"]
        assert set(models) == {"teacher", "window", "window+sinks2", "streaming", "heavy-hitter", "student"}
    assert "window+sinks2" in results["baselines"]["by_length"]["32"]["models"]
    assert "## gla hedgehog 8, gamma0 0.9: untrained" in (tmp_path / "cells_at_length.md").read_text()


def test_length_curriculum(tiny, tmp_path):
    folder, text = tiny
    arguments = ["--model", folder, "--data", text, "--out", str(tmp_path), "--tokens", "192"]
    arguments += [
        "--seq-len",
        "16",
        "--eval-lengths",
        "32,64",
        "--window",
        "4",
        "--sinks",
        "2",
        "--heldout",
        "2",
    ]
    arguments += ["--cells", "gla,linear", "--curricula", "8:0.5,16:0.5", "--feature-dim", "8"]
    assert experiment("length_curriculum").main(arguments) == 0
    results = json.loads((tmp_path / "length_curriculum.json").read_text())
    runs = [(run["cell"], run["curriculum"]) for run in results["runs"]]
    assert runs == [("gla", "none"), ("gla", "8:0.5,16:0.5"), ("linear", "none"), ("linear", "8:0.5,16:0.5")]
    assert {run["distill_tokens"] for run in results["runs"]} == {192}  # equal tokens
    assert [stage["length"] for stage in results["runs"][1]["stages"]] == [8, 16]
    assert set(results["baseline"]["by_length"]["64"]["models"]) == {"teacher", "window+sinks2"}
    table = (tmp_path / "length_curriculum.md").read_text()
    rows = [
        [cell.strip() for cell in line.split("|")[1:4]] for line in table.splitlines() if line.startswith("|")
    ]
    assert ["gla", "8:0.5,16:0.5", "192"] in rows and ["window 4 + 2 sinks", "-", "-"] in rows


def test_passkey_softmax_layers(tiny, tmp_path):
    folder, _ = tiny
    arguments = ["--model", folder, "--out", str(tmp_path), "--keep", "0,1,2", "--lengths", "48"]
    arguments += ["--trials", "1", "--window", "4", "--sinks", "1"]
    experiment("passkey_softmax_layers").main(arguments)
    result = json.loads((tmp_path / "passkey_softmax_layers.json").read_text())
    assert len(result["needle_attention"]) == 2
    # K = 0 and K = all once each, K = 1 by both choices
    assert [(row["keep"], row["choice"]) for row in result["rows"]] == [
        (0, "retrieval"),
        (1, "retrieval"),
        (1, "uniform"),
        (2, "retrieval"),
    ]
    assert result["rows"][-1]["layers"] == [0, 1]
    assert "| 1 | uniform | [1] |" in (tmp_path / "passkey_softmax_layers.md").read_text()


def test_passkey_softmax_layers_recall_choice(tiny, tmp_path):
    folder, text = tiny
    arguments = ["--model", folder, "--out", str(tmp_path), "--keep", "1,2", "--lengths", "48"]
    arguments += ["--trials", "1", "--window", "4", "--sinks", "1", "--choices", "recall"]
    arguments += ["--recall-data", text, "--recall-rows", "2", "--seq-len", "40"]
    experiment("passkey_softmax_layers").main(arguments)
    result = json.loads((tmp_path / "passkey_softmax_layers.json").read_text())
    order = [layer for layer, _ in result["recall_order"]]
    assert sorted(order) == [0, 1]
    losses = [loss for _, loss in result["recall_order"]]
    assert all(math.isfinite(loss) for loss in losses)
    assert [(row["keep"], row["choice"], row["layers"]) for row in result["rows"]] == [
        (1, "recall", [order[0]]),
        (2, "recall", [0, 1]),
    ]
    assert "Greedy recall order" in (tmp_path / "passkey_softmax_layers.md").read_text()


def test_softmax_layers_at_length(tiny, tmp_path):
    folder, text = tiny
    arguments = [
        "--model",
        folder,
        "--data",
        text,
        "--out",
        str(tmp_path),
        "--keep",
        "1",
        "--lengths",
        "32,64",
    ]
    arguments += ["--seq-len", "32", "--heldout-sequences", "2", "--score-rows", "2", "--score-length", "32"]
    arguments += ["--window", "4", "--sinks", "1", "--given", "first=0"]
    experiment("softmax_layers_at_length").main(arguments)
    result = json.loads((tmp_path / "softmax_layers_at_length.json").read_text())
    assert len(result["window_kl"]) == 2 and all(cost >= 0 for cost in result["window_kl"])
    choices = [(row["keep"], row["choice"], row["layers"]) for row in result["rows"]]
    best = max(range(2), key=lambda layer: result["window_kl"][layer])
    assert choices == [
        (0, "none", []),
        (1, "first", [0]),
        (1, "uniform", [1]),
        (1, "window_kl", [best]),
        (2, "all", [0, 1]),
    ]
    full, cut = result["rows"][-1]["perplexity"]["64"], result["rows"][0]["perplexity"]["64"]
    assert full != cut  # a 4-token window changes a 64-token row's predictions
    assert "| 1 | window_kl |" in (tmp_path / "softmax_layers_at_length.md").read_text()


def tiny_run(tiny, run, **sections):
    """A finished ``linearize`` run of the tiny teacher in ``run`` (hybrid, window 4, 256 tokens at 32),
    each of ``sections`` (e.g. ``plan={...}``) updating the settings of its section."""
    from dofla.pipeline import linearize
    from dofla.run_config import LinearizeConfig

    folder, text = tiny
    settings = dict(
        out_dir=str(run),
        progress=False,
        teacher=dict(model=folder),
        data=dict(path=text, seq_len=32, heldout_fraction=0.25, heldout_sequences=3),
        plan=dict(kind="hybrid", window=4, allocation="fix", budget=8),
        distill=dict(tokens=256, eval_every=4, checkpoint_every=4),
        evaluate=dict(lengths=[64], passkey_trials=0, error_sequences=0),
    )
    for section, values in sections.items():
        settings[section] = {**settings.get(section, {}), **values} if isinstance(values, dict) else values
    linearize(LinearizeConfig.from_dict(settings))
    return run


def test_recall_of_runs_scores_a_finished_run_on_its_own_held_out_rows(tiny, tmp_path):
    run = tiny_run(tiny, tmp_path / "run")
    experiment("recall_of_runs").main(["--runs", f"tiny={run}", "--out", str(tmp_path / "out")])
    measured = json.loads((tmp_path / "out" / "recall_of_runs.json").read_text())["runs"]["tiny"]
    in_run = json.loads((run / "result.json").read_text())["recall"]  # the run's own measurement
    assert [item["length"] for item in measured] == [32, 64] == [item["length"] for item in in_run]
    for again, first in zip(measured, in_run, strict=True):
        for name in ("teacher", "window", "student"):
            assert again["models"][name]["nll"] == pytest.approx(first["models"][name]["nll"], rel=1e-5)
    assert "## tiny" in (tmp_path / "out" / "recall_of_runs.md").read_text()


def test_window_memory_split_reads_a_finished_gated_delta_run_layer_by_layer(tiny, tmp_path):
    from dofla.loading import load_converted

    run = tiny_run(
        tiny,
        tmp_path / "run",
        plan=dict(sinks=1),
        student=dict(cell="gated_delta", feature_map="projection"),
        distill=dict(loss="split_mse"),
        lora=dict(enabled=False),
        evaluate=dict(recall=False),
    )
    out = tmp_path / "out"
    experiment("window_memory_split").main(
        ["--run", str(run), "--length", "64", "--rows", "2", "--out", str(out)]
    )
    layers = json.loads((out / "window_memory_split.json").read_text())["layers"]
    student, _, plan = load_converted(run / "model")
    assert [row["layer"] for row in layers] == [
        i for i, layer in enumerate(plan.layers) if layer.kind == "hybrid"
    ]
    for row in layers:
        cell = student.model.layers[row["layer"]].self_attn.dofla_student
        share = float((1 - cell.window_factor()).mean())  # the fixed mix: one gamma per head
        assert row["memory_share_recall"] == pytest.approx(share, rel=1e-5)
        assert 0 <= row["far_mass_recall"] <= 1 and -1 <= row["cos_other"] <= 1
        assert row["error_recall"] >= 0 and row["window_error_other"] >= 0
    assert "| layer | far mass recall / other |" in (out / "window_memory_split.md").read_text()


def test_passkey_paths_scores_a_run_four_ways_and_memories_off_is_the_window_alone(tiny, tmp_path):
    import torch

    from dofla.evaluation.window_baseline import window_restricted
    from dofla.loading import load_converted
    from dofla.models import load_teacher
    from dofla.models.surgery import students

    run = tiny_run(
        tiny,
        tmp_path / "run",
        plan=dict(sinks=1, keep_softmax=1, softmax_choice="window"),
        student=dict(cell="gated_delta", feature_map="projection"),
        distill=dict(loss="output_mse"),
        evaluate=dict(recall=False),
    )
    paths = experiment("passkey_paths")
    out = tmp_path / "out"
    paths.main(["--runs", f"tiny={run}", "--lengths", "256", "--trials", "1", "--out", str(out)])
    rows = json.loads((out / "passkey_paths.json").read_text())["rows"]
    assert [row["variant"] for row in rows] == list(paths.VARIANTS)
    assert all(set(row["scores"]) == {"256"} and 0 <= row["scores"]["256"] <= 1 for row in rows)
    assert "| tiny | [" in (out / "passkey_paths.md").read_text()
    paths.main(["--runs", f"tiny={run}", "--lengths", "256", "--variants", "as saved", "--out", str(out)])
    assert [row["variant"] for row in json.loads((out / "passkey_paths.json").read_text())["rows"]] == [
        "as saved"
    ]

    student, _, plan = load_converted(run / "model")
    teacher = load_teacher(tiny[0]).model
    converted = sorted(students(student))
    ids = torch.randint(3, 90, (1, 48), generator=torch.Generator().manual_seed(0))
    before = student(ids).logits
    with torch.no_grad(), paths.memories_off(student):
        alone = student(ids).logits
    assert plan.sinks_at_edge  # linearize's default for a rotary teacher: its baseline sees them so too
    with torch.no_grad(), window_restricted(teacher, 4, 1, layers=converted, sinks_at_edge=True):
        window = teacher(ids).logits
    # no LoRA stage: the converted layers' window is the teacher's own softmax over the window and sinks
    torch.testing.assert_close(alone, window, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(student(ids).logits, before)  # the shares are restored afterwards
    assert not torch.allclose(before, window, atol=1e-3)  # the memories did add something


def test_held_cache_after_generate_reports_the_state_as_held(tiny, tmp_path, capsys):
    from dofla.convert import convert, plan_for
    from dofla.models import build_tiny_tokenizer, load_teacher
    from dofla.saving import save_converted

    model = load_teacher(tiny[0], dtype="float32", device="cpu").model
    convert(
        model, plan_for(model, kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=4)
    )
    save_converted(
        model, tmp_path / "student", tokenizer=build_tiny_tokenizer(), extra_metadata={"teacher": tiny[0]}
    )
    assert (
        experiment("held_cache_after_generate").main([str(tmp_path / "student"), "--lengths", "40,200"]) == 0
    )
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 40")]
    rows += [
        line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 200")
    ]
    for _, held, state, teacher in (row[:4] for row in rows):
        assert float(held) == float(state) > 0 and float(teacher) > float(held)


def test_export_smollm2_compares_a_plain_transformers_run_of_the_export_in_both_dtypes(
    tiny, tmp_path, capsys
):
    arguments = ["--teacher", tiny[0], "--work", str(tmp_path), "--tokens", "24", "--new-tokens", "3"]
    assert experiment("export_smollm2").main(arguments) == 0
    out = capsys.readouterr().out
    for dtype in ("float32", "float64"):
        line = next(line for line in out.splitlines() if line.startswith(f"{dtype}: "))
        assert "dofla imported there: False" in line and "same greedy continuation: True" in line
    assert "float64 met" in out
    assert (tmp_path / "exported-float64" / "model.safetensors").is_file()
    # a saved student instead of the teacher's conversion: the same student, the same comparison
    again = ["--student", str(tmp_path / "student"), "--work", str(tmp_path / "again"), "--tokens", "24"]
    assert experiment("export_smollm2").main(again + ["--teacher", tiny[0], "--new-tokens", "3"]) == 0

    def figures(printed: str) -> list[str]:  # the float32 and float64 lines without their seconds
        return [line.split(" (dofla ")[0] for line in printed.splitlines() if line.startswith("float")]

    assert len(figures(out)) == 3 and figures(capsys.readouterr().out) == figures(out)
    assert not (tmp_path / "again" / "student").exists()


def test_export_logit_floor_compares_both_implementations_and_their_forms(tiny, tmp_path, capsys):
    from dofla.cli import main as dofla_main

    student = tmp_path / "student"
    assert dofla_main(["convert", tiny[0], "--recipe", "portable", "--out", str(student)]) == 0
    capsys.readouterr()
    arguments = [str(student), "--tokens", "24", "--rows", "2", "--work", str(tmp_path / "work")]
    assert experiment("export_logit_floor").main(arguments) == 0
    out = capsys.readouterr().out
    tables = [line for line in out.splitlines() if line.startswith("| dofla chunked |")]
    assert len(tables) == 4
    for table in tables:  # every pair measured, each one small
        figures = [float(cell) for cell in table.split("|")[2:-1] if cell.strip()]
        assert len(figures) >= 4 and max(figures) < 1e-3
    summary = out.splitlines()[-1]
    # float64 with the float32 casts widened: the two implementations agree to rounding of float64
    assert float(summary.rsplit("float64 widened, dofla vs transformers ", 1)[1]) < 1e-9


def test_gated_delta_net_init_measures_each_setting_against_the_teacher(tiny, capsys):
    arguments = ["--teacher", tiny[0], "--sequences", "2", "--seq-len", "32"]
    assert experiment("gated_delta_net_init").main(arguments) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    measured = [row for row in rows[2:]]
    assert len(measured) == 4 + 4 + 5 + 4 + 1
    for _, _, error, cosine, at_best_gain, _ in measured:
        assert float(error) >= float(at_best_gain) - 1e-3 and -1 <= float(cosine) <= 1


def test_lora_baselines_at_length_repeat_the_runs_teacher_baseline_and_train_streaming_llm(tiny, tmp_path):
    run = tiny_run(tiny, tmp_path / "run", lora=dict(enabled=True, tokens=4 * 32, baseline=True))
    experiment("lora_baselines_at_length").main(["--run", str(run), "--out", str(tmp_path / "out")])
    measured = json.loads((tmp_path / "out" / "lora_baselines.json").read_text())
    in_run = json.loads((run / "result.json").read_text())
    teacher_lora = measured["perplexity"]["teacher + LoRA"]
    # the run's own LoRA baseline, made again from its config and seed, at every length
    assert set(teacher_lora) == {"32", "64"}
    for length, value in in_run["lora_teacher_by_length"].items():
        assert teacher_lora[length] == pytest.approx(value, rel=1e-5)
    label = in_run["long_context"]["by_length"]["32"]["cache_baselines"]["streaming"]["label"]
    streaming = in_run["long_context"]["by_length"]["32"]["models"]["streaming"]["perplexity"]
    assert measured["untrained_streaming"] == pytest.approx(streaming, rel=1e-5)  # the run's baseline
    trained = measured["perplexity"][f"{label} + LoRA"]
    assert trained["32"] != pytest.approx(streaming, rel=1e-4)  # the LoRA stage changed it
    assert "student / (teacher + LoRA)" in (tmp_path / "out" / "lora_baselines.md").read_text()


def recall_cache_run(tiny, out: Path) -> Path:
    """A finished tiny run whose every layer holds a window of 4 and a recall cache of 3 tokens per head."""
    return tiny_run(
        tiny,
        out,
        recipe="gated-delta",
        student=dict(cell_options={"window_factor": 0.9, "recall_cache": 3}),
        lora=dict(enabled=False),
        evaluate=dict(lengths=[64], passkey_trials=0, error_sequences=0, recall=False),
    )


def test_window_recall_split_repeats_the_runs_own_split_and_refuses_one_of_other_bytes(tiny, tmp_path):
    run = recall_cache_run(tiny, tmp_path / "run")
    script = experiment("window_recall_split")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="holds 8 tokens per head and the run's 4:3 holds 7"):
        script.main(["--run", str(run), "--splits", "4:3,5:3", "--lengths", "64", "--out", str(out)])
    assert not out.exists()
    script.main(
        ["--run", str(run), "--splits", "4:3,6:1", "--lengths", "64", "--passkey-trials", "1"]
        + ["--out", str(out)]
    )
    rows = json.loads((out / "window_recall_split.json").read_text())["rows"]
    in_run = json.loads((run / "result.json").read_text())["long_context"]["by_length"]["64"]
    own, other = (row["perplexity"]["64"] for row in rows)
    assert own == pytest.approx(in_run["models"]["student"]["perplexity"], rel=1e-5)  # the run's own split
    assert other != pytest.approx(own, rel=1e-4)  # a wider window and a smaller cache change the predictions
    assert [row["passkey"]["64"][1] for row in rows] == [3, 3]  # one trial at each of the 3 depths
    assert "| 6 | 1 |" in (out / "window_recall_split.md").read_text()


def test_window_recall_split_by_need_keeps_the_total_and_follows_the_teachers_attention(tiny, tmp_path):
    script = experiment("window_recall_split")
    by_distance = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.0], [0.4, 0.2, 0.2, 0.2, 0.0]])
    # from a floor of 1: distance 1 (0.3 against 0.2), then layer 1's 0.2, 0.2, 0.2 before layer 0's 0.1
    assert script.windows_by_need(by_distance, 3, floor=1) == [2, 4]
    assert script.windows_by_need(by_distance, 3, floor=3) == [3, 3]
    with pytest.raises(SystemExit, match="more than the measured rows' 5 tokens"):
        script.windows_by_need(by_distance, 6, floor=1)
    teacher = AutoModelForCausalLM.from_pretrained(tiny[0], attn_implementation="eager")
    rows = torch.randint(0, teacher.config.vocab_size, (2, 16))
    whole = script.attention_by_distance(teacher, rows, sinks=0)
    assert whole.shape == (teacher.config.num_hidden_layers, 16)
    assert torch.allclose(whole.sum(-1), torch.ones(len(whole)), atol=1e-5)  # each query's weights sum to 1
    beyond_sinks = script.attention_by_distance(teacher, rows, sinks=2)
    assert (beyond_sinks.sum(-1) < whole.sum(-1) - 1e-3).all()
    run = recall_cache_run(tiny, tmp_path / "run")
    out = tmp_path / "out"
    arguments = ["--run", str(run), "--splits", "4:3,need:4:3", "--lengths", "64", "--min-window", "2"]
    script.main(arguments + ["--passkey-lengths", "48", "--passkey-trials", "1", "--out", str(out)])
    payload = json.loads((out / "window_recall_split.json").read_text())
    uniform, by_need = payload["rows"]
    layers = len(by_need["windows"])
    assert sum(by_need["windows"]) == 4 * layers and min(by_need["windows"]) >= 2
    measured = torch.tensor(payload["attention_by_distance"])  # the teacher's, on the run's first rows
    assert measured.shape == (layers, 64)
    assert by_need["windows"] == script.windows_by_need(measured, 4, floor=2)
    assert (
        list(by_need["passkey"]) == ["48"] and "pass key 48" in (out / "window_recall_split.md").read_text()
    )


def test_window_recall_split_by_induction_gives_the_copying_layer_the_long_window_and_measures_recall(
    tiny, tmp_path
):
    script = experiment("window_recall_split")
    scores = torch.tensor([0.1, 0.9, 0.3])
    assert script.induction_windows(scores, 1, 10, 14) == [2, 10, 2]
    assert script.induction_windows(scores, 1, 10, 15) == [3, 10, 2]  # the remainder to the first
    assert script.induction_windows(scores, 2, 5, 14) == [4, 5, 5]
    with pytest.raises(SystemExit, match="leave 1 tokens per head for the other 2 layers"):
        script.induction_windows(scores, 1, 10, 11)
    teacher = AutoModelForCausalLM.from_pretrained(tiny[0], attn_implementation="eager")
    measured = script.induction_scores(teacher, kv_heads=2, period=16, trials=1, seed=3)
    tokens = torch.randint(0, teacher.config.vocab_size, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        attentions = teacher(torch.cat([tokens, tokens])[None], output_attentions=True).attentions
    for layer, weights in enumerate(attentions):  # each query head's weight on the token after the first
        per_head = [[float(weights[0, h, 16 + i, i + 1]) for i in range(15)] for h in range(4)]
        per_kv_head = [sum(sum(per_head[h]) / 15 for h in group) / 2 for group in ((0, 1), (2, 3))]
        assert float(measured[layer]) == pytest.approx(max(per_kv_head), abs=1e-6)
    run = recall_cache_run(tiny, tmp_path / "run")  # window 4 and 3 recalled: 7 tokens per head and layer
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="leaves no window"):
        script.main(["--run", str(run), "--splits", "induction:1:4:7", "--lengths", "64", "--out", str(out)])
    arguments = ["--run", str(run), "--splits", "4:3,induction:1:10:1", "--lengths", "64", "--recall"]
    script.main(arguments + ["--passkey-trials", "0", "--out", str(out)])
    payload = json.loads((out / "window_recall_split.json").read_text())
    uniform, copying = payload["rows"]
    first = max(range(2), key=lambda layer: payload["induction_scores"][layer])
    assert copying["windows"][first] == 10 and sum(copying["windows"]) == 2 * (7 - 1)
    teacher_loss, window_loss = (
        payload["recall_references"]["64"][name][0] for name in ("teacher", "window")
    )
    for row in (uniform, copying):
        recall = row["recall"]["64"]
        assert recall["kept"] == pytest.approx((window_loss - recall["loss"]) / (window_loss - teacher_loss))
    assert uniform["recall"]["64"]["loss"] != pytest.approx(copying["recall"]["64"]["loss"], rel=1e-4)
    assert "recall kept 64" in (out / "window_recall_split.md").read_text()


def test_student_layer_blocks_repeats_the_runs_own_losses_and_restores_the_teacher(tiny, tmp_path):
    run = tiny_run(tiny, tmp_path / "run", lora=dict(enabled=False), evaluate=dict(lengths=[32]))
    script = experiment("student_layer_blocks")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="layers below 2"):
        script.main(["--run", str(run), "--blocks", "0-2", "--out", str(out)])
    script.main(["--run", str(run), "--blocks", "0,all", "--layers", "1", "--rows", "3", "--out", str(out)])
    payload = json.loads((out / "student_layer_blocks.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert payload["rows"] == [3, 32]  # every held-out row of the run, at its training length
    assert math.exp(payload["teacher_loss"]) == pytest.approx(result["teacher_ppl"], rel=1e-4)
    assert math.exp(payload["blocks"]["all"]) == pytest.approx(result["student_ppl"], rel=1e-4)
    assert payload["blocks"]["0"] != pytest.approx(payload["blocks"]["all"], rel=1e-4)
    assert 0 < payload["layers"]["1"]["relative_error"]
    assert "| 0 |" in (out / "student_layer_blocks.md").read_text()


def test_window_recall_split_keeps_heavy_hitters_beside_the_worst_recalled(tiny, tmp_path):
    from dofla.loading import load_converted
    from dofla.models.surgery import students

    run = recall_cache_run(tiny, tmp_path / "run")
    script = experiment("window_recall_split")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="RECALL 0 with HEAVY"):
        script.main(["--run", str(run), "--splits", "4:3:0", "--lengths", "64", "--out", str(out)])
    with pytest.raises(SystemExit, match="holds 8 tokens per head"):
        script.main(["--run", str(run), "--splits", "4:2:2", "--lengths", "64", "--out", str(out)])
    assert not out.exists()
    script.main(
        ["--run", str(run), "--splits", "4:3,4:0:3,4:1:2", "--lengths", "64", "--passkey-trials", "1"]
        + ["--out", str(out)]
    )
    rows = json.loads((out / "window_recall_split.json").read_text())["rows"]
    in_run = json.loads((run / "result.json").read_text())["long_context"]["by_length"]["64"]
    own, heavy, both = (row["perplexity"]["64"] for row in rows)
    assert own == pytest.approx(in_run["models"]["student"]["perplexity"], rel=1e-5)
    # other tokens kept, other predictions than the run's own cache of the worst recalled
    assert heavy != pytest.approx(own, rel=1e-4) and both != pytest.approx(heavy, rel=1e-4)
    assert [row["heavy_hitters"] for row in rows] == [0, 3, 2]
    assert all(row["passkey"]["64"][1] == 3 for row in rows)  # one trial at each depth, decoded
    assert "| 4 | 1 | 2 |" in (out / "window_recall_split.md").read_text()
    # the heavy hitters' scores and sums are state too: more bytes than the same slots by recall error
    assert rows[2]["state_bytes"] > rows[0]["state_bytes"] > 0
    model = load_converted(run / "model")[0]  # the run's own model is left as it was saved
    assert {layer.recall_budgets for layer in students(model).values()} == {(3,)}
