"""The linear attention op (``dofla.ops.linear``): the chunked and recurrent forms against the quadratic
reference, forward and gradients, state handoff, extreme log scales."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import (
    LINEAR_NAMES,
    assert_chunked_linear_matches_naive,
    assert_matches_reference,
    by_keywords,
    make_inputs,
    relative_error,
    split,
)

import dofla.ops.linear.chunked as chunked_module
from dofla import ops
from dofla.feature_maps import build_feature_map
from dofla.ops import (
    LinearInputs,
    LinearState,
)

# the forms called with keywords, as the cases below write them
chunked_linear_attention = by_keywords(ops.chunked_linear_attention, LinearInputs)
linear_attention = by_keywords(ops.linear_attention, LinearInputs)
recurrent_linear_attention = by_keywords(ops.recurrent_linear_attention, LinearInputs)

# (batch, heads, kv heads, tokens, features, chunk): T = 1, T < chunk, T not divisible by chunk, divisible;
# GQA 6/2 and 4/1 and H == Hk; feature dims differ from call to call.
LINEAR_CASES = [
    (1, 2, 2, 1, 4, 8),
    (1, 3, 3, 5, 3, 16),
    (2, 6, 2, 37, 5, 8),
    (2, 4, 1, 32, 7, 16),
    (1, 6, 6, 19, 2, 4),
]


@pytest.mark.parametrize("case", LINEAR_CASES)
@pytest.mark.parametrize("log_scale_std", [None, 30.0])
def test_chunked_linear_matches_naive_forward_and_gradients(case, log_scale_std):
    batch, heads, kv_heads, length, features, chunk = case
    inputs = make_inputs(batch, heads, kv_heads, length, features, log_scale_std=log_scale_std)
    assert_chunked_linear_matches_naive(inputs, chunk)


@pytest.mark.parametrize("case", LINEAR_CASES[:4])
@pytest.mark.parametrize("log_scale_std", [None, 30.0])
def test_recurrent_linear_matches_naive_forward_and_gradients(case, log_scale_std):
    batch, heads, kv_heads, length, features, _ = case
    inputs = make_inputs(batch, heads, kv_heads, length, features, log_scale_std=log_scale_std)
    assert_matches_reference(
        recurrent_linear_attention, linear_attention, inputs, LINEAR_NAMES, torch.float32, 1e-4
    )


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_linear_bfloat16_inputs_match_reference_within_rounding(form):
    inputs = make_inputs(2, 6, 2, 29, 6, log_scale_std=5.0)
    function = chunked_linear_attention if form == "chunked" else recurrent_linear_attention
    kwargs = {"chunk_size": 8} if form == "chunked" else {}
    assert_matches_reference(function, linear_attention, inputs, LINEAR_NAMES, torch.bfloat16, 2e-2, kwargs)


def test_float64_inputs_stay_float64_and_agree_to_machine_precision():
    inputs = make_inputs(1, 4, 2, 21, 5, log_scale_std=10.0)
    assert_chunked_linear_matches_naive(inputs, 4, torch.float64, 1e-12)


@pytest.mark.parametrize("log_scale_std", [None, 20.0])
def test_prefill_chunked_then_decode_recurrent_then_chunked_again_equals_one_pass(log_scale_std):
    inputs = make_inputs(2, 6, 2, 40, 5, log_scale_std=log_scale_std)
    expected = linear_attention(**split(inputs, LINEAR_NAMES, 0, 40))
    prefill, state = chunked_linear_attention(
        **split(inputs, LINEAR_NAMES, 0, 19), chunk_size=8, return_state=True
    )
    pieces = [prefill]
    for t in range(19, 25):  # one token at a time
        out, state = recurrent_linear_attention(**split(inputs, LINEAR_NAMES, t, t + 1), state=state)
        pieces.append(out)
    assert state.num_tokens == 25
    out, state = chunked_linear_attention(
        **split(inputs, LINEAR_NAMES, 25, 40), chunk_size=8, initial_state=state, return_state=True
    )
    pieces.append(out)
    assert state.num_tokens == 40
    assert relative_error(torch.cat(pieces, dim=2), expected) < 1e-12
    # The final states of both forms agree too.
    _, recurrent_state = recurrent_linear_attention(**split(inputs, LINEAR_NAMES, 0, 40))
    assert torch.allclose(state.kv, recurrent_state.kv, rtol=1e-10, atol=1e-12)
    assert torch.equal(state.log_offset, recurrent_state.log_offset)


def test_state_index_select_and_repeat_interleave_follow_batch_rows():
    inputs = make_inputs(3, 4, 2, 12, 3, log_scale_std=3.0)
    _, state = chunked_linear_attention(**split(inputs, LINEAR_NAMES, 0, 10), chunk_size=4, return_state=True)
    order = torch.tensor([2, 0, 2])
    reordered = {name: None if t is None else t.detach()[order] for name, t in inputs.items()}
    expected = linear_attention(**split(reordered, LINEAR_NAMES, 0, 12))[:, :, 10:]
    out, _ = recurrent_linear_attention(
        **split(reordered, LINEAR_NAMES, 10, 12), state=state.index_select(order)
    )
    assert relative_error(out, expected) < 1e-12
    repeated = state.repeat_interleave(2)
    assert repeated.kv.shape[0] == 6 and torch.equal(repeated.kv[4], state.kv[2])


def test_huge_log_scales_neither_overflow_nor_starve_early_queries():
    inputs = make_inputs(1, 2, 1, 24, 4)
    tensors = {name: t.detach() for name, t in split(inputs, LINEAR_NAMES[:3], 0, 24).items()}
    # Log scales growing by 1000 per token: exp() of them overflows even float64.
    log_scale = 1000.0 * torch.arange(24, dtype=torch.float64).view(1, 1, 24)
    expected_first = tensors["v"][:, :, 0]  # query 0 sees only key 0
    for function, kwargs in [(chunked_linear_attention, {"chunk_size": 8}), (recurrent_linear_attention, {})]:
        out = function(**{k: t.float() for k, t in tensors.items()}, k_log_scale=log_scale.float(), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(out).all()
        assert torch.allclose(out[:, 0, 0].double(), expected_first[:, 0], atol=1e-5)
        # Later queries are dominated by their own (largest-scaled) key.
        assert torch.allclose(out[:, :, -1].double(), tensors["v"][:, :, -1].expand(1, 2, -1), atol=1e-4)
    naive = linear_attention(**tensors, k_log_scale=log_scale)
    assert torch.isfinite(naive).all()


@pytest.mark.parametrize("map_name", ["prf", "hedgehog"])
def test_bfloat16_features_of_large_norm_at_long_length_stay_finite_and_convex(map_name):
    torch.manual_seed(0)
    length, heads, kv_heads, head_dim = 4096, 2, 1, 16
    feature_map = build_feature_map(
        map_name, num_heads=kv_heads, head_dim=head_dim, feature_dim=16, scaling=0.25
    )
    query = (40 * torch.randn(1, heads, length, head_dim)).bfloat16()
    key = (40 * torch.randn(1, kv_heads, length, head_dim)).bfloat16()
    v = torch.randn(1, kv_heads, length, 8).bfloat16()
    q_features, _ = feature_map(query, is_query=True)
    k_features, k_log_scale = feature_map(key, is_query=False)
    if map_name == "prf":
        assert torch.isfinite(k_log_scale).all() and k_log_scale.abs().max() > 1e3  # exp() of it overflows
    out = chunked_linear_attention(q_features, k_features, v, k_log_scale=k_log_scale, chunk_size=64)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # Every output is a convex combination of the values seen so far (up to bf16 rounding).
    assert (out.float().abs().amax(-1) <= v.float().abs().amax() * 1.01).all()
    # Prefill all but 3 tokens, decode those 3 one call: the same outputs up to bf16 rounding.
    prefix = length - 3

    def part(tensor, start, stop):
        return None if tensor is None else tensor[:, :, start:stop]

    _, state = chunked_linear_attention(
        part(q_features, 0, prefix), part(k_features, 0, prefix), part(v, 0, prefix),
        k_log_scale=part(k_log_scale, 0, prefix), return_state=True,
    )  # fmt: skip
    assert torch.isfinite(state.kv).all() and torch.isfinite(state.normalizer).all()
    decoded, _ = recurrent_linear_attention(
        part(q_features, prefix, length), part(k_features, prefix, length), part(v, prefix, length),
        k_log_scale=part(k_log_scale, prefix, length), state=state,
    )  # fmt: skip
    assert torch.allclose(decoded.float(), out[:, :, prefix:].float(), atol=2e-2)


def test_linear_state_empty_reads_as_nothing_seen():
    state = LinearState.empty(2, 3, 4, 5)
    assert state.kv.shape == (2, 3, 4, 5) and torch.isneginf(state.log_offset).all()
    q, k, v = torch.rand(2, 3, 1, 4), torch.rand(2, 3, 1, 4), torch.randn(2, 3, 1, 5)
    out, _ = recurrent_linear_attention(q, k, v, state=state)
    assert torch.allclose(out, linear_attention(q, k, v))


@pytest.mark.parametrize("log_scale_std", [0.0, 30.0])
def test_chunked_linear_scan_over_many_chunks_matches_the_reference(log_scale_std):
    """More chunks than SCAN_ABOVE_CHUNKS: the states entering the chunks come from the scan."""
    inputs = make_inputs(2, 6, 2, 45, 5, log_scale_std=log_scale_std)  # 23 chunks of 2 tokens
    assert -(-45 // 2) > chunked_module.SCAN_ABOVE_CHUNKS
    assert_chunked_linear_matches_naive(inputs, 2)


def test_scan_and_mixing_product_give_the_same_continuation_from_a_state(monkeypatch):
    inputs = make_inputs(1, 4, 2, 60, 5, log_scale_std=20.0)
    leaves = {name: inputs[name].detach() for name in LINEAR_NAMES}
    first = {name: tensor[:, :, :17] for name, tensor in leaves.items()}
    rest = {name: tensor[:, :, 17:] for name, tensor in leaves.items()}
    _, state = chunked_linear_attention(**first, chunk_size=4, return_state=True)
    scanned, scanned_state = chunked_linear_attention(
        **rest, chunk_size=2, initial_state=state, return_state=True
    )
    monkeypatch.setattr(chunked_module, "SCAN_ABOVE_CHUNKS", 10**6)
    mixed, mixed_state = chunked_linear_attention(
        **rest, chunk_size=2, initial_state=state, return_state=True
    )
    expected = linear_attention(**leaves)[:, :, 17:]
    assert relative_error(scanned, expected) < 1e-12 and relative_error(mixed, expected) < 1e-12
    torch.testing.assert_close(scanned_state.kv, mixed_state.kv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scanned_state.normalizer, mixed_state.normalizer, rtol=1e-10, atol=1e-12)
