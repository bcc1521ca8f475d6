"""The main job on a tiny model: plan -> convert -> distill (-> LoRA) -> evaluate -> save + report."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_distill import VOCAB, tiny_converted

from dofla.convert import unconvert
from dofla.data import parse_tokens, split_train_heldout
from dofla.demo import demo_config
from dofla.errors import DoflaError
from dofla.loading import load_converted
from dofla.models.surgery import students
from dofla.pipeline import linearize, perplexity
from dofla.run_config import CONFIG_FILE, LinearizeConfig, load_config
from dofla.setting_values import merge
from dofla.settings import LoraSettings, PlanSettings

LENGTH = 32


def tiny_teacher():
    return unconvert(tiny_converted())


def sequences(count=24, seed=0):
    return torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(seed))


def config(tmp_path, **changes):
    """A tiny run's config; ``changes`` nested by section like a config file (what they set, a recipe keeps)."""
    settings = dict(
        out_dir=str(tmp_path / "run"),
        progress=False,
        command="dofla linearize tiny --test",
        teacher=dict(model="tiny-llama"),
        data=dict(seq_len=LENGTH, heldout_fraction=0.25),
        plan=dict(allocation="fix", budget=8),
        distill=dict(tokens=4 * LENGTH * 8, eval_every=4, checkpoint_every=4),
    )
    return LinearizeConfig.from_dict(merge(settings, changes))


def test_linearize_saves_evaluates_and_reports(tmp_path):
    teacher = tiny_teacher()
    data = sequences()
    settings = config(tmp_path)
    result = linearize(settings, teacher=teacher, sequences=data)
    run = tmp_path / "run"
    assert load_config(run / CONFIG_FILE) == settings  # the run's resolved settings, reloadable exactly
    assert result.report_path == run / "report.md" and result.out_dir == run / "model"
    report = result.report_path.read_text()
    assert (
        "dofla linearize tiny --test" in report
        and f"| teacher (softmax) | {result.teacher_ppl:.3f} |" in report
    )
    assert "![loss curves](loss_curves.png)" in report and (run / "loss_curves.png").stat().st_size > 1000
    summary = json.loads((run / "result.json").read_text())
    assert summary["train_sequences"] == 18 and summary["heldout_sequences"] == 6
    assert summary["distill_tokens"] == 4 * LENGTH * 8 and summary["converted_layers"] == [0, 1]
    # the saved model reloads with the same held-out perplexity as the one measured in the run
    model, _, plan = load_converted(result.out_dir)
    assert [layer.feature_dim for layer in plan.layers] == [8, 8]
    assert plan.position_period == LENGTH and summary["position_period"] == LENGTH  # the trained length
    assert f"rotary positions modulo {LENGTH} tokens" in report
    _, heldout = split_train_heldout(data, 0.25, seed=0)
    assert perplexity(model, heldout) == pytest.approx(result.student_ppl, rel=1e-5)
    assert perplexity(tiny_teacher(), heldout) == pytest.approx(result.teacher_ppl, rel=1e-5)
    # the per-layer attention errors in result.json are those of the saved model on the held-out data
    from dofla.evaluation.attention_error import attention_errors

    measured = attention_errors(model, [heldout[:4], heldout[4:8]])
    assert sorted(summary["attention_errors"]) == ["0", "1"]
    for layer, errors in measured.items():
        assert summary["attention_errors"][str(layer)]["relative_error"] == pytest.approx(
            errors["relative_error"], rel=1e-4
        )
    assert "| attention error |" in report


def test_position_period_off_or_refused_where_the_teacher_has_no_rotary(tmp_path):
    from dofla.models import build_tiny_model
    from dofla.models.tiny import TINY_VOCAB

    rows = torch.randint(0, TINY_VOCAB, (24, LENGTH), generator=torch.Generator().manual_seed(0))
    short = dict(distill=dict(tokens=4 * LENGTH * 2), evaluate=dict(passkey_trials=0, error_sequences=0))
    off = config(tmp_path / "off", **merge(short, dict(plan=dict(position_period=0))))
    result = linearize(off, teacher=tiny_teacher(), sequences=sequences())
    assert load_converted(result.out_dir)[2].position_period is None
    assert "read the true rotary positions" in result.report_path.read_text()
    gpt2 = dict(teacher=dict(model="tiny-gpt2"))
    result = linearize(
        config(tmp_path / "gpt2", **merge(short, gpt2)), teacher=build_tiny_model("gpt2"), sequences=rows
    )
    assert load_converted(result.out_dir)[2].position_period is None  # nothing to wrap: left unset
    given = config(tmp_path / "given", **merge(short, gpt2, dict(plan=dict(position_period=16))))
    with pytest.raises(
        DoflaError, match="--position-period wraps rotary positions, and the teacher tiny-gpt2"
    ):
        linearize(given, teacher=build_tiny_model("gpt2"), sequences=rows)
    assert not (tmp_path / "given" / "run" / "distill").exists()  # refused before any training
    edge = config(tmp_path / "edge", **merge(short, gpt2, dict(evaluate=dict(edge_sinks=True))))
    with pytest.raises(DoflaError, match="sinks at the window's edge move rotary positions"):
        linearize(edge, teacher=build_tiny_model("gpt2"), sequences=rows)
    assert not (tmp_path / "edge" / "run" / "distill").exists()


