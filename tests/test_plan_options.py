"""One set of plan options everywhere: ``dofla convert`` takes ``dofla linearize``'s recipes and plan/student
options (same flags, same defaults) and makes the plan linearize trains; every long-running command takes
``--threads``."""

from __future__ import annotations

import os

import pytest
import torch

from dofla.cli import main
from dofla.config import ConversionPlan
from dofla.convert import plan_for
from dofla.loading import load_converted
from dofla.models import build_tiny_model, save_tiny_model_folder
from dofla.pipeline import linearize
from dofla.run_config import LinearizeConfig

LENGTH = 32
# every long-running command, with the least it parses (none of them gets to its work here)
LONG_COMMANDS = {
    "linearize": ["linearize", "--out", "x"],
    "convert": ["convert", "--out", "x"],
    "dof": ["dof", "--out", "x"],
    "frontier": ["frontier", "--out", "x"],
    "evaluate": ["evaluate", "x"],
    "demo": ["demo"],
    "teacher-states": ["teacher-states", "--data", "x", "--boundaries", "1", "--out", "x"],
    "generate": ["generate", "x", "--prompt", "Hi"],
    "export": ["export", "x", "--out", "y"],
}


@pytest.mark.parametrize("family, recipe", [("llama", "gated-delta"), ("gemma3", "gated-delta-linear")])
def test_convert_with_a_recipe_makes_the_plan_linearize_trains(family, recipe, tmp_path, capsys):
    teacher = save_tiny_model_folder(family, tmp_path / "teacher")
    assert main(["convert", str(teacher), "--recipe", recipe, "--out", str(tmp_path / "converted")]) == 0
    assert "converted" in capsys.readouterr().out
    _, _, converted = load_converted(tmp_path / "converted")
    config = LinearizeConfig.from_dict(
        dict(
            out_dir=str(tmp_path / "run"),
            recipe=recipe,
            progress=False,
            teacher=dict(model=str(teacher)),
            data=dict(seq_len=LENGTH, heldout_fraction=0.25),
            distill=dict(tokens=4 * LENGTH, eval_every=0, checkpoint_every=0),
            lora=dict(enabled=False),  # the plan is made before the LoRA stage
            evaluate=dict(lengths=[LENGTH], passkey_trials=0, recall=False, error_sequences=0),
        )
    )
    rows = torch.randint(3, 90, (16, 2 * LENGTH), generator=torch.Generator().manual_seed(0))
    linearize(config, sequences=rows)
    trained = ConversionPlan.load(tmp_path / "run" / "plan.json")
    assert converted.to_dict()["layers"] == trained.to_dict()["layers"]
    assert converted.sinks_at_edge == trained.sinks_at_edge
    assert converted.metadata["recipe"] == recipe
    if family == "gemma3":  # the teacher's own window layer is kept by both
        assert converted.kept_windowed_layers == trained.kept_windowed_layers == [0]


def test_convert_takes_linearizes_plan_options_and_feature_dim_is_budget(tmp_path, capsys):
    teacher = save_tiny_model_folder("llama", tmp_path / "teacher")
    out = tmp_path / "converted"
    options = ["--allocation", "fix", "--kind", "hybrid", "--sinks", "2", "--window", "16", "--cell", "gla"]
    assert main(["convert", str(teacher), "--feature-dim", "4", *options, "--out", str(out)]) == 0
    capsys.readouterr()
    _, _, plan = load_converted(out)
    expected = plan_for(
        build_tiny_model("llama"), kind="hybrid", feature_dim=4, window=16, sinks=2, cell="gla"
    )
    assert plan.to_dict()["layers"] == expected.to_dict()["layers"]
    # the settings' default allocation (dof) measures the teacher, here on the text shipped with dofla
    again = ["convert", str(teacher), "--budget", "4", "--out", str(out), "--overwrite"]
    assert main(again) == 0
    assert "measuring the teacher for the plan (allocation dof, --keep-softmax 0)" in capsys.readouterr().err
    _, _, measured = load_converted(out)
    assert (
        measured.metadata["allocation"] == "dof" and "shipped with dofla" in measured.metadata["calibration"]
    )
    assert main([*again, "--plan", str(tmp_path / "plan.json")]) == 1
    assert "--plan is a whole plan and the options given (plan) would make another" in capsys.readouterr().err
    assert main([*again, "--recipe", "nope"]) == 1
    assert "unknown recipe 'nope'; choose one of:" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(LONG_COMMANDS))
def test_every_long_command_takes_threads(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--threads THREADS" in capsys.readouterr().out
    assert main([*LONG_COMMANDS[command], "--threads", "0"]) == 1
    assert capsys.readouterr().err == "dofla: error: --threads must be at least 1, got 0.\n"
    too_many = (os.cpu_count() or 1) + 1
    assert main([*LONG_COMMANDS[command], "--threads", str(too_many)]) == 1
    assert capsys.readouterr().err == (
        f"dofla: error: --threads {too_many} is more than this machine's {too_many - 1} CPU threads; give at "
        "most that many.\n"
    )


def test_threads_are_set_before_the_work(monkeypatch, tmp_path, capsys):
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    assert (
        main(["convert", "no-such-model", "--budget", "0", "--out", str(tmp_path / "x"), "--threads", "1"])
        == 1
    )
    assert chosen == [1] and "--budget must be a positive number" in capsys.readouterr().err
