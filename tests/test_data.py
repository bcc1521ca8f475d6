"""Text loading, packing, held-out splits, teacher-sampled text and perplexity."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from dofla.data import (
    NEEDLE_NAMES,
    insert_needles,
    load_texts,
    pack_token_sequences,
    repeat_spans,
    sample_teacher_texts,
    split_train_heldout,
)
from dofla.errors import DoflaError
from dofla.evaluation.perplexity import perplexity
from dofla.models import build_tiny_model, build_tiny_tokenizer

SHARED_DATA = Path("/work/shared/data/wiki_demo")


def test_txt_blocks_or_lines(tmp_path):
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("First document\nstill first.\n\nSecond document.\n\n\nThird.\n")
    assert load_texts(blocks) == ["First document\nstill first.", "Second document.", "Third."]
    lines = tmp_path / "lines.txt"
    lines.write_text("one article\nanother article\n\n")  # a trailing blank line only: one per line
    assert load_texts(lines) == ["one article", "another article"]


def test_jsonl_json_and_folder(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "alpha"}\n\n{"text": "beta", "id": 2}\n')
    assert load_texts(tmp_path / "a.jsonl") == ["alpha", "beta"]
    records = [
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        {"text": "plain"},
        "a bare string",
    ]
    (tmp_path / "b.json").write_text(json.dumps(records))
    assert load_texts(tmp_path / "b.json") == ["Say hi.\n\nHi!", "plain", "a bare string"]
    (tmp_path / "c.txt").write_text("gamma\n")
    assert load_texts(tmp_path) == ["alpha", "beta", "Say hi.\n\nHi!", "plain", "a bare string", "gamma"]


def test_data_errors_name_the_problem(tmp_path):
    with pytest.raises(DoflaError, match="does not exist"):
        load_texts(tmp_path / "missing.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DoflaError, match='line 2 has no string "text" field'):
        load_texts(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DoflaError, match="line 2 is not valid JSON"):
        load_texts(tmp_path / "broken.jsonl")
    (tmp_path / "records.json").write_text(json.dumps([{"text": "ok"}, {"question": "?"}]))
    with pytest.raises(DoflaError, match="record 1 has neither"):
        load_texts(tmp_path / "records.json")
    (tmp_path / "object.json").write_text('{"text": "one"}')
    with pytest.raises(DoflaError, match="JSON array"):
        load_texts(tmp_path / "object.json")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DoflaError, match="suffix '.csv'"):
        load_texts(tmp_path / "data.csv")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DoflaError, match="holds no .txt"):
        load_texts(empty)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DoflaError, match="pip install datasets"):
            load_texts(saved)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared demo data not present")
def test_shared_demo_files_load():
    assert len(load_texts(SHARED_DATA / "wiki_demo.txt")) > 10
    assert all(load_texts(SHARED_DATA / "c4_demo.jsonl"))
    assert all(load_texts(SHARED_DATA / "alpaca_en_demo.json"))


def test_pack_token_sequences():
    tokenizer = build_tiny_tokenizer()
    texts = ["abc", "de"]  # 3 + eos + 2 + eos = 7 tokens
    packed = pack_token_sequences(tokenizer, texts, 3)
    expected = tokenizer("abc", add_special_tokens=False)["input_ids"] + [2]
    expected += tokenizer("de", add_special_tokens=False)["input_ids"] + [2]
    assert packed.dtype == torch.long
    assert packed.tolist() == [expected[0:3], expected[3:6]]  # the 7th token is dropped
    assert pack_token_sequences(tokenizer, texts, 5, add_eos=False).shape == (1, 5)
    with pytest.raises(DoflaError, match="the data has 7 tokens but one sequence needs 8"):
        pack_token_sequences(tokenizer, texts, 8)
    with pytest.raises(DoflaError, match="has 0 tokens"):
        pack_token_sequences(tokenizer, [], 4)


def test_split_train_heldout_is_disjoint_and_seeded():
    sequences = torch.arange(40).view(10, 4)
    train, heldout = split_train_heldout(sequences, 0.2, seed=3)
    assert (len(train), len(heldout)) == (8, 2)
    rows = {tuple(row) for row in train.tolist()} | {tuple(row) for row in heldout.tolist()}
    assert len(rows) == 10  # disjoint and complete
    again = split_train_heldout(sequences, 0.2, seed=3)
    assert torch.equal(again[1], heldout)
    assert not torch.equal(split_train_heldout(sequences, 0.2, seed=4)[1], heldout)
    with pytest.raises(DoflaError, match="at least 2"):
        split_train_heldout(sequences[:1], 0.5)


def test_teacher_samples_are_seeded_and_cached(tmp_path, monkeypatch):
    model, tokenizer = build_tiny_model("llama"), build_tiny_tokenizer()
    texts = sample_teacher_texts(model, tokenizer, 3, 6, seed=1, cache_dir=tmp_path, batch_size=2)
    assert len(texts) == 3 and all(isinstance(text, str) for text in texts)
    (cache_file,) = tmp_path.glob("*.jsonl")
    assert [json.loads(line)["text"] for line in cache_file.read_text().splitlines()] == texts

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached text should have been reused")

    monkeypatch.setattr(model, "generate", no_generation)
    assert sample_teacher_texts(model, tokenizer, 3, 6, seed=1, cache_dir=tmp_path) == texts
    monkeypatch.undo()
    other = sample_teacher_texts(model, tokenizer, 3, 6, seed=2, cache_dir=tmp_path, batch_size=2)
    assert other != texts and len(list(tmp_path.glob("*.jsonl"))) == 2


def test_perplexity_matches_a_token_by_token_reference():
    model = build_tiny_model("qwen3")
    sequences = torch.randint(3, 128, (5, 9), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, sequences, batch_size=2)
    total = 0.0
    with torch.no_grad():
        for sequence in sequences:
            log_probs = model(input_ids=sequence[None]).logits[0].log_softmax(-1)  # (T, V)
            total -= sum(float(log_probs[position, sequence[position + 1]]) for position in range(8))
    assert result["tokens"] == 40
    assert result["nll"] == pytest.approx(total / 40, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(total / 40), rel=1e-5)
    assert perplexity(model, sequences, batch_size=5)["nll"] == pytest.approx(result["nll"], rel=1e-6)


def test_perplexity_of_uniform_predictions_is_the_vocabulary_size():
    model = build_tiny_model("gpt2")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied to the embedding; logits are all zero
    result = perplexity(model, torch.randint(0, 128, (2, 6)))
    assert result["perplexity"] == pytest.approx(128, rel=1e-5)


def test_repeat_spans_copy_a_span_of_the_row_itself_at_least_the_gap_later():
    rows = torch.arange(40 * 256).view(40, 256)  # every token id once: where a copy comes from is visible
    out = repeat_spans(rows, 0.25, gap=64, seed=1)
    changed = (out != rows).any(dim=1).nonzero().flatten().tolist()
    assert len(changed) == 10
    for row in range(len(rows)):
        differs = (out[row] != rows[row]).nonzero().flatten()
        if row not in changed:
            assert len(differs) == 0
            continue
        start = int(differs[0])
        assert torch.equal(differs, torch.arange(start, start + 32))  # one span of 256 // 8 tokens
        source = int(out[row, start]) - row * 256  # where the copied tokens stood in the same row
        assert torch.equal(out[row, start : start + 32], rows[row, source : source + 32])
        assert start - (source + 32) >= 64  # the repeat begins at least the gap after the span ends
    assert torch.equal(repeat_spans(rows, 0.25, gap=64, seed=1), out)  # seeded
    assert not torch.equal(repeat_spans(rows, 0.25, gap=64, seed=2), out)
    assert torch.equal(repeat_spans(rows, 0.0, gap=64), rows)
    # not the trainer's order (torch.randperm seeded alike), which would put them all in the first steps
    assert set(changed) != set(torch.randperm(40, generator=torch.Generator().manual_seed(1))[:10].tolist())
    assert (repeat_spans(rows, 1.0, gap=64) != rows).any(dim=1).all()


def test_repeat_spans_refuse_rows_too_short_for_the_gap():
    with pytest.raises(
        DoflaError,
        match="too short to repeat a span more than 64 tokens later; use rows of at least 68 tokens",
    ):
        repeat_spans(torch.zeros(4, 66, dtype=torch.long), 0.5, gap=64)
    with pytest.raises(DoflaError, match=r"must lie in \[0, 1\], got 1.5"):
        repeat_spans(torch.zeros(4, 256, dtype=torch.long), 1.5, gap=64)


def test_insert_needles_state_facts_that_the_row_asks_for_at_its_end_beyond_the_gap():
    tokenizer = build_tiny_tokenizer()  # one token per character: positions read off the text
    rows = torch.full((10, 1024), tokenizer(" ", add_special_tokens=False)["input_ids"][0])
    out = insert_needles(rows, tokenizer, 0.5, gap=64, needles=3, seed=1)
    changed = (out != rows).any(dim=1).nonzero().flatten().tolist()
    assert len(changed) == 5
    for row in changed:
        text = tokenizer.decode(out[row])
        questions = re.findall(r" What is the ([a-z ]+)\? The \1 is (\d{5})\.", text)
        statements = re.findall(r" The ([a-z ]+) is (\d{5})\.", text[: text.index(" What is")])
        assert len(questions) == 3 and sorted(questions) == sorted(statements)  # each fact asked once
        assert all(name in NEEDLE_NAMES and "pass key" not in name for name, _ in questions)
        tail = text.index(" What is")
        assert text.endswith(".") and len(text) - tail < 1024 - 64  # the questions are the row's end
        ends = [text.index(fact) + len(fact) for fact in (f" The {n} is {k}." for n, k in statements)]
        last_fact_end = max(ends)
        assert tail - last_fact_end >= 64  # every fact more than the gap before the first question
    assert all(torch.equal(out[row], rows[row]) for row in range(10) if row not in changed)
    assert torch.equal(insert_needles(rows, tokenizer, 0.5, gap=64, needles=3, seed=1), out)  # seeded
    assert not torch.equal(insert_needles(rows, tokenizer, 0.5, gap=64, needles=3, seed=2), out)
    assert insert_needles(rows, tokenizer, 0.0, gap=64) is rows


def test_insert_needles_refuse_rows_too_short_and_bad_shares():
    tokenizer = build_tiny_tokenizer()
    with pytest.raises(
        DoflaError, match="too short for 4 needles more than 64 tokens before their questions"
    ):
        insert_needles(torch.zeros(4, 256, dtype=torch.long), tokenizer, 0.5, gap=64)
    with pytest.raises(DoflaError, match=r"must lie in \[0, 1\], got 1.5"):
        insert_needles(torch.zeros(4, 1024, dtype=torch.long), tokenizer, 1.5, gap=64)
