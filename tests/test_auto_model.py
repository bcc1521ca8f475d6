"""Converted folders open with transformers' AutoModelForCausalLM (dofla.auto): same logits as load_converted,
generate() works, save_pretrained round-trips, older folders still load, bad arguments fail clearly."""

from __future__ import annotations

import json

import pytest
import torch
from test_generate import FAMILIES, PLANS, VOCAB, tiny_model
from test_save_load import trained_a_little
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import dofla  # noqa: F401  (registers the "dofla" model type)
from dofla.auto import DoflaConfig, DoflaForCausalLM
from dofla.convert import convert, unconvert
from dofla.errors import DoflaError
from dofla.loading import load_converted
from dofla.models import build_tiny_tokenizer
from dofla.saving import ConvertedModel, save_converted


def tokens(seed=0):
    return torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def saved(tmp_path):
    model = trained_a_little(convert(tiny_model("llama"), PLANS["hybrid"](tiny_model("llama"))))
    save_converted(
        model, tmp_path / "converted", tokenizer=build_tiny_tokenizer(), extra_metadata={"teacher": "t"}
    )
    return model, tmp_path / "converted"


def test_auto_model_opens_a_converted_folder_with_the_same_logits(saved):
    model, folder = saved
    assert json.loads((folder / "config.json").read_text())["model_type"] == "dofla"
    assert isinstance(AutoConfig.from_pretrained(folder), DoflaConfig)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(loaded, LlamaForCausalLM) and isinstance(loaded, ConvertedModel)
    assert loaded.dofla_plan.to_dict()["layers"] == model.dofla_plan.to_dict()["layers"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)
        teacher = unconvert(load_converted(folder)[0])(tokens()).logits
        assert (loaded(tokens()).logits - teacher).abs().max() > 1e-3  # the students run, not the teacher


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_round_trips_through_its_dofla_config(family, tmp_path):
    model = trained_a_little(convert(tiny_model(family), PLANS["linear"](tiny_model(family))))
    save_converted(model, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == f"Dofla{type(unconvert(tiny_model(family))).__name__}"
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)


def test_generate_on_the_auto_loaded_model(saved):
    _, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", device_map="cpu")
    prompt = tokens()[:1, :5]
    with torch.no_grad():
        generated = loaded.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
        expected = prompt
        for _ in range(5):
            expected = torch.cat([expected, loaded(expected).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, expected)


def test_save_pretrained_round_trips(saved, tmp_path):
    model, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(again(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)
    first = json.loads((folder / "dofla_plan.json").read_text())
    second = json.loads((tmp_path / "again" / "dofla_plan.json").read_text())
    assert second["plan"] == first["plan"] and second["teacher_weights"] == first["teacher_weights"]


def test_from_config_builds_a_converted_model(saved):
    _, folder = saved
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert isinstance(built, ConvertedModel) and built.dofla_plan is not None
    assert type(unconvert(built)) is LlamaForCausalLM  # unconvert gives the teacher's class back


def test_folder_with_the_teachers_config_still_loads(saved):
    model, folder = saved
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))  # the layout before DoflaConfig
    loaded, _, _ = load_converted(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)


def test_unsupported_arguments_and_places_fail_clearly(saved, tmp_path):
    _, folder = saved
    with pytest.raises(DoflaError, match="cannot be loaded with quantization_config"):
        AutoModelForCausalLM.from_pretrained(folder, quantization_config={"bits": 4})
    with pytest.raises(DoflaError, match="onto one device"):
        AutoModelForCausalLM.from_pretrained(folder, device_map={"model": "cpu", "lm_head": "cpu"})
    with pytest.raises(DoflaError, match="not a local folder"):
        DoflaForCausalLM.from_pretrained(tmp_path / "missing")
    config = json.loads((folder / "config.json").read_text())
    config["plan"]["layers"][0]["feature_dim"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DoflaError, match="hold different plans"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_import_dofla_stays_light_and_registers_once_transformers_is_imported():
    import subprocess
    import sys

    script = (
        "import sys, dofla\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "print(type(AutoConfig.for_model('dofla')).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DoflaConfig"