def test_sinks_at_edge_by_default_where_a_hybrid_plan_has_sinks_and_the_teacher_one_fixed_rotary(tmp_path):
    from dofla.convert import plan_for
    from dofla.models import build_tiny_model
    from dofla.run_positions import resolve_sinks_at_edge

    hybrid = dict(kind="hybrid", window=8, sinks=2)
    llama, gpt2, mistral = build_tiny_model("llama"), build_tiny_model("gpt2"), build_tiny_model("mistral")

    def resolved(plan: dict, model) -> bool:
        return resolve_sinks_at_edge(
            config(tmp_path, plan=plan), model, plan_for(model, convert_windowed=True)
        )

    assert resolved(hybrid, llama)
    assert not resolved(hybrid, gpt2)  # learned positions: nothing to turn
    assert not resolved(dict(hybrid, sinks=0), llama)
    assert not resolved(dict(kind="linear"), llama)
    assert not resolved(dict(hybrid, sinks_at_edge=False), llama)
    # the teacher's own sliding-window layers converted: their masked attention has no edge-sink baseline
    assert not resolved(hybrid, mistral)
    with pytest.raises(DoflaError, match="--sinks-at-edge is measured on unmasked, uncapped attention"):
        resolved(dict(hybrid, sinks_at_edge=True), mistral)
    gemma2 = build_tiny_model("gemma2")  # soft-capped attention
    assert not resolved(hybrid, gemma2)
    with pytest.raises(DoflaError, match="soft-caps its attention"):
        resolved(dict(hybrid, sinks_at_edge=True), gemma2)


def test_sinks_at_edge_trains_saves_and_reports_the_edge_baselines_beside_the_student(tmp_path):
    hybrid = dict(kind="hybrid", window=8, sinks=2)
    with pytest.raises(DoflaError, match="--sinks-at-edge moves the sinks of hybrid layers"):
        config(tmp_path / "none", plan=dict(hybrid, sinks=0, sinks_at_edge=True)).validate()
    settings = config(
        tmp_path,
        plan=dict(hybrid, sinks_at_edge=True),
        distill=dict(tokens=4 * LENGTH * 2, loss="output_mse"),
        evaluate=dict(passkey_trials=0, error_sequences=0, recall=False),
    )
    result = linearize(settings, teacher=tiny_teacher(), sequences=sequences())
    model, _, plan = load_converted(result.out_dir)
    assert plan.sinks_at_edge and all(s.edge_sink_frequencies is not None for s in students(model).values())
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    assert "window+sinks2@edge" in summary["long_context"]["by_length"][str(LENGTH)]["models"]
    assert "see their sinks from the window's edge" in result.report_path.read_text()


def test_the_report_scores_recall_beyond_the_window_on_the_held_out_rows(tmp_path):
    from dofla.evaluation.recall import recall_beyond_window

    data = sequences()
    settings = config(
        tmp_path, plan=dict(kind="hybrid", window=8), evaluate=dict(passkey_trials=0, edge_sinks=True)
    )
    result = linearize(settings, teacher=tiny_teacher(), sequences=data)
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [item["length"] for item in summary["recall"]] == [LENGTH]
    assert "window+sinks4@edge" in summary["long_context"]["by_length"][str(LENGTH)]["models"]
    model, _, plan = load_converted(result.out_dir)
    assert plan.position_period == LENGTH  # the memories beside windows read wrapped positions too
    _, heldout = split_train_heldout(data, 0.25, seed=0)
    again = recall_beyond_window(tiny_teacher(), model, heldout, window=8, sinks=4, batch_size=2)
    for name, row in summary["recall"][0]["models"].items():
        assert row["nll"] == pytest.approx(again["models"][name]["nll"], rel=1e-5)
    assert "## Recall beyond the window" in result.report_path.read_text()
    # rows too short for a span beyond the window (64 here) are not scored
    assert json.loads((tmp_path / "run" / "result.json").read_text())["config"]["evaluate"]["recall"] is True
    short = linearize(
        config(tmp_path / "short", evaluate=dict(passkey_trials=0)), teacher=tiny_teacher(), sequences=data
    )
    assert json.loads((short.out_dir.parent / "result.json").read_text())["recall"] is None


