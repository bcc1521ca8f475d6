"""Every supported family end to end on a tiny model (plan -> convert -> distil a few steps -> evaluate
with the window baselines -> save -> reload -> generate), and the per-family facts the pipeline honours:
beginning-of-sequence tokens in every packed row, Gemma's scaling, soft-capping and per-layer rotary
bases, tied embeddings."""

from __future__ import annotations

import json

import pytest
import torch

from dofla.convert import convert, plan_for
from dofla.data import row_start_token, start_rows
from dofla.evaluation.long_context import pack_by_length
from dofla.loading import load_converted
from dofla.models import FAMILIES, build_tiny_model, build_tiny_tokenizer, get_adapter
from dofla.models.surgery import students
from dofla.models.tiny import TINY_FAMILIES
from dofla.pipeline import linearize, lora_rows
from dofla.rotary import fixed_rotary_frequencies
from dofla.run_config import LinearizeConfig
from dofla.run_data import prepare_data
from dofla.setting_values import merge

LENGTH = 32
BOS = 1  # the tiny tokenizer's <s>


def run_config(tmp_path, family: str, **changes) -> LinearizeConfig:
    settings = dict(
        out_dir=str(tmp_path / "run"),
        progress=False,
        command=f"dofla linearize tiny-{family} --test",
        teacher=dict(model=f"tiny-{family}"),
        data=dict(seq_len=LENGTH, heldout_fraction=0.25),
        plan=dict(allocation="fix", budget=8, kind="hybrid", window=8, sinks=2),
        distill=dict(tokens=4 * LENGTH * 3, eval_every=3, checkpoint_every=3, loss="output_mse"),
        evaluate=dict(lengths=[LENGTH], passkey_trials=0, recall=False, error_sequences=2),
    )
    return LinearizeConfig.from_dict(merge(settings, changes))


def test_every_family_has_a_tiny_model():
    assert {get_adapter(build_tiny_model(family)).model_type for family in TINY_FAMILIES} == set(FAMILIES)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_end_to_end(family, tmp_path):
    teacher, tokenizer = build_tiny_model(family), build_tiny_tokenizer()
    windowed = get_adapter(teacher).windowed_layers()
    every_layer_windowed = len(windowed) == get_adapter(teacher).num_layers  # mistral's tiny teacher
    changes = dict(plan=dict(convert_windowed=True)) if every_layer_windowed else {}
    rows = torch.randint(3, 128, (16, 2 * LENGTH), generator=torch.Generator().manual_seed(0))
    result = linearize(
        run_config(tmp_path, family, **changes), teacher=teacher, tokenizer=tokenizer, sequences=rows
    )
    summary = json.loads((result.run_dir / "result.json").read_text())
    expected = [0, 1] if every_layer_windowed else [i for i in (0, 1) if i not in windowed]
    assert summary["converted_layers"] == expected
    models = summary["long_context"]["by_length"][str(LENGTH)]["models"]
    assert {"teacher", "student"} <= set(models) and any(name.startswith("window") for name in models)
    assert all(torch.isfinite(torch.tensor(row["perplexity"])) for row in models.values())
    # the saved model reloads whole (tied embeddings stay tied) and generates
    model, loaded_tokenizer, plan = load_converted(result.out_dir)
    assert plan.converted_layers == expected and sorted(students(model)) == expected
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    prompt = torch.tensor([[BOS, 10, 11, 12]])
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 8) and loaded_tokenizer is not None


def test_the_teachers_own_window_layers_stay_and_the_report_says_why(tmp_path):
    teacher, tokenizer = build_tiny_model("gemma3"), build_tiny_tokenizer()
    rows = torch.randint(3, 128, (16, 2 * LENGTH), generator=torch.Generator().manual_seed(0))
    result = linearize(run_config(tmp_path, "gemma3"), teacher=teacher, tokenizer=tokenizer, sequences=rows)
    report = result.report_path.read_text()
    assert "| 0 | softmax | kept: the teacher's own sliding window of 8 tokens, a bounded cache |" in report
    assert "| 1 | hybrid | converted (full attention) |" in report
    assert "Layers [0] already attend to the teacher's own sliding window" in report
    assert "layers [0] keep the teacher's own sliding window" in report  # the baselines' note


# ------------------------------------------------------------------------------ beginning-of-sequence


def test_gemma_rows_start_with_bos_and_other_families_rows_are_plain_text(tmp_path):
    tokenizer = build_tiny_tokenizer()
    assert row_start_token(build_tiny_model("gemma2"), tokenizer) == BOS
    assert row_start_token(build_tiny_model("gemma3"), tokenizer) == BOS
    assert row_start_token(build_tiny_model("llama"), tokenizer) is None
    assert row_start_token(build_tiny_model("gemma3"), None) is None
    rows = torch.arange(6).view(2, 3) + 10
    assert torch.equal(start_rows(rows, BOS), torch.tensor([[1, 11, 12], [1, 14, 15]]))
    assert start_rows(rows, None) is rows and rows[0, 0] == 10  # a copy: the caller's rows stay


