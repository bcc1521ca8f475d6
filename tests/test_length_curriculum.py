"""A length curriculum (``--length-schedule``): shorter rows first with about as many tokens per step, never
held-out text, the learning rate over the whole run, resume in the right stage, one-sentence refusals, and
without a schedule the run exactly as before."""

from __future__ import annotations

import json

import pytest
import torch
from test_distill import LENGTH, quick_config, tiny_converted, token_data
from test_linearize import LENGTH as RUN_LENGTH
from test_linearize import config as run_config
from test_linearize import sequences, tiny_teacher
from test_resume import final_weights
from test_run_config import parse

import dofla.distill.trainer as trainer
from dofla.data import cut_rows, split_train_heldout
from dofla.distill.curriculum import length_stages
from dofla.errors import DoflaError
from dofla.pipeline import linearize
from dofla.run_config import LinearizeConfig, load_config, save_config
from dofla.run_data import prepare_data

HALF = [(LENGTH // 2, 0.5), (LENGTH, 0.5)]  # 12 then 24 tokens


def recorded_batches(monkeypatch) -> list[torch.Tensor]:
    """The training batches every later distill() call trains on, in order."""
    batches = []
    real_step_loss = trainer.step_loss

    def recording(model, students, input_ids, config, *, backward, **options):
        if backward:
            batches.append(input_ids.clone())
        return real_step_loss(model, students, input_ids, config, backward=backward, **options)

    monkeypatch.setattr(trainer, "step_loss", recording)
    return batches


def without_seconds(history: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if key != "seconds"} for record in history]


def test_without_a_schedule_the_run_is_unchanged(monkeypatch):
    train, config = token_data(), quick_config()
    # the fingerprint of this run before the curriculum existed: old checkpoints still resume
    assert (
        trainer.run_fingerprint(config.distill, config.seed, tiny_converted(), train, [0, 1])
        == "8ea71dab5acc83be"
    )
    batches = recorded_batches(monkeypatch)
    model = tiny_converted()
    result = trainer.distill(model, train, token_data(8, seed=1), config)
    steps = 4 * LENGTH * 12 // (4 * LENGTH)
    assert result.steps == steps and result.tokens == 4 * LENGTH * steps and result.stages == []
    for step, batch in enumerate(batches):  # batch s: the seeded permutation's rows, at full length
        assert torch.equal(batch, train[trainer.batch_indices(step, 4, len(train), 0)])
    records = [record for record in result.history if "loss" in record]
    assert [record["tokens"] for record in records] == [4 * LENGTH * (step + 1) for step in range(steps)]
    assert all("length" not in record for record in records)
    # a one-stage schedule at the full length is the same run, bit for bit
    single = tiny_converted()
    again = trainer.distill(
        single, train, token_data(8, seed=1), quick_config(length_schedule=[(LENGTH, 1.0)])
    )
    assert without_seconds(again.history) == without_seconds(result.history)
    for name, tensor in final_weights(model).items():
        assert torch.equal(final_weights(single)[name], tensor), name


def test_shorter_rows_first_with_as_many_tokens_per_step_and_one_learning_rate_schedule(monkeypatch):
    train = token_data()
    config = quick_config(length_schedule=HALF)
    batches = recorded_batches(monkeypatch)
    result = trainer.distill(tiny_converted(), train, token_data(8, seed=1), config)
    # 576 tokens per stage at 96 tokens per step: 6 steps of 8 x 12, then 6 of 4 x 24
    assert [tuple(batch.shape) for batch in batches] == [(8, 12)] * 6 + [(4, 24)] * 6
    pieces = {tuple(row.tolist()) for row in cut_rows(train, LENGTH // 2)}
    assert all(tuple(row.tolist()) in pieces for batch in batches[:6] for row in batch)
    records = [record for record in result.history if "loss" in record]
    assert [record["length"] for record in records] == [12] * 6 + [24] * 6
    assert [record["tokens"] for record in records] == [96 * (step + 1) for step in range(12)]
    factors = [trainer.learning_rate_factor(step, 12, config.distill) for step in range(12)]
    assert [record["lr_factor"] for record in records] == pytest.approx(factors)
    assert result.tokens == 4 * LENGTH * 12 and result.steps == 12
    assert [(stage["length"], stage["batch_size"], stage["steps"]) for stage in result.stages] == [
        (12, 8, 6),
        (24, 4, 6),
    ]


def test_early_stopping_waits_for_the_full_length_stage(monkeypatch):
    worse_every_time = iter(range(100))
    monkeypatch.setattr(trainer, "evaluate", lambda *args: (float(next(worse_every_time)), {}))
    options = dict(eval_every=1, patience=1)
    plain = trainer.distill(tiny_converted(), token_data(), token_data(8, seed=1), quick_config(**options))
    assert plain.stopped_early and plain.steps == 2  # the second evaluation is worse
    config = quick_config(length_schedule=HALF, **options)
    curriculum = trainer.distill(tiny_converted(), token_data(), token_data(8, seed=1), config)
    assert curriculum.stopped_early and curriculum.steps == 7  # the first evaluation at 24 tokens


def test_stage_batches_divide_among_processes_and_shares_round_to_whole_tokens():
    train = token_data()
    stages = length_stages([(8, 0.3), (LENGTH, 0.7)], train, 1000, 2, divisor=4)
    assert [stage.batch_size for stage in stages] == [4, 2]  # 2 x 24 / 8 = 6, down to a multiple of 4
    assert [stage.steps for stage in stages] == [10, 15]  # 300 tokens at 32 per step, 700 at 48
    assert stages[1].first_step == 10 and stages[1].tokens_before == 320


@pytest.mark.parametrize("stop_at", [3, 9])  # in the short stage, in the full-length stage
def test_an_interrupted_curriculum_resumes_in_its_stage(tmp_path, stop_at):
    config = quick_config(length_schedule=HALF, checkpoint_every=2)

    def interrupt(step, record):
        if step == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer.distill(
            tiny_converted(), token_data(), token_data(8, seed=1), config, tmp_path, on_step=interrupt
        )
    resumed = tiny_converted()
    trainer.distill(resumed, token_data(), token_data(8, seed=1), config, tmp_path, resume=True)
    expected = tiny_converted()
    trainer.distill(expected, token_data(), token_data(8, seed=1), config)
    for name, tensor in final_weights(expected).items():
        torch.testing.assert_close(final_weights(resumed)[name], tensor, rtol=0, atol=1e-6)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(record["step"], record["length"]) for record in log if "loss" in record] == [
        (step, 12 if step <= 6 else 24) for step in range(1, 13)
    ]
    # another schedule is another run
    with pytest.raises(DoflaError, match="belongs to a different run"):
        other = quick_config(length_schedule=[(8, 0.5), (LENGTH, 0.5)])
        trainer.distill(tiny_converted(), token_data(), token_data(8, seed=1), other, tmp_path, resume=True)


def test_curriculum_rows_are_cut_from_training_rows_only(tmp_path):
    rows = torch.arange(24 * 64).view(24, 64)  # every token id once: where a row comes from is visible
    config = run_config(tmp_path, distill=dict(length_schedule=[[8, 0.5], [16, 0.25], [RUN_LENGTH, 0.25]]))
    data = prepare_data(config, tiny_teacher(), None, rows, tmp_path / "cache")
    train_rows, heldout_rows = split_train_heldout(rows, 0.25, 0)
    assert sorted(data.shorter_train) == [8, 16] and data.train.shape[1] == RUN_LENGTH
    heldout = set(heldout_rows.flatten().tolist())
    assert set(data.heldout.flatten().tolist()) <= heldout
    for length, stage_rows in data.shorter_train.items():
        assert stage_rows.shape[1] == length
        assert set(stage_rows.flatten().tolist()) == set(train_rows.flatten().tolist())  # all of it, only it
        assert not set(stage_rows.flatten().tolist()) & heldout


def test_recall_rows_repeat_training_text_only_and_at_every_curriculum_length(tmp_path):
    rows = torch.arange(24 * 64).view(24, 64)
    config = run_config(
        tmp_path,
        data=dict(recall_fraction=1.0),
        plan=dict(kind="hybrid", window=8),
        distill=dict(length_schedule=[[24, 0.5], [RUN_LENGTH, 0.5]]),
    )
    data = prepare_data(config, tiny_teacher(), None, rows, tmp_path / "cache")
    plain_config = run_config(tmp_path, distill=dict(length_schedule=[[24, 0.5], [RUN_LENGTH, 0.5]]))
    plain = prepare_data(plain_config, tiny_teacher(), None, rows, tmp_path / "cache")
    for length, held in data.heldout_by_length.items():
        assert torch.equal(held, plain.heldout_by_length[length])  # held-out text is never changed
    for recalled, original in ((data.train, plain.train), (data.shorter_train[24], plain.shorter_train[24])):
        assert recalled.shape == original.shape
        assert (recalled != original).any(dim=1).all()  # every row repeats a span
    assert "100% of the training rows repeat a span of their own text at least 8 tokens later" in data.source


@pytest.mark.parametrize(
    "schedule, message",
    [
        (
            [[32, 0.5], [16, 0.5]],
            "the lengths of --length-schedule must increase, shortest first, got [32, 16]",
        ),
        ([[16, 0.5], [32, 0.6]], "the shares of --length-schedule must sum to 1, got 1.1"),
        ([[16, 0.0], [32, 1.0]], "every share of --length-schedule must be a positive fraction of --tokens"),
        ([[16, -0.5], [32, 1.5]], "got -0.5"),
        ([[8, 0.5], [16, 0.5]], "the last length of --length-schedule must be the training length 32"),
        ([[1, 0.5], [32, 0.5]], "every length of --length-schedule must be at least 2 tokens, got 1"),
    ],
)
def test_a_bad_schedule_is_one_sentence_before_any_work(tmp_path, schedule, message):
    config = run_config(tmp_path, distill=dict(length_schedule=schedule))
    with pytest.raises(DoflaError) as error:
        config.validate()
    assert message in str(error.value)
    with pytest.raises(DoflaError, match="length-schedule"):
        trainer.distill(
            tiny_converted(), token_data(), token_data(8), quick_config(length_schedule=schedule), None
        )


def test_other_refusals(tmp_path):
    with pytest.raises(DoflaError, match="--length-schedule must be comma-separated INT:FLOAT pairs like"):
        parse("--out", "o", "--length-schedule", "256-0.5")
    stored = run_config(
        tmp_path,
        distill=dict(length_schedule=HALF, sharding="layers", teacher_states="states"),
        data=dict(seq_len=LENGTH),
    )
    with pytest.raises(DoflaError, match="--teacher-states holds the rows at --seq-len"):
        stored.validate()
    beyond = run_config(
        tmp_path, data=dict(seq_len=256), distill=dict(length_schedule=[[64, 0.5], [256, 0.5]])
    )
    beyond.validate()  # the teacher's context is known once it is loaded, before any data is read
    with pytest.raises(
        DoflaError, match="length 256 of --length-schedule is beyond the teacher's context of 128"
    ):
        prepare_data(beyond, tiny_teacher(), None, sequences(), tmp_path / "cache")


def test_the_schedule_round_trips_and_is_reported(tmp_path):
    flags = parse("--out", str(tmp_path / "run"), "--seq-len", "32", "--length-schedule", "16:0.5, 32:0.5")
    assert flags.distill.length_schedule == [(16, 0.5), (32, 0.5)]
    assert load_config(save_config(flags, tmp_path / "flags.toml")) == flags
    assert parse("--out", "o", "--length-schedule", "").distill.length_schedule == []  # none
    config = run_config(
        tmp_path, distill=dict(length_schedule=[[16, 0.5], [32, 0.5]]), evaluate=dict(passkey_trials=0)
    )
    result = linearize(config, teacher=tiny_teacher(), sequences=sequences())
    run = tmp_path / "run"
    assert load_config(run / "config.toml") == config
    summary = json.loads((run / "result.json").read_text())
    assert summary["config"]["distill"]["length_schedule"] == [[16, 0.5], [32, 0.5]]
    assert [
        (stage["length"], stage["batch_size"], stage["steps"]) for stage in summary["distill_stages"]
    ] == [
        (16, 8, 4),
        (32, 4, 4),
    ]
    assert summary["distill_tokens"] == 4 * 32 * 8
    assert (
        "- Length curriculum, shortest first: 16 tokens x 8 sequences for 4 steps"
        in result.report_path.read_text()
    )
    assert LinearizeConfig.from_dict(dict(out_dir="x")).distill.length_schedule is None
    # the same command resumes it (the stages' rows are the same, so the checkpoint is this run's)
    resumed = linearize(
        load_config(run / "config.toml", resume=True), teacher=tiny_teacher(), sequences=sequences()
    )
    assert resumed.student_ppl == pytest.approx(result.student_ppl, rel=1e-6)