def test_resume_after_a_finished_run_gives_the_same_students(tmp_path):
    first = linearize(config(tmp_path), teacher=tiny_teacher(), sequences=sequences())
    again = linearize(config(tmp_path, resume=True), teacher=tiny_teacher(), sequences=sequences())
    assert again.student_ppl == pytest.approx(first.student_ppl, rel=1e-6)


def test_lolcats_recipe_runs_hybrid_output_mse_then_lora(tmp_path):
    cfg = config(tmp_path, recipe="lolcats", lora=dict(tokens=4 * LENGTH * 4))
    result = linearize(cfg, teacher=tiny_teacher(), sequences=sequences())
    settings = json.loads((tmp_path / "run" / "result.json").read_text())["config"]
    assert settings["plan"]["kind"] == "hybrid" and settings["distill"]["loss"] == "output_mse"
    assert settings["plan"]["allocation"] == "fix" and settings["plan"]["budget"] == 8  # set here: kept
    assert settings["lora"]["enabled"] is True
    assert (settings["lora"]["lr"], settings["lora"]["kl_weight"]) == (3e-3, 1.0)
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    assert "- LoRA stage: 512 tokens, rank 8, alpha 16, lr 0.003, KL weight" in result.report_path.read_text()
    _, _, plan = load_converted(result.out_dir)
    assert {layer.kind for layer in plan.layers} == {"hybrid"} and plan.layers[0].feature_map == "hedgehog"
    assert summary["lora_teacher_ppl"] is None


def test_a_window_only_plan_skips_attention_transfer_and_trains_its_lora_stage(tmp_path):
    changes = dict(
        plan=dict(kind="hybrid", window=8, sinks=2),
        student=dict(cell="window"),
        distill=dict(loss="output_mse"),
        lora=dict(enabled=True, tokens=4 * LENGTH * 4),
    )
    result = linearize(config(tmp_path, **changes), teacher=tiny_teacher(), sequences=sequences())
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    assert summary["distill_steps"] == 0 and summary["distill_tokens"] == 0
    report = result.report_path.read_text()
    assert "- No attention transfer: the students have no trainable parameters" in report
    assert "- LoRA stage: 512 tokens" in report
    # the LoRA stage trained the window baseline: the student is no longer the untrained window + sinks row
    untrained = summary["long_context"]["by_length"][str(LENGTH)]["models"]["window+sinks2"]["perplexity"]
    assert result.student_ppl != pytest.approx(untrained, rel=1e-4)


def test_lora_baseline_is_reported_and_leaves_the_student_unchanged(tmp_path):
    changes = dict(recipe="lolcats", lora=dict(tokens=4 * LENGTH * 4), evaluate=dict(lengths=[2 * LENGTH]))
    rows = torch.randint(0, VOCAB, (24, 2 * LENGTH), generator=torch.Generator().manual_seed(0))
    plain = linearize(config(tmp_path / "a", **changes), teacher=tiny_teacher(), sequences=rows)
    with_baseline = merge(changes, dict(lora=dict(baseline=True)))
    result = linearize(config(tmp_path / "b", **with_baseline), teacher=tiny_teacher(), sequences=rows)
    summary = json.loads((tmp_path / "b" / "run" / "result.json").read_text())
    # the baseline trains on a restored copy: the student comes out exactly as without it
    assert result.student_ppl == pytest.approx(plain.student_ppl, rel=1e-6)
    baseline = summary["lora_teacher_ppl"]
    assert (
        baseline is not None
        and result.lora_teacher_ppl == baseline
        and baseline != pytest.approx(result.teacher_ppl, rel=1e-4)
    )
    assert f"| teacher + the same LoRA stage | {baseline:.3f} |" in result.report_path.read_text()
    # measured at every held-out length, the training length's as above
    by_length = summary["lora_teacher_by_length"]
    assert set(by_length) == {str(LENGTH), str(2 * LENGTH)} and by_length[str(LENGTH)] == baseline
    assert (
        f"{2 * LENGTH} tokens {by_length[str(2 * LENGTH)]:.3f}, student / it"
        in result.report_path.read_text()
    )


def test_lora_baseline_trains_the_teachers_adapters_when_the_students_train_end_to_end(tmp_path):
    # the teacher has no converted layers: its baseline trains only the adapters instead of refusing
    changes = dict(recipe="lolcats", lora=dict(tokens=4 * LENGTH * 4, train_students=True, baseline=True))
    result = linearize(config(tmp_path, **changes), teacher=tiny_teacher(), sequences=sequences())
    baseline = json.loads((tmp_path / "run" / "result.json").read_text())["lora_teacher_ppl"]
    assert baseline is not None and baseline != pytest.approx(result.teacher_ppl, rel=1e-4)


