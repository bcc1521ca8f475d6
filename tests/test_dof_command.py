"""The whole ``dofla dof`` command on a tiny model folder: plan JSON, markdown, PNG plots; bad input."""

import json

import pytest

from dofla.cli import main
from dofla.config import ConversionPlan
from dofla.errors import DoflaError
from dofla.models.tiny import save_tiny_model_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dof") / "tiny-llama"
    save_tiny_model_folder("llama", folder)
    text = tmp_path_factory.getbasetemp() / "calibration.txt"
    text.write_text(
        "\n".join(f"The {i}th line of calibration text talks about rivers and hills." for i in range(60))
    )
    return folder, text


def run_dof(folder, text, out, *options) -> int:
    """``dofla --debug dof FOLDER --data TEXT --out OUT OPTIONS...``"""
    return main(["--debug", "dof", str(folder), "--data", str(text), "--out", str(out), *options])


def test_dof_command_writes_plan_table_and_plots(tiny_folder, tmp_path):
    folder, text = tiny_folder
    out = tmp_path / "dof"
    options = ["--budget", "8", "--lambda", "2^-4", "--lambda", "2^-6", "--num-points", "64"]
    options += ["--seq-len", "32", "--sequences", "4"]
    assert run_dof(folder, text, out, *options, "--allocation", "headwise") == 0
    plan = ConversionPlan.load(out / "plan.json")
    assert plan.metadata["allocation"] == "headwise" and plan.metadata["num_points"] == 64
    assert plan.metadata["lambda"] == "2^-4" and plan.metadata["budget"] == 8
    assert all(len(layer.head_feature_dims) == plan.num_kv_heads for layer in plan.layers)
    assert all(layer.feature_dim == max(layer.head_feature_dims) for layer in plan.layers)
    report = (out / "dof.md").read_text()
    assert "| layer |" in report and "headwise" in report and "dof_clip" in report
    assert sum(line.startswith("| ") and line[2].isdigit() for line in report.splitlines()) == plan.num_layers
    estimate = json.loads((out / "dof.json").read_text())
    assert len(estimate["heads"]) == plan.num_layers * plan.num_heads
    assert all(0 < head["dof_over_j"] <= 1 for head in estimate["heads"])
    assert sorted(estimate["lambdas"]) == [2**-6, 2**-4]
    for name in ("dims_per_layer.png", "measure_vs_lambda.png", "eigenvalue_decay.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    # The dof allocation sums exactly to C x layers.
    assert run_dof(folder, text, tmp_path / "dof2", *options, "--allocation", "dof") == 0
    dof_plan = ConversionPlan.load(tmp_path / "dof2" / "plan.json")
    assert sum(layer.feature_dim for layer in dof_plan.layers) == 8 * dof_plan.num_layers


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "0"], "budget must be a positive"),
        (["--lambda", "0"], "lambda must be positive"),
        (["--lambda", "two"], "cannot read lambda"),
        (["--num-points", "100000"], "J = 100000 points"),
        (["--allocation", "dof_clip", "--budget", "100"], "lower --budget"),
        (["--seq-len", "100000"], "one sequence needs 100000"),
        (["--sequences", "1000"], "1000 are needed"),
        (["--measure", "entropy"], "unknown measure"),
    ],
)
def test_dof_command_refuses_bad_input(tiny_folder, tmp_path, extra, message):
    folder, text = tiny_folder
    with pytest.raises(DoflaError, match=message):
        run_dof(
            folder, text, tmp_path / "o", "--seq-len", "32", "--sequences", "2", "--num-points", "64", *extra
        )


def test_empty_data_is_refused(tiny_folder, tmp_path):
    folder, _ = tiny_folder
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DoflaError):
        run_dof(folder, empty, tmp_path / "o")


def test_dof_command_window_choice_records_the_window_costs(tiny_folder, tmp_path):
    folder, text = tiny_folder
    options = [
        "--budget",
        "8",
        "--num-points",
        "32",
        "--seq-len",
        "128",
        "--sequences",
        "4",
        "--kind",
        "hybrid",
    ]
    assert (
        run_dof(folder, text, tmp_path / "w", *options, "--keep-softmax", "1", "--softmax-choice", "window")
        == 0
    )
    plan = ConversionPlan.load(tmp_path / "w" / "plan.json")
    costs = plan.metadata["window_cost"]
    assert plan.metadata["softmax_layers"] == [max(range(len(costs)), key=costs.__getitem__)]
    assert [layer.kind for layer in plan.layers].count("softmax") == 1


def test_dof_command_measured_allocation_keeps_its_curves(tiny_folder, tmp_path):
    folder, text = tiny_folder
    out = tmp_path / "measured"
    options = ["--budget", "8", "--num-points", "32", "--seq-len", "32", "--sequences", "4"]
    options += ["--allocation", "measured", "--keep-softmax", "1", "--softmax-choice", "measured"]
    assert run_dof(folder, text, out, *options) == 0
    plan = ConversionPlan.load(out / "plan.json")
    assert plan.metadata["allocation"] == "measured" and plan.metadata["softmax_choice"] == "measured"
    assert [layer.kind for layer in plan.layers].count("softmax") == 1
    assert sum(layer.feature_dim for layer in plan.layers if layer.kind != "softmax") == 8
    assert json.loads((out / "error_curves.json").read_text())["key"] == plan.metadata["error_curves_key"]
    assert "measured" in (out / "dof.md").read_text()
