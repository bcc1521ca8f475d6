"""Saving and reloading converted models: identical logits on every family, strict keys, teacher fingerprint,
student-only folders, atomic writes, and the `dofla convert` / `dofla generate` commands."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_generate import FAMILIES, PLANS, VOCAB, tiny_model

from dofla.cli import main
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.loading import load_converted
from dofla.models import build_tiny_tokenizer, save_tiny_model_folder
from dofla.saving import PLAN_FILE, save_converted, teacher_fingerprint


def tokens(seed=0):
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


def trained_a_little(model):
    """Move the student parameters away from their initialisation so a reload that re-initialises fails."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "dofla_student" in name:
                parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def saved_weights(family, folder):
    """Convert a tiny ``family`` model, save it to ``folder``; the weights file and its tensors."""
    model = tiny_model(family)
    convert(model, PLANS["linear"](model))
    save_converted(model, folder)
    weights = folder / "model.safetensors"
    return weights, load_file(str(weights))


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_gives_identical_logits(family, tmp_path):
    model = tiny_model(family)
    trained_a_little(convert(model, PLANS["hybrid"](model)))
    expected = model(tokens()).logits
    save_converted(model, tmp_path / "out", extra_metadata={"teacher": "tiny"})
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        ".dofla",  # the marker: a folder dofla wrote, with the list of its files
        "config.json",
        PLAN_FILE,
        "model.safetensors",
    ]
    assert [path.name for path in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # not the private temporary mode
    assert (tmp_path / "out" / PLAN_FILE).stat().st_mode & 0o777 == 0o666 & ~umask
    loaded, tokenizer, plan = load_converted(tmp_path / "out")
    assert tokenizer is None and plan.to_dict()["layers"] == model.dofla_plan.to_dict()["layers"]
    assert plan.metadata["teacher"] == "tiny"
    torch.testing.assert_close(loaded(tokens()).logits, expected, rtol=0, atol=0)


def test_tied_embeddings_are_stored_once_and_restored(tmp_path):
    model = tiny_model("gpt2")  # ties lm_head to the token embeddings
    convert(model, PLANS["linear"](model))
    save_converted(model, tmp_path / "out")
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    record = json.loads((tmp_path / "out" / PLAN_FILE).read_text())
    assert (
        record["tied_weights"] == {"lm_head.weight": "transformer.wte.weight"}
        and "lm_head.weight" not in stored
    )
    loaded, _, _ = load_converted(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)


def test_missing_and_unexpected_keys_fail_loudly(tmp_path):
    weights, tensors = saved_weights("llama", tmp_path / "out")
    z_key = "model.layers.0.self_attn.dofla_student.feature_map.z"
    missing = {name: tensor for name, tensor in tensors.items() if name != z_key}
    save_file(missing, str(weights))
    with pytest.raises(DoflaError, match=f"missing 1 \\({z_key}\\)"):
        load_converted(tmp_path / "out")
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(DoflaError, match="unexpected 1 \\(model.extra.weight\\)"):
        load_converted(tmp_path / "out")


def test_changed_teacher_weights_are_detected(tmp_path):
    weights, tensors = saved_weights("qwen2", tmp_path / "out")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(weights))
    with pytest.raises(DoflaError, match="do not match their recorded fingerprint"):
        load_converted(tmp_path / "out")


def test_student_only_folder_needs_the_right_teacher(tmp_path):
    model = tiny_model("llama", seed=0)
    trained_a_little(convert(model, PLANS["mixed"](model)))
    expected = model(tokens()).logits
    save_converted(model, tmp_path / "student", student_only=True)
    stored = load_file(str(tmp_path / "student" / "student.safetensors"))
    assert stored and all("dofla_student" in name for name in stored)
    loaded, _, _ = load_converted(tmp_path / "student", teacher=tiny_model("llama", seed=0))
    torch.testing.assert_close(loaded(tokens()).logits, expected, rtol=0, atol=0)
    with pytest.raises(DoflaError, match="fingerprint mismatch"):
        load_converted(tmp_path / "student", teacher=tiny_model("llama", seed=1))
    # the fingerprint ignores precision: the same teacher in bfloat16 is still recognised
    teacher = tiny_model("llama", seed=0)
    assert teacher_fingerprint(teacher) == teacher_fingerprint(tiny_model("llama", seed=0).to(torch.bfloat16))
    assert teacher_fingerprint(teacher) != teacher_fingerprint(tiny_model("llama", seed=1))