@pytest.mark.parametrize(
    "changes, data, message",
    [
        (
            dict(data=dict(seq_len=512), distill=dict(batch_size=2)),
            sequences(),
            "--seq-len 512 is beyond the model's context of 128",
        ),
        (dict(distill=dict(tokens=0)), sequences(), "token budget must be positive, got 0"),
        (dict(), sequences(1), "sequence"),
        (dict(plan=dict(allocation="random")), sequences(), "unknown allocation 'random'"),
        (dict(recipe="nope"), sequences(), "unknown recipe 'nope'"),
    ],
)
def test_bad_inputs_are_clear_errors(tmp_path, changes, data, message):
    with pytest.raises(DoflaError, match=message):
        linearize(config(tmp_path, **changes), teacher=tiny_teacher(), sequences=data)


def test_parse_tokens_and_demo_config(tmp_path):
    assert (
        parse_tokens("2M") == 2_000_000 and parse_tokens("500k") == 500_000 and parse_tokens("1e5") == 100_000
    )
    assert parse_tokens(1234) == 1234
    with pytest.raises(DoflaError, match="cannot read the token count 'lots'"):
        parse_tokens("lots")
    demo = demo_config(tmp_path)
    assert demo.teacher.model == "smollm2-135m" and demo.distill.tokens > 0 and demo.out_dir == str(tmp_path)


def test_command_parses_arguments():
    from dofla.commands import linearize as command

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    args = parser.parse_args(
        ["linearize", "smollm2-135m", "--budget", "32", "--tokens", "1M", "--out", "x", "--recipe", "lolcats"]
    )
    given = vars(args)
    assert args.func is command.run and given["plan.budget"] == "32" and given["distill.tokens"] == "1M"
    assert (given["recipe"], given["teacher.model"]) == ("lolcats", "smollm2-135m")
    assert command.config_from_args(args).distill.tokens == 1_000_000


def test_dof_allocation_gives_a_plan_with_the_mean_budget(tmp_path):
    cfg = config(
        tmp_path,
        plan=dict(allocation="dof", budget=8, dof_points=32),
        distill=dict(tokens=4 * LENGTH * 2, eval_every=0),
    )
    result = linearize(cfg, teacher=tiny_teacher(), sequences=sequences())
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    dims = [layer["feature_dim"] for layer in plan["layers"]]
    assert sum(dims) / len(dims) == pytest.approx(8, abs=0.5)
    assert plan["metadata"]["allocation"] == "dof" and plan["metadata"]["measure"] == "dof"
    assert "Allocation `dof` (measure `dof`)" in result.report_path.read_text()


def test_explicit_options_win_over_the_recipe():
    from dofla.cli import build_parser
    from dofla.commands.linearize import config_from_args

    # built directly: the names in overrides are kept from the recipe
    config = LinearizeConfig(
        out_dir="x",
        recipe="dof-paper",
        plan=PlanSettings(allocation="fix"),
        lora=LoraSettings(enabled=True),
        overrides=["plan.allocation", "lora.enabled"],
    )
    config.apply_recipe()
    assert (config.plan.allocation, config.lora.enabled) == ("fix", True)
    assert (config.distill.loss, config.student.feature_map) == ("softmax", "learnable_prf")
    args = build_parser().parse_args(
        ["linearize", "--out", "x", "--recipe", "lolcats", "--allocation", "dof"]
    )
    assert (
        vars(args)["plan.allocation"] == "dof"
        and "plan.kind" not in vars(args)
        and "lora.enabled" not in vars(args)
    )
    recipe = config_from_args(args)
    assert (recipe.plan.allocation, recipe.lora.lr, recipe.lora.kl_weight) == ("dof", 3e-3, 1.0)
    args = build_parser().parse_args(
        ["linearize", "--out", "x", "--recipe", "lolcats", "--lora-lr", "1e-4", "--lora-kl", "0"]
    )
    explicit = config_from_args(args)
    assert (explicit.lora.lr, explicit.lora.kl_weight, explicit.plan.kind) == (1e-4, 0.0, "hybrid")
    args = build_parser().parse_args(["linearize", "--out", "x", "--recipe", "lolcats", "--no-lora"])
    assert config_from_args(args).lora.enabled is False  # a recipe's switch can be turned off too


def test_the_demo_command_line_of_the_makefile_parses():
    from dofla.cli import build_parser

    args = build_parser().parse_args(["demo", "--data", "text.txt", "--out", "o"])
    assert (args.data, args.out, args.resume) == ("text.txt", "o", False)


def test_the_demo_trains_and_evaluates_on_shipped_text_of_two_sources():
    from dofla.data import load_texts
    from dofla.demo import DEMO_HELDOUT_TEXT, DEMO_TEXT, DEMO_TRAIN_TEXT

    demo = demo_config("out")
    assert (demo.data.path, demo.data.heldout_path) == (str(DEMO_TRAIN_TEXT), str(DEMO_HELDOUT_TEXT))
    assert demo.data.heldout_sequences >= 16 and 1024 in demo.evaluate.lengths
    train, heldout = load_texts(DEMO_TRAIN_TEXT), load_texts(DEMO_HELDOUT_TEXT)
    assert len(train) == 100 and len(heldout) == 3
    assert not set(train) & set(heldout)
    license_text = (DEMO_TEXT / "LICENSE.md").read_text()
    assert "ODC-By" in license_text and "CC BY-SA 4.0" in license_text


