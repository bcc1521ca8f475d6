"""Held-out quality at length: buckets, streamed KL / top-1, context limits, the evaluate command."""

import json
import math

import pytest
import torch
from helpers import small_llama
from transformers import DynamicCache

from dofla.cache import held_bytes
from dofla.cli import build_parser, main
from dofla.commands.evaluate import check_arguments
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.evaluation import logits as logits_module
from dofla.evaluation.cache_baselines import CacheBaseline, kv_bytes_per_token
from dofla.evaluation.heavy_hitter import heavy_hitter_restricted
from dofla.evaluation.long_context import long_context_quality, position_buckets
from dofla.evaluation.long_context_report import long_context_markdown, plot_loss_by_position
from dofla.evaluation.perplexity import perplexity
from dofla.evaluation.window_baseline import window_restricted
from dofla.models import build_tiny_model, build_tiny_tokenizer, save_tiny_model_folder
from dofla.saving import save_converted


def _sequences(count, length, seed=0, vocabulary=64):
    return torch.randint(0, vocabulary, (count, length), generator=torch.Generator().manual_seed(seed))


def test_bucket_edges():
    assert position_buckets(1024, 64) == [(1, 64), (64, 128), (128, 256), (256, 512), (512, 1024)]
    assert position_buckets(100, 64) == [(1, 64), (64, 100)]
    assert position_buckets(64, 64) == [(1, 64)]
    assert position_buckets(32, 64) == [(1, 32)]
    assert position_buckets(9, 1) == [(1, 2), (2, 4), (4, 8), (8, 9)]
    with pytest.raises(DoflaError, match="at least 2 tokens"):
        position_buckets(1, 4)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])  # plain, final soft-capping, GPT-2 layout
def test_chunked_head_gives_the_models_own_logits(family, monkeypatch):
    model = build_tiny_model(family)
    tokens = torch.randint(0, 128, (2, 7))
    monkeypatch.setattr(logits_module, "ROW_ELEMENTS", 128 * 3)  # 3 rows per chunk: several chunks
    with torch.no_grad():
        hidden = logits_module.final_hidden_states(model, tokens)
        expected = model(tokens).logits
    torch.testing.assert_close(
        logits_module.output_logits(model, hidden), model(tokens).logits, rtol=0, atol=0
    )
    # perplexity from the chunked head equals cross-entropy of the full logits
    nll = torch.nn.functional.cross_entropy(expected[:, :-1].reshape(-1, 128), tokens[:, 1:].reshape(-1))
    assert perplexity(model, tokens)["nll"] == pytest.approx(float(nll), rel=1e-5)


def test_student_equal_to_teacher_has_zero_kl_and_full_agreement(monkeypatch):
    monkeypatch.setattr(logits_module, "ROW_ELEMENTS", 64 * 5)  # several chunks per batch
    teacher, student = small_llama(), small_llama()
    data = {12: _sequences(3, 12), 20: _sequences(2, 20, seed=1)}
    result = long_context_quality(teacher, student, data, window=4, sinks=(0, 2), batch_size=2)
    for length, measured in result["by_length"].items():
        assert [bucket["label"] for bucket in measured["buckets"]][:2] == ["1-3", "4-7"]
        student_row, teacher_row = measured["models"]["student"], measured["models"]["teacher"]
        assert student_row["kl"] == pytest.approx(0.0, abs=1e-6) and student_row["top1"] == 1.0
        assert student_row["perplexity"] == pytest.approx(teacher_row["perplexity"], rel=1e-6)
        assert all(bucket["kl"] == pytest.approx(0.0, abs=1e-6) for bucket in student_row["buckets"])
        # the teacher's row is its perplexity on these sequences
        expected = perplexity(teacher, data[int(length)])["perplexity"]
        assert teacher_row["perplexity"] == pytest.approx(expected, rel=1e-5)
        # within the window the baseline is the teacher; beyond it, it is not
        window_row = measured["models"]["window"]
        assert window_row["buckets"][0]["kl"] == pytest.approx(0.0, abs=1e-6)
        assert window_row["buckets"][0]["top1"] == 1.0
        assert window_row["kl"] > 1e-4 and window_row["top1"] < 1.0
    rows = ["teacher", "window", "window+sinks2", "streaming", "heavy-hitter", "student"]
    assert list(result["by_length"]["12"]["models"]) == rows
    # this student's cache holds the teacher's whole KV cache: its equal-bytes baselines are the teacher
    for measured in result["by_length"].values():
        assert measured["state_bytes"]["student"] == measured["state_bytes"]["teacher"]
        for name in ("streaming", "heavy-hitter"):
            assert measured["models"][name]["kl"] == pytest.approx(0.0, abs=1e-6)
    json.dumps(result, allow_nan=False)


