"""Zero-shot evaluation: task loaders on the public file layouts, and log-likelihood scoring."""

import json
from pathlib import Path

import pytest
import torch
from helpers import small_llama

from dofla.errors import DoflaError
from dofla.evaluation import zero_shot

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


class CharTokenizer:
    """A byte-level stand-in for a real tokenizer (no files needed)."""

    bos_token_id = 1
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (b % 60) for b in text.encode("utf-8")]}


def test_batched_scores_equal_one_sequence_at_a_time():
    model, tokenizer = small_llama(), CharTokenizer()
    pairs = [("The cat sat on", " the mat"), ("Short", " x"), ("A much longer context here", " ends")]
    batched = zero_shot.continuation_log_likelihoods(model, tokenizer, pairs, batch_size=3)
    for (context, continuation), score in zip(pairs, batched, strict=True):
        ids = [1] + tokenizer(context)["input_ids"] + tokenizer(continuation)["input_ids"]
        count = len(tokenizer(continuation)["input_ids"])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        expected = sum(float(log_probs[t - 1, ids[t]]) for t in range(len(ids) - count, len(ids)))
        assert score == pytest.approx(expected, abs=1e-4)


def test_accuracy_follows_the_scores():
    model, tokenizer = small_llama(), CharTokenizer()
    items = [zero_shot.Item(choices=(("Q:", " aa"), ("Q:", " bbbb")), label=i % 2) for i in range(4)]
    scores = zero_shot.continuation_log_likelihoods(model, tokenizer, [p for it in items for p in it.choices])
    best = 0 if scores[0] > scores[1] else 1
    result = zero_shot.evaluate_items(model, tokenizer, items)
    assert result["acc"] == pytest.approx(sum(best == it.label for it in items) / 4)
    assert result["items"] == 4


def test_loaders_read_small_files(tmp_path):
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n")
    (tmp_path / "piqa" / "valid-labels.lst").write_text("1\n")
    [item] = zero_shot.load_task("piqa", tmp_path)
    assert item.label == 1 and item.choices[1] == ("Question: g\nAnswer:", " b")
    (tmp_path / "winogrande").mkdir()
    record = {"sentence": "Ann beat Bo so _ won.", "option1": "Ann", "option2": "Bo", "answer": "1"}
    (tmp_path / "winogrande" / "dev.jsonl").write_text(json.dumps(record) + "\n")
    [item] = zero_shot.load_task("winogrande", tmp_path)
    assert (
        item.choices == (("Ann beat Bo so Ann", " won."), ("Ann beat Bo so Bo", " won.")) and item.label == 0
    )


def test_clear_errors(tmp_path):
    with pytest.raises(DoflaError, match="unknown task 'hellaswag'"):
        zero_shot.load_task("hellaswag", tmp_path)
    with pytest.raises(DoflaError, match="does not exist"):
        zero_shot.load_task("piqa", tmp_path)
    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "ARC-Easy-test.jsonl").write_text("{broken\n")
    with pytest.raises(DoflaError, match="line 1 is not valid JSON"):
        zero_shot.load_task("arc_easy", tmp_path)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the shared evaluation data is not beside this checkout")
@pytest.mark.parametrize(
    "task, count",
    [
        ("piqa", 1838),
        ("arc_easy", 2376),
        ("arc_challenge", 1172),
        ("winogrande", 1267),
        ("wsc273", 273),
        ("logiqa", 651),
        ("mmlu", 14042),
    ],
)
def test_public_task_files_load_completely(task, count):
    items = zero_shot.load_task(task, SHARED_DATA)
    assert len(items) == count
    assert all(0 <= item.label < len(item.choices) for item in items)