def test_heldout_data_of_another_source_is_measured_and_every_data_row_trains(tmp_path):
    from dofla.models import build_tiny_model, build_tiny_tokenizer
    from dofla.run_data import prepare_data

    heldout_file = tmp_path / "heldout.txt"
    heldout_file.write_text("\n".join(f"held out line {i} " * 8 for i in range(20)))
    rows = torch.randint(3, 128, (12, 2 * LENGTH), generator=torch.Generator().manual_seed(0))
    settings = config(
        tmp_path,
        data=dict(heldout_path=str(heldout_file), heldout_sequences=5),
        evaluate=dict(lengths=[2 * LENGTH]),
    )
    data = prepare_data(settings, build_tiny_model("llama"), build_tiny_tokenizer(), rows, tmp_path / "cache")
    assert torch.equal(data.train, rows.reshape(-1, LENGTH))  # every row trains, none is held out
    assert data.heldout_by_length[2 * LENGTH].shape == (5, 2 * LENGTH)
    assert data.heldout_by_length[LENGTH].shape == (10, LENGTH)
    text = build_tiny_tokenizer().decode(data.heldout_by_length[2 * LENGTH][0])
    assert text.startswith("held out line 0") and "held-out text: " in data.source
    with pytest.raises(DoflaError, match="does not exist"):
        config(tmp_path, data=dict(heldout_path=str(tmp_path / "missing.txt"))).validate()


def test_long_context_recipe_evaluates_every_length_beside_the_window_baselines(tmp_path):
    """The gla recipe (window + sinks, a decay cell) at a short training length, measured at 2x that length."""
    teacher = tiny_teacher()
    data = torch.randint(0, VOCAB, (12, 2 * LENGTH), generator=torch.Generator().manual_seed(3))
    settings = dict(  # seq_len, window and budget are set explicitly: the recipe keeps its hands off them
        recipe="gla",
        plan=dict(window=4),
        evaluate=dict(lengths=[2 * LENGTH], passkey_trials=0),
        lora=dict(tokens=2 * LENGTH),
    )
    result = linearize(config(tmp_path, **settings), teacher=teacher, sequences=data)
    summary = json.loads((tmp_path / "run" / "result.json").read_text())
    plan = load_converted(result.out_dir)[2]
    assert {(layer.cell, layer.sinks, layer.window) for layer in plan.layers} == {("gla", 4, 4)}
    assert plan.sinks_at_edge  # by default for a rotary teacher's windows with sinks
    by_length = summary["long_context"]["by_length"]
    assert sorted(by_length, key=int) == [str(LENGTH), str(2 * LENGTH)]
    for measured in by_length.values():  # the edge baseline beside the student, as its own cache
        assert set(measured["models"]) == {
            "teacher",
            "window",
            "window+sinks4",
            "window+sinks4@edge",
            "streaming",
            "heavy-hitter",
            "student",
        }
        assert measured["models"]["student"]["kl"] is not None
    # held-out rows were split off before cutting: the training-length pieces are the long rows cut in two
    assert summary["heldout_sequences"] == 2 * by_length[str(2 * LENGTH)]["sequences"]
    assert by_length[str(LENGTH)]["models"]["student"]["perplexity"] == pytest.approx(result.student_ppl)
    report = result.report_path.read_text()
    assert "window 64" not in report and "window 4 + 4 sinks" in report.replace("`", "")


def recall_budgets_at_training(monkeypatch) -> list[int]:
    """The list that the attention-transfer stage, when it starts, fills with each student's recall budget."""
    from dofla import pipeline

    trained_with, distill_stage = [], pipeline.distill_stage

    def recording(config, model, *args):
        trained_with.extend(student.recall_budget for student in students(model).values())
        return distill_stage(config, model, *args)

    monkeypatch.setattr(pipeline, "distill_stage", recording)
    return trained_with


def test_the_recall_cache_is_switched_on_after_training_evaluated_and_saved(tmp_path, monkeypatch):
    """--recall-cache K: the gated-delta hybrid trains without the cache, then takes it (no parameters) for the
    evaluation and the saved model, which reads the true positions (no position period)."""
    settings = dict(
        recipe="gated-delta",
        plan=dict(window=4, budget=8),
        student=dict(recall_cache=3),
        evaluate=dict(passkey_trials=0, recall=False),
        lora=dict(enabled=False),
    )
    trained_with = recall_budgets_at_training(monkeypatch)
    result = linearize(config(tmp_path, **settings), teacher=tiny_teacher(), sequences=sequences())
    assert trained_with == [0, 0]  # trained without the cache
    model, _, plan = load_converted(result.out_dir)
    assert [layer.options["recall_cache"] for layer in plan.layers] == [3, 3]
    assert plan.position_period is None and {
        student.recall_budget for student in students(model).values()
    } == {3}
    _, heldout = split_train_heldout(sequences(), 0.25, seed=0)
    assert perplexity(model, heldout) == pytest.approx(result.student_ppl, rel=1e-5)


