"""``dofla export``: a converted model whose layers are all the gated_delta_net cell, written as a standard
qwen3_5_text checkpoint, opens with plain transformers in a process that never imports dofla and gives the
same logits and greedy continuation; anything that does not map exactly is refused with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dofla.cli import main
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.export import export_folder, export_model
from dofla.models import build_tiny_model, build_tiny_tokenizer
from dofla.models.surgery import students
from dofla.saving import save_converted

RUNNER = Path(__file__).resolve().parents[1] / "experiments" / "plain_transformers_run.py"
NEW_TOKENS = 6


def portable_student(family: str, seed: int = 0, **overrides):
    """A tiny teacher converted with every layer the gated_delta_net cell, its parameters moved at random
    (as training would move them) so that every weight the export maps matters."""
    model = build_tiny_model(family, seed=seed, **overrides)
    convert(model, plan_for(model, kind="linear", cell="gated_delta_net", convert_windowed=True))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def run_without_dofla(folder: Path, ids: torch.Tensor, work: Path, dtype: str = "float32") -> dict:
    """The exported folder run by ``experiments/plain_transformers_run.py`` in a fresh interpreter whose
    path holds no dofla source (the runner also reports whether anything imported dofla)."""
    (work / "ids.json").write_text(json.dumps(ids.tolist()))
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, str(RUNNER), str(folder), str(work / "ids.json"), str(work / "result.json")]
        + ["--new-tokens", str(NEW_TOKENS), "--dtype", dtype],
        check=True,
        env=environment,
        cwd=work,
        capture_output=True,
    )
    return json.loads((work / "result.json").read_text())


@pytest.mark.parametrize(
    "family, overrides, all_linear",
    [
        ("llama", {}, False),
        ("qwen2", {"tie_word_embeddings": True}, False),
        ("mistral", {}, False),
        ("llama", {}, True),
    ],
)
def test_the_exported_checkpoint_runs_in_plain_transformers_with_the_same_logits_and_text(
    tmp_path, family, overrides, all_linear
):
    """By default the export ends with the all-zero attention layer, and transformers' generate runs with its
    cache; --all-linear writes the converted layers alone, and generate runs without a cache."""
    model = portable_student(family, **overrides)
    save_converted(model, tmp_path / "student", tokenizer=build_tiny_tokenizer())
    exported = export_folder(tmp_path / "student", tmp_path / "exported", all_linear=all_linear)
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    identity = [] if all_linear else ["full_attention"]
    assert config["layer_types"] == ["linear_attention"] * 2 + identity
    assert config["tie_word_embeddings"] is bool(overrides.get("tie_word_embeddings", False))
    files = {path.name for path in exported.iterdir()}
    assert {"model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert not any(name.startswith(".dofla") for name in files)
    ids = torch.randint(3, 100, (2, 37), generator=torch.Generator().manual_seed(2))
    result = run_without_dofla(exported, ids, tmp_path)
    assert result["model_class"] == "Qwen3_5ForCausalLM" and result["dofla_imported"] is False
    assert result["used_cache"] is not all_linear
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
        continuation = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert (torch.tensor(result["logits"]) - logits).abs().max() <= 1e-4
    assert result["continuation"] == continuation[:, ids.shape[1] :].tolist()


def test_a_float64_student_loads_exports_and_runs_in_float64_on_both_sides(tmp_path):
    from safetensors import safe_open

    from dofla.loading import load_converted

    save_converted(portable_student("llama"), tmp_path / "student", tokenizer=build_tiny_tokenizer())
    model, _, _ = load_converted(tmp_path / "student", dtype="float64")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float64}
    exported = export_model(model, tmp_path / "exported")
    with safe_open(str(exported / "model.safetensors"), "pt") as stored:
        assert {stored.get_tensor(name).dtype for name in stored.keys()} == {torch.float64}
    ids = torch.randint(3, 100, (1, 29), generator=torch.Generator().manual_seed(3))
    result = run_without_dofla(exported, ids, tmp_path, dtype="float64")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert logits.dtype == torch.float64
    assert (torch.tensor(result["logits"], dtype=torch.float64) - logits).abs().max() <= 1e-4


def converted_with(family: str, **plan):
    model = build_tiny_model(family)
    convert(model, plan_for(model, **plan))
    return model


@pytest.mark.parametrize(
    "model, named",
    [
        (
            lambda: converted_with("llama", kind="linear", cell="gated_delta", feature_map="projection"),
            "layer 0 is the gated_delta cell, not gated_delta_net",
        ),
        (
            lambda: converted_with("llama", kind="linear", cell="gated_delta_net", layers=[1]),
            "layer 0 keeps its softmax attention",
        ),
        (
            lambda: converted_with("llama", kind="hybrid", cell="gla", feature_map="hedgehog"),
            "layer 0 is the gla cell",
        ),
        (
            lambda: converted_with("gemma2", kind="linear", cell="gated_delta_net"),
            "the teacher is a gemma2 model, whose blocks are not Llama's",
        ),
        (lambda: portable_student("llama", mlp_bias=True), "the teacher's MLP has biases"),
        (lambda: portable_student("llama", attention_bias=True), "layer 0's output projection has a bias"),
    ],
)
def test_what_does_not_map_exactly_is_named_and_nothing_is_written(tmp_path, model, named):
    with pytest.raises(DoflaError, match="cannot be exported as a standard Qwen3.5 checkpoint: " + named):
        export_model(model(), tmp_path / "exported")
    assert not (tmp_path / "exported").exists() and list(tmp_path.iterdir()) == []


def test_the_command_refuses_a_folder_that_is_not_converted_a_non_empty_out_and_the_input(tmp_path, capsys):
    model = portable_student("llama")
    save_converted(model, tmp_path / "student")
    (tmp_path / "plain").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    cases = [
        ([str(tmp_path / "plain"), "--out", str(tmp_path / "out")], "is not a converted dofla model"),
        (
            [str(tmp_path / "student"), "--out", str(tmp_path / "busy")],
            "already holds files dofla did not write",
        ),
        ([str(tmp_path / "student"), "--out", str(tmp_path / "student")], "is an input of this command"),
        ([str(tmp_path / "student"), "--out", str(tmp_path)], "holds the input"),
    ]
    for arguments, message in cases:
        assert main(["export", *arguments]) == 1
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()
    assert main(["export", str(tmp_path / "student"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["export", str(tmp_path / "student"), "--out", str(tmp_path / "out")]) == 1
    assert "already holds files dofla did not write" in capsys.readouterr().err


def test_an_empty_out_folder_is_used_and_a_model_without_conversion_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    model = portable_student("mistral")
    export_model(model, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").is_file()
    with pytest.raises(DoflaError, match="already holds files dofla did not write"):
        export_model(model, tmp_path / "empty")
    with pytest.raises(DoflaError, match="this model is not converted"):
        export_model(build_tiny_model("llama"), tmp_path / "other")
    assert len(students(model)) == 2


def test_the_portable_recipe_trains_every_layer_as_the_cell_and_its_result_exports(tmp_path):
    from test_linearize import config, sequences, tiny_teacher

    from dofla.pipeline import linearize

    settings = config(tmp_path, recipe="portable", data=dict(seq_len=32), lora=dict(tokens=4 * 32 * 2))
    result = linearize(settings, teacher=tiny_teacher(), sequences=sequences())
    saved = json.loads((tmp_path / "run" / "result.json").read_text())["config"]
    assert saved["student"]["cell"] == "gated_delta_net" and saved["plan"]["kind"] == "linear"
    assert saved["lora"]["train_students"] is True and saved["distill"]["loss"] == "projected_mse"
    # the cell reads no rotary positions and has no feature map: no position period, none in the plan table
    from dofla.loading import load_converted

    assert load_converted(result.out_dir)[2].position_period is None
    assert all(row["feature_map"] == "" and not row["feature_dim"] for row in result.plan_table)
    assert "modulo" not in result.report_path.read_text()
    exported = export_folder(result.out_dir, tmp_path / "exported")
    layer_types = json.loads((exported / "config.json").read_text())["layer_types"]
    assert layer_types == ["linear_attention"] * 2 + ["full_attention"]


def test_the_identity_attention_layer_is_all_zero_and_adds_exact_zeros(tmp_path):
    """The layer the export ends with: every weight zero, one head, and the logits of the export with it
    equal, bit for bit, those of the export without it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = portable_student("llama")
    with_layer = export_model(model, tmp_path / "with")
    without = export_model(model, tmp_path / "without", all_linear=True)
    config = json.loads((with_layer / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (1, 1)
    with safe_open(str(with_layer / "model.safetensors"), "pt") as stored:
        identity = [name for name in stored.keys() if name.startswith("model.layers.2.")]
        assert len(identity) >= 9 and all(not stored.get_tensor(name).any() for name in identity)
    ids = torch.randint(3, 100, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = [
            AutoModelForCausalLM.from_pretrained(folder)(ids, use_cache=False).logits
            for folder in (with_layer, without)
        ]
    assert torch.equal(logits[0], logits[1])