def test_kl_and_top1_match_full_logits():
    teacher, student = small_llama(seed=0), small_llama(seed=1)
    data = _sequences(3, 10)
    result = long_context_quality(teacher, student, {10: data}, window=4, sinks=(), batch_size=2)
    with torch.no_grad():
        teacher_log_probs = teacher(data).logits[:, :-1].log_softmax(-1)
        student_log_probs = student(data).logits[:, :-1].log_softmax(-1)
    kl = (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)  # (N, T-1)
    agree = (teacher_log_probs.argmax(-1) == student_log_probs.argmax(-1)).double()
    measured = result["by_length"]["10"]["models"]["student"]
    assert measured["kl"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert measured["top1"] == pytest.approx(float(agree.mean()))
    assert measured["buckets"][1]["kl"] == pytest.approx(float(kl[:, 3:7].mean()), rel=1e-4)


def test_kl_from_teacher_equals_the_masked_sum_of_terms():
    generator = torch.Generator().manual_seed(0)
    teacher_log_probs = (torch.randn(5, 300, generator=generator) * 4).log_softmax(-1)
    log_probs = (torch.randn(5, 300, generator=generator) * 4).log_softmax(-1)
    teacher_log_probs[1, 7] = -200.0  # a probability that underflows to 0 ...
    log_probs[1, 7] = -math.inf  # ... where the row gives -inf: 0 * inf, a term that counts 0
    log_probs[3, 0] = math.nan  # a NaN where the teacher has mass stays NaN
    teacher_probs = teacher_log_probs.exp()
    assert teacher_probs[1, 7] == 0
    terms = torch.where(teacher_probs > 0, teacher_probs * (teacher_log_probs - log_probs), 0.0)
    expected = terms.sum(-1).clamp_min(0.0)  # the plain form: every (R, V) product, masked
    divergence = logits_module.kl_from_teacher(teacher_log_probs, teacher_probs, log_probs.clone())
    assert torch.isnan(divergence[3]) and torch.isnan(expected[3])
    keep = [0, 1, 2, 4]
    torch.testing.assert_close(divergence[keep], expected[keep], rtol=1e-6, atol=1e-7)
    assert float(divergence[1]) > 0.1


def test_streamed_position_sums_equal_those_of_the_full_logits(monkeypatch):
    from dofla.evaluation.long_context import _PositionSums, _score_batch

    monkeypatch.setattr(logits_module, "ROW_ELEMENTS", 64 * 7)  # 7 rows per chunk: chunks cross sequences
    teacher, other = small_llama(seed=0), small_llama(seed=2)
    batch = _sequences(3, 10)
    with torch.no_grad():
        rows = {
            "teacher": (teacher, logits_module.final_hidden_states(teacher, batch)),
            "other": (other, logits_module.final_hidden_states(other, batch)),
        }
        teacher_log_probs = teacher(batch).logits[:, :-1].double().log_softmax(-1)  # (B, T-1, V)
        other_log_probs = other(batch).logits[:, :-1].double().log_softmax(-1)
    sums = {name: _PositionSums(10) for name in rows}
    _score_batch(batch, rows, sums)
    targets = batch[:, 1:, None]
    expected = {
        "nll": -other_log_probs.gather(-1, targets).squeeze(-1).sum(0),  # per position, summed over sequences
        "kl": (teacher_log_probs.exp() * (teacher_log_probs - other_log_probs)).sum(-1).sum(0),
        "agree": (teacher_log_probs.argmax(-1) == other_log_probs.argmax(-1)).double().sum(0),
    }
    for field, values in expected.items():
        torch.testing.assert_close(getattr(sums["other"], field), values, rtol=1e-5, atol=1e-6)
    teacher_nll = -teacher_log_probs.gather(-1, targets).squeeze(-1).sum(0)
    torch.testing.assert_close(sums["teacher"].nll, teacher_nll, rtol=1e-5, atol=1e-6)
    assert sums["other"].count == 3 and float(expected["kl"].min()) > 1e-3


def test_too_long_context_names_both_numbers():
    teacher = build_tiny_model("llama")  # 512 positions
    with pytest.raises(DoflaError, match="1024 tokens is longer than the teacher's maximum of 512"):
        long_context_quality(teacher, None, {1024: torch.zeros(1, 1024, dtype=torch.long)}, window=8)


def test_non_finite_student_gives_null_and_a_note(tmp_path):
    teacher, student = small_llama(), small_llama()
    with torch.no_grad():
        student.lm_head.weight[0, 0] = math.nan
    result = long_context_quality(teacher, student, {8: _sequences(2, 8)}, window=4, sinks=(4,))
    row = result["by_length"]["8"]["models"]["student"]
    assert row["perplexity"] is None and row["kl"] is None and result["notes"]
    assert "n/a" in long_context_markdown(result)
    plot_loss_by_position(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000
    json.dumps(result, allow_nan=False)


@pytest.fixture(scope="module")
def converted_folder(tmp_path_factory):
    """A tiny converted hybrid (window 8) saved with its tokenizer, naming its teacher's folder."""
    root = tmp_path_factory.mktemp("evaluate")
    teacher_folder = save_tiny_model_folder("llama", root / "teacher")
    model = build_tiny_model("llama")
    convert(model, plan_for(model, kind="hybrid", feature_map="elu1", feature_dim=8, window=8))
    save_converted(
        model,
        root / "student",
        tokenizer=build_tiny_tokenizer(),
        extra_metadata={"teacher": str(teacher_folder)},
    )
    text = root / "heldout.txt"
    text.write_text(
        "\n".join(f"line {index}: the quick brown fox jumps over the lazy dog." for index in range(40))
    )
    return root


def test_evaluate_command_writes_per_length_per_bucket_json(converted_folder, tmp_path, capsys):
    root = converted_folder
    arguments = ["evaluate", str(root / "student"), "--data", str(root / "heldout.txt"), "--lengths", "32,64"]
    arguments += ["--sequences", "3", "--passkey", "96", "--passkey-trials", "1", "--passkey-depths", "0.5"]
    arguments += ["--recall"]
    arguments += ["--json", str(tmp_path / "out" / "eval.json"), "--plot", str(tmp_path / "loss.png")]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    assert "| window 8 + 4 sinks |" in printed and "ppl 16-31" in printed and "attention error" in printed
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    quality = result["long_context"]
    assert result["window"] == 8 and quality["sinks"] == [0, 4]
    assert sorted(quality["by_length"]) == ["32", "64"]
    measured = quality["by_length"]["64"]
    assert measured["sequences"] == 3 and measured["predicted_tokens"] == 3 * 63
    assert [bucket["label"] for bucket in measured["buckets"]] == ["1-7", "8-15", "16-31", "32-63"]
    assert list(measured["models"]) == [
        "teacher",
        "window",
        "window+sinks4",
        "streaming",
        "heavy-hitter",
        "student",
    ]
    for row in measured["models"].values():
        assert len(row["buckets"]) == 4 and row["perplexity"] > 1
    assert 0 <= measured["models"]["student"]["top1"] <= 1
    assert result["attention_error"]["length"] == 32 and sorted(result["attention_error"]["layers"]) == [
        "0",
        "1",
    ]
    assert list(result["passkey"]["rows"]) == [
        "teacher",
        "window+sinks4",
        "streaming",
        "heavy-hitter",
        "student",
    ]
    assert [(item["length"], item["sequences"], item["tokens"]) for item in result["recall"]] == [
        (32, 3, 3 * 3),  # spans of 32 // 8 tokens, 3 scored in each
        (64, 3, 3 * 7),
    ]
    assert list(result["recall"][1]["models"]) == [
        "teacher",
        "window",
        "streaming",
        "heavy-hitter",
        "student",
    ]
    assert "## Recall beyond the window" in printed and "| window 8 + 4 sinks |" in printed
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_busy_cpu_hint_only_for_several_threads_beside_other_jobs():
    from dofla.commands.evaluate import busy_cpu_hint

    hint = busy_cpu_hint(2, 1.5, 2)
    assert "load average 1.5 on 2 cores" in hint and "--threads 1" in hint
    assert busy_cpu_hint(1, 3.0, 2) is None  # one thread already
    assert busy_cpu_hint(2, 0.2, 2) is None  # an idle machine


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lengths", "32,x"], "--lengths must be comma-separated integers of at least 2"),
        (["--lengths", "0"], "--lengths must be comma-separated integers of at least 2"),
        (["--lengths", "32", "--seq-len", "32"], "either --lengths or --seq-len"),
        (["--sequences", "0"], "--sequences must be at least 1"),
        (["--sinks", "-1"], "--sinks must be comma-separated integers of at least 0"),
        (["--window", "0"], "--window must be at least 1"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--passkey", "100", "--passkey-depths", "1.5"], "--passkey-depths must be"),
        (["--json", "FILE/eval.json"], "lies under FILE, which is a file"),
        (["--plot", "loss.txt"], "--plot loss.txt must end in .png"),
        (["--skip-texts", "-1"], "--skip-texts must be 0 or more, got -1"),
    ],
)
def test_evaluate_options_are_checked_before_loading(extra, message, tmp_path, capsys):
    # the converted folder does not exist: any error about it would mean a model was being loaded
    (tmp_path / "FILE").write_text("a file, not a folder")
    extra = [str(tmp_path / item) if item.startswith("FILE") else item for item in extra]
    arguments = ["evaluate", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.txt"), *extra]
    assert main(arguments) == 1
    error = capsys.readouterr().err
    assert message.replace("FILE", str(tmp_path / "FILE")) in error and error.count("\n") == 1


def test_evaluate_recall_needs_data_and_rows_longer_than_the_window(converted_folder, tmp_path, capsys):
    arguments = ["evaluate", str(tmp_path / "missing"), "--passkey", "96", "--recall"]
    assert main(arguments) == 1
    assert "--recall repeats spans of held-out text, which needs --data." in capsys.readouterr().err
    root = converted_folder
    arguments = ["evaluate", str(root / "student"), "--data", str(root / "heldout.txt"), "--lengths", "12"]
    assert main([*arguments, "--recall"]) == 1  # window 8: no room for a span and its repeat
    error = capsys.readouterr().err
    assert (
        "rows of 12 tokens are too short to repeat a span more than 8 tokens later; use rows of at least 16"
        in error
    )


def test_evaluate_skip_texts_evaluates_the_rest_of_the_file(converted_folder, tmp_path, capsys):
    root = converted_folder
    lines = (root / "heldout.txt").read_text().splitlines()
    (tmp_path / "rest.txt").write_text("\n".join(lines[25:]))
    common = ["--lengths", "32", "--sequences", "2", "--error-sequences", "0"]
    for data, extra, name in (("heldout.txt", ["--skip-texts", "25"], "skipped"), ("rest.txt", [], "rest")):
        folder = root if name == "skipped" else tmp_path
        arguments = ["evaluate", str(root / "student"), "--data", str(folder / data), *common, *extra]
        assert main([*arguments, "--json", str(tmp_path / f"{name}.json")]) == 0
    skipped, rest = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("skipped", "rest"))
    assert skipped["data"]["skip_texts"] == 25 and skipped["data"]["texts"] == rest["data"]["texts"] == 15
    assert (
        skipped["long_context"]["by_length"]["32"]["models"]
        == rest["long_context"]["by_length"]["32"]["models"]
    )
    arguments = ["evaluate", str(root / "student"), "--data", str(root / "heldout.txt"), "--skip-texts", "40"]
    capsys.readouterr()
    assert main(arguments) == 1
    assert "--skip-texts 40 leaves nothing of" in capsys.readouterr().err


def test_evaluate_refuses_a_length_beyond_the_teacher(converted_folder, capsys):
    root = converted_folder
    arguments = ["evaluate", str(root / "student"), "--data", str(root / "heldout.txt"), "--lengths", "1024"]
    assert main(arguments) == 1
    assert "1024 tokens is longer than the teacher's maximum of 512 positions" in capsys.readouterr().err


def test_baselines_restrict_only_the_layers_a_student_converted():
    from dofla.evaluation.passkey import passkey_comparison
    from dofla.evaluation.window_baseline import window_restricted

    teacher, student = small_llama(), small_llama()
    last = len(student.model.layers) - 1
    convert(
        student, plan_for(student, kind="hybrid", feature_map="elu1", feature_dim=8, window=4, layers=[last])
    )
    data = {12: _sequences(2, 12)}
    result = long_context_quality(teacher, student, data, window=4, sinks=(0,), batch_size=2)
    assert result["window_layers"] == [last]
    assert any("restrict only the 1 layers" in note for note in result["notes"])
    with window_restricted(teacher, 4, 0, layers=[last]):
        expected = perplexity(teacher, data[12])["perplexity"]
    assert result["by_length"]["12"]["models"]["window"]["perplexity"] == pytest.approx(expected, rel=1e-5)
    with window_restricted(teacher, 4, 0):  # every layer: a different, weaker baseline
        assert perplexity(teacher, data[12])["perplexity"] != pytest.approx(expected, rel=1e-4)
    # a fully converted student keeps the baseline on every layer
    full = small_llama()
    convert(full, plan_for(full, kind="hybrid", feature_map="elu1", feature_dim=8, window=4))
    assert long_context_quality(teacher, full, data, window=4, sinks=(0,))["window_layers"] is None
    teacher, student = build_tiny_model("llama"), build_tiny_model("llama")  # the tiny tokenizer's vocabulary
    convert(
        student, plan_for(student, kind="hybrid", feature_map="elu1", feature_dim=8, window=4, layers=[0])
    )
    passkeys = passkey_comparison(
        teacher, student, build_tiny_tokenizer(), context_lengths=[64], depths=(0.5,), trials=1, window=4
    )
    assert passkeys["window_layers"] == [0] and "restrict only the 1 layers" in passkeys["notes"][0]


def test_edge_sink_baselines_are_rows_beside_the_true_position_ones():
    from dofla.evaluation.window_baseline import window_restricted

    teacher = small_llama()
    data = {12: _sequences(2, 12), 40: _sequences(2, 40, seed=1)}
    result = long_context_quality(teacher, None, data, window=4, sinks=(0, 2), sinks_at_edge=True)
    assert list(result["rows"]) == ["teacher", "window", "window+sinks2", "window+sinks2@edge"]
    assert result["rows"]["window+sinks2@edge"]["label"] == "window 4 + 2 sinks at the edge"
    short, long = (result["by_length"][key]["models"] for key in ("12", "40"))
    # up to position window + sinks the sinks are where they are: the first bucket agrees
    assert short["window+sinks2@edge"]["buckets"][0]["nll"] == pytest.approx(
        short["window+sinks2"]["buckets"][0]["nll"], rel=1e-6
    )
    with torch.no_grad(), window_restricted(teacher, 4, 2, sinks_at_edge=True):
        expected = perplexity(teacher, data[40])["perplexity"]
    assert long["window+sinks2@edge"]["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert long["window+sinks2@edge"]["perplexity"] != pytest.approx(long["window+sinks2"]["perplexity"])
    assert "at the edge" in long_context_markdown(result)
    with pytest.raises(DoflaError, match="rotary"):  # refused before any model runs
        long_context_quality(build_tiny_model("gpt2"), None, data, window=4, sinks=(2,), sinks_at_edge=True)


def test_evaluate_edge_sinks_adds_the_rows(converted_folder, tmp_path, capsys):
    root = converted_folder
    arguments = ["evaluate", str(root / "student"), "--data", str(root / "heldout.txt"), "--lengths", "32"]
    arguments += ["--sequences", "2", "--passkey", "", "--error-sequences", "0", "--edge-sinks"]
    assert main(arguments + ["--json", str(tmp_path / "eval.json")]) == 0
    assert "| window 8 + 4 sinks at the edge |" in capsys.readouterr().out
    models = json.loads((tmp_path / "eval.json").read_text())["long_context"]["by_length"]["32"]["models"]
    assert list(models) == [
        "teacher", "window", "window+sinks4", "window+sinks4@edge", "streaming", "heavy-hitter", "student"
    ]  # fmt: skip


def test_bounded_cache_baselines_hold_the_bytes_of_the_students_state():
    teacher, student = small_llama(), small_llama()
    convert(student, plan_for(student, kind="hybrid", feature_map="elu1", feature_dim=8, window=8))
    data = {96: _sequences(2, 96)}
    result = long_context_quality(teacher, student, data, window=8, sinks=(2,), batch_size=2)
    measured = result["by_length"]["96"]
    per_token = kv_bytes_per_token(teacher) * 2  # two layers
    cache = DynamicCache(config=student.config)
    with torch.no_grad():
        student(data[96][:1], past_key_values=cache, use_cache=True)
    state = measured["state_bytes"]
    assert state["student"] == held_bytes(cache) and state["teacher"] == 96 * per_token
    tokens = state["student"] // per_token  # as many of the teacher's keys as fit in the student's bytes
    assert measured["cache_baselines"]["streaming"] == {
        "name": "streaming", "tokens": tokens, "sinks": 4, "label": f"StreamingLLM {tokens - 4} + 4 sinks"
    }  # fmt: skip
    assert state["streaming"] == state["heavy-hitter"] == tokens * per_token <= state["student"]
    assert state["student"] - state["streaming"] < per_token
    # the rows are the teacher under those caches
    with torch.no_grad():
        with window_restricted(teacher, tokens - 4, 4):
            streaming = perplexity(teacher, data[96])["perplexity"]
        with heavy_hitter_restricted(
            teacher, tokens, 4, block=CacheBaseline("heavy-hitter", tokens, 4).block
        ):
            heavy = perplexity(teacher, data[96])["perplexity"]
    assert measured["models"]["streaming"]["perplexity"] == pytest.approx(streaming, rel=1e-5)
    assert measured["models"]["heavy-hitter"]["perplexity"] == pytest.approx(heavy, rel=1e-5)
    assert heavy != pytest.approx(streaming, rel=1e-4)
    assert "StreamingLLM" in long_context_markdown(result) and "state MiB" in long_context_markdown(result)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (0, "positive number of tokens"),
        (-3, "positive number"),
        (5, "no window beyond 4"),
        (32, "not smaller"),
    ],
)
def test_a_bad_cache_budget_is_one_sentence_before_any_model_runs(budget, message, converted_folder, capsys):
    with pytest.raises(DoflaError, match=message):
        long_context_quality(small_llama(), None, {32: _sequences(1, 32)}, window=4, cache_budget=budget)
    root = converted_folder
    arguments = ["evaluate", str(root / "student"), "--data", str(root / "heldout.txt"), "--lengths", "32,64"]
    with pytest.raises(DoflaError, match=message):
        check_arguments(build_parser().parse_args([*arguments, "--cache-budget", str(budget)]))