def test_a_recall_cache_trained_in_the_loop_reads_true_positions_to_the_end(tmp_path, monkeypatch):
    """The cell option recall_cache: the hybrid trains with the cache, and the run gives it no position
    period (the cache reads the true positions), so it evaluates and saves; an explicit period is refused
    before any work."""
    settings = dict(
        recipe="gated-delta",
        plan=dict(window=4, budget=8),
        student=dict(cell_options={"window_factor": 0.9, "recall_cache": 3}),
        evaluate=dict(passkey_trials=0, recall=False),
        lora=dict(enabled=False),
    )
    trained_with = recall_budgets_at_training(monkeypatch)
    result = linearize(config(tmp_path / "run", **settings), teacher=tiny_teacher(), sequences=sequences())
    assert trained_with == [3, 3]
    _, _, plan = load_converted(result.out_dir)
    assert plan.position_period is None
    with pytest.raises(DoflaError, match="reads the true positions, and this run sets --position-period 8"):
        linearize(
            config(tmp_path / "other", **{**settings, "plan": dict(window=4, budget=8, position_period=8)})
        )


def test_rows_fall_back_to_the_longest_length_the_data_fills(tmp_path):
    from dofla.data import cut_rows, pack_rows

    class Tokenizer:  # one token per character, no end-of-text token
        eos_token_id = None

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[ord(c) % 50 for c in text] for text in texts]}

    rows = pack_rows(
        Tokenizer(), ["x" * 300], [16, 64, 256], 16
    )  # 300 tokens: one row of 256 is too few, four of 64 do
    assert rows.shape == (4, 64)
    assert cut_rows(rows, 16).shape == (16, 16) and torch.equal(cut_rows(rows, 16)[:4].reshape(-1), rows[0])
    with pytest.raises(DoflaError, match="at least 2 are needed"):
        pack_rows(Tokenizer(), ["x" * 20], [16, 64], 16)


def test_window_choice_of_softmax_layers_from_the_run_config(tmp_path):
    """--softmax-choice window measures each layer's window cost on the calibration batches and keeps the
    costliest as softmax; the plan records the costs, the report's window baseline cuts only the others."""
    plan = dict(kind="hybrid", window=4, sinks=1, keep_softmax=1, softmax_choice="window")
    settings = dict(plan=plan, distill=dict(loss="output_mse"))
    linearize(config(tmp_path, **settings), teacher=tiny_teacher(), sequences=sequences())
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    costs = plan["metadata"]["window_cost"]
    assert len(costs) == 2 and plan["metadata"]["softmax_layers"] == [max(range(2), key=costs.__getitem__)]
    assert [layer["kind"] for layer in plan["layers"]].count("softmax") == 1


def test_measured_allocation_and_kept_softmax_layers_from_the_run_config(tmp_path):
    """--allocation measured keeps its error curves in the run folder (a rerun reads them instead of fitting
    again); --keep-softmax K leaves K layers softmax, chosen by --softmax-choice."""
    settings = dict(plan=dict(allocation="measured", budget=8, keep_softmax=1, softmax_choice="measured"))
    first = linearize(config(tmp_path, **settings), teacher=tiny_teacher(), sequences=sequences())
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    kinds = [layer["kind"] for layer in plan["layers"]]
    assert sorted(kinds) == ["linear", "softmax"] and plan["metadata"]["softmax_choice"] == "measured"
    curves = sorted(path.name for path in run.glob("error_curves*.json"))
    assert len(curves) == 2 and "error_curves.json" in curves

    import dofla.planning.error_curves as error_curves

    def refuse(*args, **kwargs):
        raise AssertionError("the curves were measured again")

    original = error_curves.measure_error_curves
    error_curves.measure_error_curves = refuse
    try:
        again = linearize(
            config(tmp_path, overwrite=True, **settings), teacher=tiny_teacher(), sequences=sequences()
        )
    finally:
        error_curves.measure_error_curves = original
    assert again.student_ppl == pytest.approx(first.student_ppl, rel=1e-6)