def test_every_row_a_gemma_run_packs_starts_with_bos(tmp_path):
    """Training, held-out (every length), curriculum and LoRA rows (with needles) all start with <bos>."""
    teacher, tokenizer = build_tiny_model("gemma3"), build_tiny_tokenizer()
    rows = torch.randint(3, 128, (16, 512), generator=torch.Generator().manual_seed(0))
    config = run_config(
        tmp_path,
        "gemma3",
        data=dict(recall_fraction=1.0),
        evaluate=dict(lengths=[LENGTH, 2 * LENGTH, 512]),
        distill=dict(length_schedule=[[LENGTH // 2, 0.5], [LENGTH, 0.5]]),
        lora=dict(
            enabled=True, tokens=LENGTH * 4, seq_len=512, needle_fraction=1.0
        ),  # rows that fit four facts
        plan=dict(window=4),
    )
    data = prepare_data(config, teacher, tokenizer, rows, tmp_path / "cache")
    parts = [data.train, *data.heldout_by_length.values(), *data.shorter_train.values(), data.lora_train]
    parts.append(lora_rows(config, tokenizer, data.lora_train))
    assert len(data.heldout_by_length) == 3
    for part in parts:
        assert (part[:, 0] == BOS).all() and (part[:, 1:] != BOS).all()
    # the same text for a llama teacher is left as it is
    plain = prepare_data(config, build_tiny_model("llama"), tokenizer, rows, tmp_path / "cache")
    assert not (plain.train[:, 0] == BOS).any()
    # `dofla evaluate`'s packing takes the same start token
    packed = pack_by_length(tokenizer, ["abc def ghi " * 40], [16, 32], 4, start_token=BOS)
    assert all((part[:, 0] == BOS).all() for part in packed.values())


# ------------------------------------------------------------------------------ Gemma's own attention


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_window_student_as_wide_as_the_rows_reproduces_gemma_exactly(family):
    """The parameter-free window cell over a converted layer, its window longer than the rows, is the
    teacher's own attention: equal logits need the layer's own scaling (query_pre_attn_scalar 32, not the
    head size 16), soft-capping and rotary base (Gemma 3's global layers: 1e6 against 1e4 for the local
    ones) to reach the student."""
    model = build_tiny_model(family, attn_logit_softcapping=0.5 if family == "gemma2" else None)
    model.set_attn_implementation("eager")  # Gemma 2's soft-capping needs it
    with torch.no_grad():  # peakier attention than random init, so scaling and capping matter
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8.0)
    tokens = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        teacher = model(tokens).logits
    # the facts matter here: the layer with the head size's scaling, or uncapped, gives other logits
    attention = get_adapter(model).attention_modules(model)[1]
    for name, value in (("scaling", 16**-0.5), ("attn_logit_softcapping", None)):
        if getattr(attention, name, None) is None:
            continue  # Gemma 3 has no attention soft-capping
        saved = getattr(attention, name)
        setattr(attention, name, value)
        with torch.no_grad():
            assert (model(tokens).logits - teacher).abs().max() > 1e-3
        setattr(attention, name, saved)
    if family == "gemma3":
        rope = model.config.rope_parameters
        assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
        assert fixed_rotary_frequencies(model) is None  # two rotary embeddings: no position period
    convert(model, plan_for(model, kind="hybrid", cell="window", window=64, feature_dim=1))
    assert sorted(students(model)) == [1]
    with torch.no_grad():
        student = model(tokens).logits
    torch.testing.assert_close(student, teacher, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ memory, planned


def test_a_run_that_cannot_fit_says_so_with_settings_that_fit_before_reading_data(tmp_path, monkeypatch):
    import dofla.evaluation.logits as logits
    import dofla.pipeline as pipeline
    import dofla.run_checks as run_checks
    from dofla.errors import DoflaError

    teacher, tokenizer = build_tiny_model("llama"), build_tiny_tokenizer()
    weights = sum(p.numel() * 4 for p in teacher.parameters())
    per_token = run_checks.activation_bytes_per_token(teacher)
    monkeypatch.setattr(
        logits, "available_memory_bytes", lambda device=None: weights + 2 * LENGTH * per_token + 1
    )
    monkeypatch.setattr(pipeline, "prepare_data", lambda *args, **kwargs: pytest.fail("data read first"))
    config = run_config(
        tmp_path, "llama", lora=dict(enabled=True, tokens=LENGTH * 8, tokens_per_forward=8 * LENGTH)
    )
    rows = torch.randint(3, 128, (16, 2 * LENGTH), generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        DoflaError, match=rf"and 0\.0 GiB are free on cpu; pass --lora-tokens-per-forward {2 * LENGTH}"
    ):
        linearize(config, teacher=teacher, tokenizer=tokenizer, sequences=rows)


def test_vocabulary_pieces_shrink_with_the_free_memory(monkeypatch):
    import dofla.evaluation.logits as logits
    from dofla.evaluation.logits import ROW_ELEMENTS, rows_per_piece

    monkeypatch.setattr(logits, "available_memory_bytes", lambda device=None: 1 << 40)
    assert rows_per_piece(262_144) == ROW_ELEMENTS // 262_144  # the cap: 32 MiB of float32 logits
    # a sixteenth of the free memory, shared by 4 float32 copies: 3 rows
    monkeypatch.setattr(logits, "available_memory_bytes", lambda device=None: 16 * 4 * 4 * 262_144 * 3)
    assert rows_per_piece(262_144, copies=4) == 3
    monkeypatch.setattr(logits, "available_memory_bytes", lambda device=None: 0)
    assert rows_per_piece(262_144) == 1
