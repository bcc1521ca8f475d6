"""Recall beyond the window: the repeated rows, the scored tokens, the reference computation, the report."""

import math

import pytest
import torch
from helpers import small_llama

from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.evaluation.recall import recall_beyond_window, recall_markdown, repeated_rows
from dofla.evaluation.window_baseline import window_restricted


def _sequences(count, length, seed=0, vocabulary=64):
    return torch.randint(0, vocabulary, (count, length), generator=torch.Generator().manual_seed(seed))


def test_every_row_repeats_a_span_and_the_scored_tokens_are_its_copies():
    sequences = torch.arange(6 * 128).view(6, 128)  # every id once: a copy's origin is visible
    rows, scored = repeated_rows(sequences, window=16)
    assert [row for row, _, _ in scored] == list(range(6))
    for row, positions, targets in scored:
        assert len(positions) == 128 // 8 - 1  # the span's tokens after its first
        assert torch.equal(targets, rows[row, positions + 1])
        first = int(targets[0]) - row * 128  # where the copied tokens first stood
        assert int(positions[0]) + 1 - (first + 16) >= 16  # at least the window after the span ends
        assert torch.equal(rows[row, positions + 1], sequences[row, first : first + 15])
    differs = (rows != sequences).sum(dim=1)
    assert (differs == 16).all()  # one span per row, nothing else touched


def _reference(model, rows, scored):
    """Loss and accuracy from the model's full logits, token by token."""
    logits = model(rows).logits
    losses, hits = [], []
    for row, positions, targets in scored:
        for position, target in zip(positions.tolist(), targets.tolist(), strict=True):
            log_probs = torch.log_softmax(logits[row, position].float(), dim=-1)
            losses.append(-float(log_probs[target]))
            hits.append(float(int(log_probs.argmax()) == target))
    return sum(losses) / len(losses), sum(hits) / len(hits)


def test_recall_measures_match_full_logits_and_the_kept_share_follows_from_them():
    teacher = small_llama()
    student = convert(small_llama(), plan_for(small_llama(), kind="hybrid", window=4, feature_dim=8))
    sequences = _sequences(3, 64)
    result = recall_beyond_window(teacher, student, sequences, window=4, sinks=1, batch_size=2)
    rows, scored = repeated_rows(sequences, window=4)
    with torch.no_grad():
        expected = {
            "teacher": _reference(teacher, rows, scored),
            "student": _reference(student, rows, scored),
        }
        with window_restricted(teacher, 4, 1):
            expected["window"] = _reference(teacher, rows, scored)
    assert result["tokens"] == 3 * 7 and result["span"] == 8 and result["length"] == 64
    for name, (loss, accuracy) in expected.items():
        assert result["models"][name]["nll"] == pytest.approx(loss, rel=1e-5)
        assert result["models"][name]["accuracy"] == pytest.approx(accuracy)
        assert result["models"][name]["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    window, teacher_loss = expected["window"][0], expected["teacher"][0]
    assert window > teacher_loss  # these rows: the full softmax predicts the copies better than the window
    kept = (window - expected["student"][0]) / (window - teacher_loss)
    assert result["kept"] == pytest.approx(kept, rel=1e-3)  # a ratio of small differences
    table = recall_markdown([result])
    assert "| window 4 + 1 sinks |" in table and "**64 tokens** (3 rows, 21 scored tokens)" in table


def test_a_student_equal_to_its_teacher_keeps_all_and_a_window_as_long_as_the_row_adds_nothing():
    teacher, same = small_llama(), small_llama()
    sequences = _sequences(2, 48, seed=3)
    result = recall_beyond_window(teacher, same, sequences, window=8, sinks=0)
    assert result["models"]["student"]["nll"] == pytest.approx(result["models"]["teacher"]["nll"])
    assert result["kept"] == pytest.approx(1.0)
    teacher_only = recall_beyond_window(teacher, None, sequences, window=8, sinks=0)
    assert "student" not in teacher_only["models"] and teacher_only["kept"] is None


def test_recall_refuses_rows_too_short_or_outside_the_vocabulary():
    teacher = small_llama()
    with pytest.raises(DoflaError, match="too short to repeat a span more than 64 tokens later"):
        recall_beyond_window(teacher, None, _sequences(2, 66), window=64)
    with pytest.raises(DoflaError, match="outside the teacher's vocabulary"):
        recall_beyond_window(teacher, None, _sequences(2, 64, vocabulary=10_000), window=4)