def test_saving_over_an_existing_model_needs_overwrite_and_keeps_foreign_files(tmp_path):
    first = tiny_model("llama")
    convert(first, PLANS["linear"](first))
    save_converted(first, tmp_path / "out")
    second = tiny_model("llama", seed=3)
    convert(second, PLANS["hybrid"](second))
    with pytest.raises(DoflaError, match="already holds a converted model; pass --overwrite"):
        save_converted(second, tmp_path / "out")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DoflaError, match=r"holds files dofla did not write \(notes.txt\)"):
        save_converted(second, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert load_converted(tmp_path / "out")[2].layers[0].kind == "linear"  # the first model, untouched
    (tmp_path / "out" / "notes.txt").unlink()
    save_converted(second, tmp_path / "out", overwrite=True)  # replaced whole, atomically
    assert [path.name for path in tmp_path.iterdir()] == ["out"]  # no temporary folder or lock left behind
    loaded, _, plan = load_converted(tmp_path / "out")
    assert plan.layers[0].kind == "hybrid"


def test_bad_folders_and_unconverted_models_are_refused(tmp_path):
    with pytest.raises(DoflaError, match="not a converted dofla model"):
        load_converted(tmp_path)
    (tmp_path / PLAN_FILE).write_text("{")
    with pytest.raises(DoflaError, match="not valid JSON"):
        load_converted(tmp_path)
    with pytest.raises(DoflaError, match="not converted"):
        save_converted(tiny_model("llama"), tmp_path / "out")


def saved_hybrid(folder):
    """A tiny converted Llama (hybrid plan) saved with its tokenizer to ``folder``: (model, tokenizer)."""
    model = tiny_model("llama")
    convert(model, PLANS["hybrid"](model))
    tokenizer = build_tiny_tokenizer()
    save_converted(model, folder, tokenizer=tokenizer)
    return model, tokenizer


def test_generate_command_streams_tokens(tmp_path, capsys):
    model, tokenizer = saved_hybrid(tmp_path / "out")
    prompt = "The cat"
    assert main(["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    with torch.no_grad():
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert expected.shape[1] > ids.shape[1]
    assert printed == tokenizer.decode(expected[0], skip_special_tokens=True) + "\n"
    arguments = ["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "3", "--sample"]
    assert main(arguments) == 0
    assert capsys.readouterr().out.startswith(prompt)
    assert main(["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "0"]) == 1
    assert "--max-new-tokens must be positive" in capsys.readouterr().err


def test_generate_command_reads_a_prompt_file_and_prefills_in_pieces(tmp_path, capsys):
    _, tokenizer = saved_hybrid(tmp_path / "out")
    prompt = "The cat sat on the mat and the dog sat on the log, the cat and the dog"
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    assert len(tokenizer(prompt).input_ids) > 6
    printed = []
    for chunk in ("0", "3"):
        arguments = ["generate", str(tmp_path / "out"), "--prompt-file", str(tmp_path / "prompt.txt")]
        assert main([*arguments, "--max-new-tokens", "5", "--prefill-chunk", chunk]) == 0
        printed.append(capsys.readouterr().out)
    assert main(["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "5"]) == 0
    assert printed == [capsys.readouterr().out] * 2


def test_generate_command_takes_a_position_period(tmp_path, capsys):
    """--position-period: the continuation the model gives with that period set (true positions for 0)."""
    from dofla.convert import set_position_period

    model, tokenizer = saved_hybrid(tmp_path / "out")
    prompt = "The cat sat on the mat"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    for period in (4, 0):
        set_position_period(model, period or None)
        with torch.no_grad():
            expected = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        arguments = ["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "6"]
        assert main([*arguments, "--position-period", str(period)]) == 0
        assert capsys.readouterr().out == tokenizer.decode(expected[0], skip_special_tokens=True) + "\n"


def test_generate_command_takes_sinks_at_edge(tmp_path, capsys):
    """--sinks-at-edge on: the continuation of the model with its windows' sinks seen from the edge."""
    from dofla.convert import set_sinks_at_edge

    model = tiny_model("llama")
    convert(model, PLANS["gated_delta"](model))  # window 4 and 2 sinks: the edge at position 6
    tokenizer = build_tiny_tokenizer()
    save_converted(model, tmp_path / "out", tokenizer=tokenizer)
    prompt = "The cat sat on the mat"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    set_sinks_at_edge(model, True)
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    arguments = ["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "6"]
    assert main([*arguments, "--sinks-at-edge", "on"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(expected[0], skip_special_tokens=True) + "\n"
    with pytest.raises(SystemExit):  # argparse's own refusal, naming the choices
        main([*arguments, "--sinks-at-edge", "maybe"])
    assert "choose from 'on', 'off'" in capsys.readouterr().err


def test_convert_command_validates_before_loading(tmp_path, capsys):
    assert main(["convert", "no-such-model", "--out", str(tmp_path / "x"), "--feature-dim", "0"]) == 1
    assert "--budget must be a positive number of features per layer" in capsys.readouterr().err  # its alias
    assert (
        main(["convert", "no-such-model", "--out", str(tmp_path / "x"), "--plan", str(tmp_path / "p.json")])
        == 1
    )
    assert "does not exist" in capsys.readouterr().err
    assert main(["convert", "no-such-model", "--out", str(tmp_path / "x"), "--feature-map", "nope"]) == 1
    assert "unknown feature map 'nope'" in capsys.readouterr().err
    assert main(["convert", "no-such-model", "--out", str(tmp_path / "x"), "--layers", "a,b"]) == 1
    assert "--layers must be comma-separated" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_convert_command_end_to_end(tmp_path, capsys):
    teacher_folder = save_tiny_model_folder("llama", tmp_path / "teacher")
    teacher = tiny_model("llama")
    plan = plan_for(teacher, kind="linear", feature_dim=4, layers=[1])
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "converted"
    assert (
        main(["convert", str(teacher_folder), "--plan", str(tmp_path / "plan.json"), "--out", str(out)]) == 0
    )
    assert "converted 1 of 2 layers" in capsys.readouterr().out
    loaded, tokenizer, loaded_plan = load_converted(out)
    assert tokenizer is not None and [layer.kind for layer in loaded_plan.layers] == ["softmax", "linear"]
    assert loaded_plan.metadata["teacher"]
    convert(teacher, plan)
    with torch.no_grad():  # the converted folder holds the teacher's weights and fresh students (seeded)
        torch.testing.assert_close(loaded(tokens()).logits, teacher(tokens()).logits, rtol=1e-5, atol=1e-5)
    wrong = plan_for(tiny_model("gpt2"), feature_dim=4)
    wrong.save(tmp_path / "wrong.json")
    again = ["convert", str(teacher_folder), "--out", str(out), "--overwrite"]
    assert main([*again, "--plan", str(tmp_path / "wrong.json")]) == 1
    assert "different model" in capsys.readouterr().err
    assert main([*again, "--layers", "0,7"]) == 1
    assert "layer 7 does not exist" in capsys.readouterr().err
    assert main(["convert", str(teacher_folder), "--out", str(tmp_path / "student"), "--student-only"]) == 0
    capsys.readouterr()
    student, _, _ = load_converted(tmp_path / "student", teacher=str(teacher_folder))
    assert len(student.dofla_plan.converted_layers) == 2


def test_stored_dtypes_are_kept_and_dtype_argument_casts(tmp_path):
    model = tiny_model("gpt2").to(torch.bfloat16)  # bf16 teacher, float32 students (attached after the cast)
    convert(model, PLANS["hybrid"](model))
    save_converted(model, tmp_path / "out")
    loaded, _, _ = load_converted(tmp_path / "out")
    assert loaded.transformer.wte.weight.dtype == torch.bfloat16
    assert loaded.transformer.h[0].attn.dofla_student.window_factor_logit.dtype == torch.float32
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)
    upcast, _, _ = load_converted(tmp_path / "out", dtype="float32")
    assert all(parameter.dtype == torch.float32 for parameter in upcast.parameters())
    with pytest.raises(DoflaError, match="unknown dtype 'float8'"):
        load_converted(tmp_path / "out", dtype="float8")
