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


def _recall_loss(model, batches, window, sinks, restricted):
    """Token-weighted loss on the batches' repeated tokens with ``restricted`` cut to the window."""
    total, tokens = 0.0, 0
    for batch in batches:
        rows, scored = repeated_rows(batch, window=window)
        with torch.no_grad(), window_restricted(model, window, sinks, layers=restricted):
            loss, _ = _reference(model, rows, scored)
        count = sum(len(targets) for _, _, targets in scored)
        total, tokens = total + loss * count, tokens + count
    return total / tokens


def test_recall_layer_order_keeps_greedily_and_ends_at_the_teachers_own_recall():
    from dofla.models import build_tiny_model
    from dofla.planning.recall_order import recall_layer_order

    model = build_tiny_model("llama", vocab_size=64, num_hidden_layers=3, seed=2).eval()
    batches = [_sequences(2, 64, seed=seed) for seed in (5, 6)]
    order = recall_layer_order(model, batches, 3, window=4, sinks=1)
    assert sorted(layer for layer, _ in order) == [0, 1, 2]
    alone = {
        layer: _recall_loss(model, batches, 4, 1, [o for o in range(3) if o != layer]) for layer in range(3)
    }
    assert order[0][0] == min(alone, key=lambda layer: (alone[layer], layer))
    assert order[0][1] == pytest.approx(alone[order[0][0]], rel=1e-4)
    second = [layer for layer, _ in order[:2]]
    restricted = [layer for layer in range(3) if layer not in second]
    assert order[1][1] == pytest.approx(_recall_loss(model, batches, 4, 1, restricted), rel=1e-4)
    assert order[2][1] == pytest.approx(_recall_loss(model, batches, 4, 1, []), rel=1e-4)  # nothing cut
    only = recall_layer_order(model, batches, 1, window=4, sinks=1, layers=[1, 2])
    assert only[0][0] in (1, 2)
    with pytest.raises(DoflaError, match="the recall order can keep 1 to 2 layers"):
        recall_layer_order(model, batches, 3, window=4, layers=[1, 2])


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "qwen2"])
def test_the_order_reusing_each_candidates_lower_layers_equals_the_one_computing_them(family):
    from dofla.models import build_tiny_model, get_adapter
    from dofla.planning.recall_order import recall_layer_order

    model = build_tiny_model(family, vocab_size=64, num_hidden_layers=4, seed=3).eval()
    batches = [_sequences(2, 64, seed=seed) for seed in (7, 8)]
    first = get_adapter(model).attention_modules(model)[0]  # runs only when its layer computes
    calls = []
    handle = first.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    counted = {}
    for reuse in (False, True):
        calls.clear()
        counted[reuse] = recall_layer_order(model, batches, 3, window=4, sinks=1, reuse_prefix=reuse)
        counted[f"calls {reuse}"] = len(calls)
    handle.remove()
    assert counted[True] == counted[False]  # the same layers and the same losses, to the bit
    # the first layer runs only where it is the candidate or in the forward of those already kept
    assert counted["calls True"] < counted["calls False"]
    subset = recall_layer_order(model, batches, 2, window=4, sinks=1, layers=[1, 3])
    assert subset == recall_layer_order(
        model, batches, 2, window=4, sinks=1, layers=[1, 3], reuse_prefix=False
    )
    for layer in get_adapter(model).decoder_layers(model):
        assert "forward" not in vars(layer)  # every layer computes again after the search


def test_the_recall_order_is_kept_and_a_longer_one_serves_a_shorter_request(tmp_path, monkeypatch):
    import dofla.planning.recall_order as recall
    from dofla.models import build_tiny_model

    model = build_tiny_model("llama", vocab_size=64, num_hidden_layers=3, seed=2).eval()
    batches = [_sequences(2, 64, seed=seed) for seed in (5, 6)]
    measured = []
    reference = recall.recall_layer_order

    def counting(*args, **kwargs):
        measured.append(args[2])
        return reference(*args, **kwargs)

    monkeypatch.setattr(recall, "recall_layer_order", counting)
    full = recall.cached_recall_order(model, batches, 3, window=4, sinks=1, folder=tmp_path)
    assert full == reference(model, batches, 3, window=4, sinks=1) and measured == [3]
    (kept,) = tmp_path.glob("recall_order-*.json")  # the order and each layer's loss, for a rerun
    assert recall.cached_recall_order(model, batches, 2, window=4, sinks=1, folder=tmp_path) == full[:2]
    assert measured == [3]  # read back, not measured again
    recall.cached_recall_order(model, batches, 2, window=4, sinks=2, folder=tmp_path)  # other sinks
    other_rows = [_sequences(2, 64, seed=seed) for seed in (7, 8)]
    recall.cached_recall_order(model, other_rows, 2, window=4, sinks=1, folder=tmp_path)  # other rows
    recall.cached_recall_order(model, batches, 1, window=4, sinks=1, layers=[1, 2], folder=tmp_path)
    assert measured == [3, 2, 2, 1] and len(list(tmp_path.glob("recall_order-*.json"))) == 4
    kept.write_text(kept.read_text()[:-20])  # a damaged file is measured again and replaced
    assert recall.cached_recall_order(model, batches, 2, window=4, sinks=1, folder=tmp_path) == full[:2]
    assert measured[-1] == 2 and len(measured) == 5
    assert recall.cached_recall_order(model, batches, 2, window=4, sinks=1) == full[:2]  # no folder: measured
    assert measured[-1] == 2
