"""Attention-error measurement and the pass-key retrieval prompt."""

import pytest
import torch
from helpers import small_llama

from dofla import dispatch
from dofla.errors import DoflaError
from dofla.evaluation.attention_error import attention_errors
from dofla.evaluation.passkey import build_prompt


class _ScaledTeacher(torch.nn.Module):
    """Exact softmax attention times a factor: relative error is |factor - 1| by construction."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, query, key, value, attention_mask=None, *, scaling):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling
        )
        return (self.factor * out).transpose(1, 2)


def test_attention_error_is_measured_per_converted_layer():
    model = small_llama()
    dispatch.install(model)
    model.model.layers[0].self_attn.dofla_student = _ScaledTeacher(1.0)
    model.model.layers[1].self_attn.dofla_student = _ScaledTeacher(1.5)
    errors = attention_errors(model, [torch.randint(0, 64, (2, 12)) for _ in range(2)])
    assert sorted(errors) == [0, 1]
    assert errors[0]["relative_error"] == pytest.approx(0.0, abs=1e-5)
    assert errors[1]["relative_error"] == pytest.approx(0.5, rel=1e-4)
    assert errors[1]["cosine"] == pytest.approx(1.0, abs=1e-4)


def test_attention_error_needs_a_converted_layer():
    model = small_llama()
    dispatch.install(model)
    with pytest.raises(DoflaError, match="no converted layers"):
        attention_errors(model, [torch.randint(0, 64, (1, 8))])


class _WordTokenizer:
    """One id per distinct word, so a word can be found again in the ids."""

    bos_token_id = None

    def __init__(self):
        self.vocabulary: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=False):
        return {
            "input_ids": [self.vocabulary.setdefault(word, len(self.vocabulary)) for word in text.split()]
        }


def test_passkey_prompt_length_and_depth():
    tokenizer = _WordTokenizer()
    for depth in (0.0, 0.5, 1.0):
        ids = build_prompt(tokenizer, "12345", 600, depth)[0].tolist()
        assert 500 <= len(ids) <= 620
        needle = ids.index(tokenizer.vocabulary["12345."])
        assert abs(needle / len(ids) - depth) < 0.1
    with pytest.raises(DoflaError, match="depth must be between 0 and 1"):
        build_prompt(tokenizer, "12345", 600, 1.5)


def test_softmax_cache_grows_with_context():
    from dofla.evaluation.speed import measure_generation

    model = small_llama()
    rows = measure_generation(model, context_lengths=(16, 32), new_tokens=3)
    # 2 layers x (keys + values) x 2 kv heads x 8 dims x 4 bytes per token.
    per_token = 2 * 2 * 2 * 8 * 4
    assert [row["cache_bytes_after_prefill"] for row in rows] == [16 * per_token, 32 * per_token]
    assert rows[0]["cache_bytes_after_decode"] == 19 * per_token


def test_converted_cache_size_is_constant_and_counts_only_states():
    from dofla.convert import convert, plan_for
    from dofla.evaluation.speed import measure_generation

    model = small_llama()
    convert(model, plan_for(model, kind="linear", feature_map="elu1", feature_dim=8))
    rows = measure_generation(model, context_lengths=(16, 48), new_tokens=3)
    # Per layer: kv state (2 kv heads x 8 features x 8 dims) + normaliser (2 x 8) + offset (2), float32.
    per_layer = (2 * 8 * 8 + 2 * 8 + 2) * 4
    assert {row["cache_bytes_after_prefill"] for row in rows} == {
        row["cache_bytes_after_decode"] for row in rows
    }
    assert rows[0]["cache_bytes_after_decode"] == rows[1]["cache_bytes_after_decode"] == 2 * per_layer


def test_greedy_tokens_through_the_cache_equal_generate():
    from dofla.evaluation.passkey import greedy_tokens

    for model in (small_llama(), _converted_small_llama()):
        prompt = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(2))
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 20:].tolist()
        with torch.no_grad():
            assert greedy_tokens(model, prompt, 6) == expected
            assert greedy_tokens(model, prompt, 6, stop=lambda tokens: len(tokens) == 2) == expected[:2]


def _converted_small_llama():
    from dofla.convert import convert, plan_for

    model = small_llama()
    return convert(model, plan_for(model, kind="hybrid", feature_map="elu1", feature_dim=8, window=4))


def test_passkey_comparison_covers_lengths_depths_and_rows():
    from dofla.evaluation.passkey import passkey_comparison, passkey_markdown
    from dofla.models import build_tiny_model, build_tiny_tokenizer

    teacher, tokenizer = build_tiny_model("llama"), build_tiny_tokenizer()  # 512 positions
    student = build_tiny_model("llama", seed=1)
    result = passkey_comparison(teacher, student, tokenizer, depths=(0.2, 0.8), trials=1, window=8, sinks=2)
    assert (
        result["context_lengths"] == [256, 512] and "beyond the teacher's 512 positions" in result["notes"][0]
    )
    assert list(result["rows"]) == ["teacher", "window+sinks2", "streaming", "heavy-hitter", "student"]
    # this student is a teacher: its equal-bytes caches keep every key, and every row holds what it says
    assert result["state_bytes"]["student"] == result["state_bytes"]["teacher"]
    assert result["state_bytes"]["streaming"] == result["state_bytes"]["teacher"]
    for row in result["rows"].values():
        assert [(r["context_tokens"], r["depth"]) for r in row["results"]] == [
            (256, 0.2),
            (256, 0.8),
            (512, 0.2),
            (512, 0.8),
        ]
        # the 512-token prompts leave room for the answer within the teacher's 512 positions
        assert all(r["prompt_tokens"] <= 512 - 8 for r in row["results"])
    table = passkey_markdown(result)
    assert "| window 8 + 2 sinks " in table and "512 tokens" in table and " MiB)" in table
    with pytest.raises(DoflaError, match="1024 tokens is longer than the teacher's maximum of 512"):
        passkey_comparison(teacher, None, tokenizer, context_lengths=[1024], window=8)


def test_passkey_answer_ends_with_five_digits_or_the_end_of_a_number():
    from dofla.evaluation.passkey import _answer_is_out
    from dofla.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()  # one token per character

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert _answer_is_out(tokenizer, ids(" 12345"))
    assert _answer_is_out(tokenizer, ids(" 12."))
    assert not _answer_is_out(tokenizer, ids(" 1234"))
    assert not _answer_is_out(tokenizer, ids(" the"))


@pytest.mark.parametrize(
    "kind, cell, sinks", [(None, None, 0), ("linear", "gla", 0), ("hybrid", "gated_delta", 2)]
)
def test_prefill_in_pieces_equals_one_forward(kind, cell, sinks):
    from transformers import DynamicCache

    from dofla.cache import held_bytes
    from dofla.convert import convert, plan_for
    from dofla.prefill import prefill

    torch.manual_seed(0)
    model = small_llama().eval()
    if kind is not None:
        convert(model, plan_for(model, feature_dim=8, window=4, kind=kind, cell=cell, sinks=sinks))
    ids = torch.randint(0, model.config.vocab_size, (2, 23))
    whole, pieces = DynamicCache(config=model.config), DynamicCache(config=model.config)
    expected = prefill(model, ids, whole)
    with torch.no_grad():
        assert torch.allclose(expected, model(ids).logits[:, -1], atol=1e-5)
    torch.testing.assert_close(prefill(model, ids, pieces, chunk_size=5), expected, atol=1e-5, rtol=1e-5)
    assert held_bytes(pieces) == held_bytes(whole) and pieces.get_seq_length() == 23
    # the next token continues both caches alike
    token = expected.argmax(-1, keepdim=True)
    with torch.no_grad():
        after_whole = model(input_ids=token, past_key_values=whole, use_cache=True).logits[:, -1]
        after_pieces = model(input_ids=token, past_key_values=pieces, use_cache=True).logits[:, -1]
    torch.testing.assert_close(after_pieces, after_whole, atol=1e-5, rtol=1e-5)