def test_gated_delta_linear_recipe_converts_every_layer_to_a_convolved_memory_and_trains_it_in_lora(tmp_path):
    """The pure-linear recipe: no window or sinks anywhere, the gated delta cell with its short convolution,
    and a LoRA stage that trains the converted layers as well as the adapters."""
    cfg = config(tmp_path, recipe="gated-delta-linear", lora=dict(tokens=4 * LENGTH * 4))
    result = linearize(cfg, teacher=tiny_teacher(), sequences=sequences())
    settings = json.loads((tmp_path / "run" / "result.json").read_text())["config"]
    assert settings["lora"]["train_students"] is True and settings["plan"]["sinks"] == 0
    _, _, plan = load_converted(result.out_dir)
    assert {(layer.kind, layer.cell, layer.feature_map) for layer in plan.layers} == {
        ("linear", "gated_delta", "projection")
    }
    assert {layer.options["short_conv"] for layer in plan.layers} == {8}


def test_a_run_killed_in_its_lora_stage_resumes_there_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """The LoRA stage checkpoints every ``checkpoint_every`` steps; ``--resume`` continues from the newest
    checkpoint (not from step 0) and gives the same student as a run never stopped. Other LoRA settings on
    resume are refused in one sentence naming the stage's folder."""
    from dofla.distill import lora

    changes = dict(
        recipe="gated-delta-linear",
        distill=dict(checkpoint_every=2),
        lora=dict(tokens=6 * LENGTH * 4, tokens_per_forward=LENGTH),  # 6 steps of 4 rows
        evaluate=dict(passkey_trials=0, recall=False, lengths=[LENGTH]),
    )
    whole = linearize(config(tmp_path / "whole", **changes), teacher=tiny_teacher(), sequences=sequences())
    original, calls = lora.piece_loss_backward, []

    def killed_in_step_five(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4 * 4:  # 4 pieces a step: the fifth step's first piece
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(lora, "piece_loss_backward", killed_in_step_five)
    with pytest.raises(KeyboardInterrupt):
        linearize(config(tmp_path / "cut", **changes), teacher=tiny_teacher(), sequences=sequences())
    stage = tmp_path / "cut" / "run" / "lora"
    assert json.loads((stage / "checkpoints" / "latest.json").read_text())["step"] == 4
    logged = [json.loads(line)["step"] for line in (stage / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4]
    calls.clear()
    monkeypatch.setattr(
        lora, "piece_loss_backward", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    )
    resumed = linearize(
        config(tmp_path / "cut", resume=True, **changes), teacher=tiny_teacher(), sequences=sequences()
    )
    assert len(calls) == 2 * 4  # only the last two steps ran
    assert resumed.student_ppl == pytest.approx(whole.student_ppl, rel=1e-6)
    logged = [json.loads(line)["step"] for line in (stage / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]
    summary = json.loads((tmp_path / "cut" / "run" / "result.json").read_text())
    assert summary["student_ppl"] == pytest.approx(whole.student_ppl, rel=1e-6)
    other = merge(changes, dict(lora=dict(lr=1e-4)))
    with pytest.raises(DoflaError, match="LoRA checkpoint in .*lora.* other LoRA settings"):
        linearize(
            config(tmp_path / "cut", resume=True, **other), teacher=tiny_teacher(), sequences=sequences()
        )


def recorded_lora_rows(monkeypatch) -> list:
    """The rows each LoRA stage gets, recorded; the stage itself is skipped (the run goes on untrained)."""
    import dofla.pipeline as pipeline

    seen = []

    def lora_stage(config, model, train, history):
        seen.append(train)
        return model, history

    monkeypatch.setattr(pipeline, "lora_stage", lora_stage)
    return seen


def test_lora_needles_train_the_lora_stage_on_rows_that_ask_for_their_facts(tmp_path, monkeypatch):
    from dofla.models import build_tiny_model, build_tiny_tokenizer

    seen = recorded_lora_rows(monkeypatch)
    tokenizer = build_tiny_tokenizer()
    rows = torch.randint(3, 90, (12, 512), generator=torch.Generator().manual_seed(0))
    changes = dict(
        data=dict(seq_len=512),
        plan=dict(kind="hybrid", window=16),
        distill=dict(tokens=512 * 4, eval_every=0, checkpoint_every=0),
        lora=dict(enabled=True, tokens=1024, needle_fraction=1.0),
        evaluate=dict(lengths=[], passkey_trials=0, recall=False, error_sequences=0),
    )
    teacher = build_tiny_model("llama", vocab_size=len(tokenizer))
    result = linearize(config(tmp_path, **changes), teacher=teacher, tokenizer=tokenizer, sequences=rows)
    train, _ = split_train_heldout(rows, 0.25, 0)
    assert seen[0].shape == train.shape and (seen[0] != train).any(dim=1).all()  # every row got its facts
    assert all(" What is the " in tokenizer.decode(row[-80:]) for row in seen[0])
    assert "100% of its rows state five-digit facts that their last tokens ask for, at least 16 tokens" in (
        result.report_path.read_text()
    )
    short = config(tmp_path / "short", **merge(changes, dict(data=dict(seq_len=128))))
    with pytest.raises(
        DoflaError, match="too short for 4 needles more than 16 tokens before their questions"
    ):
        linearize(short, teacher=teacher, tokenizer=tokenizer, sequences=rows[:, :128])
    assert not (tmp_path / "short" / "run" / "distill").exists()  # refused before any training
    with pytest.raises(DoflaError, match="--lora-needles writes its facts as text, which needs the teacher"):
        linearize(config(tmp_path / "none", **changes), teacher=teacher, sequences=rows)


def test_lora_seq_len_cuts_the_lora_rows_longer_from_the_same_training_rows(tmp_path, monkeypatch):
    """--lora-seq-len: attention transfer on rows of --seq-len, the LoRA stage (and its needle rows) on
    longer rows cut from the same training rows (no held-out text); longer than the packed rows: refused
    before any training."""
    from dofla.data import cut_rows
    from dofla.models import build_tiny_model, build_tiny_tokenizer

    seen = recorded_lora_rows(monkeypatch)
    tokenizer = build_tiny_tokenizer()
    rows = torch.randint(3, 90, (12, 512), generator=torch.Generator().manual_seed(0))
    changes = dict(
        data=dict(seq_len=256),
        plan=dict(kind="hybrid", window=16),
        distill=dict(tokens=256 * 4, eval_every=0, checkpoint_every=0),
        lora=dict(enabled=True, tokens=1024, needle_fraction=0.5, seq_len=512),
        evaluate=dict(lengths=[], passkey_trials=0, recall=False, error_sequences=0),
    )

    def teacher():
        return build_tiny_model("llama", vocab_size=len(tokenizer))

    linearize(config(tmp_path, **changes), teacher=teacher(), tokenizer=tokenizer, sequences=rows)
    train, _ = split_train_heldout(rows, 0.25, 0)
    assert seen[0].shape == train.shape  # whole 512-token training rows
    changed = (seen[0] != train).any(dim=1)
    assert changed.sum() == round(len(train) * 0.5)  # half of them needle rows
    torch.testing.assert_close(seen[0][~changed], train[~changed])
    shorter = dict(lora=dict(seq_len=None, needle_fraction=0.0))
    linearize(config(tmp_path / "default", **merge(changes, shorter)), teacher=teacher(), sequences=rows)
    torch.testing.assert_close(seen[1], cut_rows(train, 256))  # without it: the training rows
    longer = config(tmp_path / "long", **merge(changes, dict(lora=dict(seq_len=1024))))
    with pytest.raises(DoflaError, match="--lora-seq-len 1024 is longer than the packed rows"):
        linearize(longer, teacher=teacher(), tokenizer=tokenizer, sequences=rows)
    assert not (tmp_path / "long" / "run" / "distill").exists()  # refused before any training


def test_gated_delta_retrieval_recipe_keeps_recall_layers_and_trains_lora_on_needle_rows(
    tmp_path, monkeypatch
):
    """The retrieval recipe: the gated-delta hybrid with its window of 128, the layers of the greedy recall
    order kept as softmax, and a LoRA stage training the converted layers on needle rows."""
    import dofla.pipeline as pipeline
    from dofla.models import build_tiny_model, build_tiny_tokenizer

    seen = []
    original = pipeline.lora_stage

    def lora_stage(config, model, train, history):
        seen.append(train)
        return original(config, model, train, history)

    monkeypatch.setattr(pipeline, "lora_stage", lora_stage)
    tokenizer = build_tiny_tokenizer()
    rows = torch.randint(3, 90, (10, 512), generator=torch.Generator().manual_seed(0))
    changes = dict(
        recipe="gated-delta-retrieval",
        data=dict(seq_len=512),
        plan=dict(keep_softmax=2, dof_batches=1),
        distill=dict(tokens=512 * 4, eval_every=0, checkpoint_every=0),
        lora=dict(tokens=512 * 4),
        evaluate=dict(lengths=[], passkey_trials=0, recall=False, error_sequences=0),
    )
    teacher = build_tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=4)
    result = linearize(config(tmp_path, **changes), teacher=teacher, tokenizer=tokenizer, sequences=rows)
    settings = json.loads((tmp_path / "run" / "result.json").read_text())["config"]
    assert settings["lora"]["train_students"] is True and settings["lora"]["needle_fraction"] == 0.5
    assert (settings["plan"]["window"], settings["plan"]["sinks"]) == (128, 4)
    _, _, plan = load_converted(result.out_dir)
    assert plan.metadata["softmax_choice"] == "recall" and len(plan.metadata["softmax_layers"]) == 2
    with_needles = (seen[0] != split_train_heldout(rows, 0.25, 0)[0]).any(dim=1)
    assert with_needles.sum() == round(len(with_needles) * 0.5)  # half the LoRA rows state facts
    assert list((tmp_path / "run").glob("recall_order-*.json"))  # kept for a resumed run
