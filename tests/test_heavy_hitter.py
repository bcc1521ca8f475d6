"""The heavy-hitter (H2O) cache baseline: the block form against a query-by-query reference, prompt then
decoding through a cache, a budget that holds everything, and bad budgets."""

import pytest
import torch
import torch.nn.functional as F
from helpers import small_llama
from transformers import DynamicCache

from dofla.errors import DoflaError
from dofla.evaluation.heavy_hitter import (
    heavy_hitter_attention,
    heavy_hitter_reference,
    heavy_hitter_restricted,
    kept_split,
)


def _inputs(length=40, batch=2, heads=4, kv_heads=2, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64)
    return query, key, value


@pytest.mark.parametrize(("budget", "sinks", "block"), [(8, 2, 1), (12, 4, 3), (20, 0, 8), (9, 1, 4)])
def test_block_form_equals_the_query_by_query_reference(budget, sinks, block):
    query, key, value = _inputs()
    fast, state = heavy_hitter_attention(query, key, value, budget, sinks, 0.35, block)
    reference = heavy_hitter_reference(query, key, value, budget, sinks, 0.35, block)
    torch.testing.assert_close(fast, reference, rtol=1e-10, atol=1e-12)
    assert state.positions.shape[2] == budget - block and state.seen == 40
    softmax = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.35, enable_gqa=True)
    assert (fast - softmax.transpose(1, 2)).abs().max() > 1e-3  # it evicted something


def test_the_kept_keys_are_the_sinks_the_recent_and_the_most_attended():
    query, key, value = _inputs(length=30, batch=1, heads=2, kv_heads=1)
    sinks, recent, heavy = kept_split(10, 2, 2)
    assert (sinks, recent, heavy) == (2, 3, 3)
    _, state = heavy_hitter_attention(query, key, value, 10, 2, 0.35, 2)
    kept = state.positions[0, 0].tolist()
    assert kept[:2] == [0, 1] and kept[-3:] == [27, 28, 29] and len(kept) == 8


def test_a_budget_holding_every_key_is_the_teachers_softmax():
    query, key, value = _inputs()
    output, _ = heavy_hitter_attention(query, key, value, 48, 4, 0.35, 8)
    softmax = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.35, enable_gqa=True)
    torch.testing.assert_close(output, softmax.transpose(1, 2))


def test_prompt_then_decoding_through_the_cache_equals_one_forward_token_by_token():
    model = small_llama()
    tokens = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        teacher = model(tokens).logits
        with heavy_hitter_restricted(model, budget=10, sinks=2, block=1):
            full = model(tokens).logits
            cache = DynamicCache(config=model.config)
            pieces = [model(tokens[:, :12], past_key_values=cache, use_cache=True).logits]
            for position in range(12, 30):
                pieces.append(model(tokens[:, position : position + 1], past_key_values=cache).logits)
        assert (full - teacher).abs().max() > 1e-4
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(tokens).logits, teacher)  # left as it was


@pytest.mark.parametrize(
    ("budget", "sinks", "block", "message"),
    [
        (0, 4, 16, "at least 21 tokens"),
        (-5, 0, 1, "at least 2 tokens"),
        (10, 4, 8, "cannot hold 4 sinks"),
        (10, -1, 1, "cannot be negative"),
    ],
)
def test_bad_budgets_are_one_sentence(budget, sinks, block, message):
    with pytest.raises(DoflaError, match=message):
        heavy_hitter_attention(*_inputs(), budget, sinks, 0.35, block)
    with (
        pytest.raises(DoflaError, match=message),
        heavy_hitter_restricted(small_llama(), budget, sinks, block=block),
    ):
        pass
