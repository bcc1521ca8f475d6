"""Fast paths of the chunked ops and feature maps against their references (forward and gradients): the
linear scan over many chunks, the fused window op, the PRF maps' rows."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import LINEAR_NAMES, assert_chunked_linear_matches_naive, make_inputs, relative_error

import dofla.ops.linear.chunked as chunked_module
from dofla.ops import chunked_linear_attention, linear_attention


def weighted_gradients(outputs, weights, inputs):
    """Gradients of sum(output * weight) over the outputs that are not None, with respect to ``inputs``."""
    present = [tensor for tensor in outputs if tensor is not None]
    total = sum((tensor * weight).sum() for tensor, weight in zip(present, weights, strict=True))
    return torch.autograd.grad(total, inputs)


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


@pytest.mark.parametrize("name", ["prf", "learnable_prf"])
def test_prf_rows_alone_agree_with_the_batch_and_missing_features_are_zero(name):
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map(
        name, num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5, head_feature_dims=[6, 4]
    ).double()
    x = torch.randn(3, 4, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batched, batched_scale = feature_map(x, is_query=False)
    for row in range(3):
        alone, alone_scale = feature_map(x[row : row + 1], is_query=False)
        torch.testing.assert_close(alone, batched[row : row + 1], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(alone_scale, batched_scale[row : row + 1], rtol=1e-12, atol=1e-12)
    assert torch.all(batched[:, 2:, :, 4:] == 0)  # the second map head has 4 features: the rest exactly 0


@pytest.mark.parametrize("name", ["prf", "learnable_prf"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("is_query", [False, True])
def test_prf_forward_matches_the_reference_formula_and_follows_parameter_updates(name, batch, is_query):
    """The regrouped PRF (one product, the norm only in the log scale) against the formula as written:
    forward and gradients, with head-wise dimensions; without gradients its folded weights are kept, and
    rebuilt once a parameter changes in place (an optimiser step, a load)."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map(
        name, num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5, head_feature_dims=[6, 4]
    ).double()
    with torch.no_grad():
        for parameter in feature_map.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, 3, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    expected = feature_map.reference_forward(x, is_query=is_query)
    got = feature_map(x, is_query=is_query)
    assert (got[1] is None) == (expected[1] is None) == is_query
    for a, b in zip(got, expected, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    weights = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in expected if t is not None]
    inputs = (x, *[p for p in feature_map.parameters() if p.requires_grad])
    for a, b in zip(
        weighted_gradients(got, weights, inputs), weighted_gradients(expected, weights, inputs), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        feature_map(x, is_query=is_query)  # folded weights kept from here
        feature_map.directions().mul_(1.5)
        got = feature_map(x, is_query=is_query)
        expected = feature_map.reference_forward(x, is_query=is_query)
        for a, b in zip(got, expected, strict=True):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("sinks, query_heads", [(0, 4), (2, 4), (2, 2)])
@pytest.mark.parametrize(
    "length, window, chunk, split",
    [(13, 5, 4, 6), (13, 3, 8, 9), (16, 6, 4, 1), (5, 8, 4, 2), (20, 3, 8, 13)],
)
def test_fused_window_attention_matches_the_reference_and_the_general_chunked_path(
    length, window, chunk, split, sinks, query_heads
):
    """A window prefill with no padding or soft-capping takes one fused softmax call per chunk, from no state
    or continuing one, with or without sinks: against the naive form over the whole sequence (forward and
    gradients) and the general blocked path (output, state) call by call."""
    from dofla.ops import chunked_window_attention, window_attention

    generator = torch.Generator().manual_seed(3)
    query, key, value = (
        torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
        for heads in (query_heads, 2, 2)
    )
    settings = dict(scaling=8**-0.5, window=window, sinks=sinks, chunk_size=chunk, return_state=True)
    pieces = [slice(0, split), slice(split, length)]
    fast, state, general_state = [], None, None
    for piece in pieces:
        q, k, v = query[:, :, piece], key[:, :, piece], value[:, :, piece]
        out, state = chunked_window_attention(q, k, v, initial_state=state, **settings)
        all_present = torch.ones(2, k.shape[2], dtype=torch.bool)  # a key mask takes the general path
        slow, general_state = chunked_window_attention(
            q, k, v, initial_state=general_state, key_mask=all_present, **settings
        )
        torch.testing.assert_close(out, slow, rtol=1e-10, atol=1e-12)
        assert state.num_tokens == general_state.num_tokens
        for a, b in zip(state.tensors(), general_state.tensors(), strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        fast.append(out)
    fast = torch.cat(fast, dim=2)
    expected = window_attention(query, key, value, scaling=8**-0.5, window=window, sinks=sinks)
    torch.testing.assert_close(fast, expected, rtol=1e-10, atol=1e-12)
    weights = torch.randn(expected.shape, generator=generator, dtype=expected.dtype)
    inputs = (query, key, value)
    for a, b in zip(
        weighted_gradients([fast], [weights], inputs),
        weighted_gradients([expected], [weights], inputs),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("sinks", [0, 2])
def test_fused_window_attention_after_padding_keeps_one_mask_per_row(sinks, return_lse):
    """The fused path shares one mask between the (batch, head) rows only where they see alike; after a
    left-padded first call the rows' absent keys and sink positions differ, and each row keeps its own."""
    from dofla.ops import chunked_window_attention
    from dofla.ops.window.chunked import _rows_alike

    generator = torch.Generator().manual_seed(5)
    query, key, value = (
        torch.randn(2, heads, 14, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2)
    )
    settings = dict(scaling=8**-0.5, window=4, sinks=sinks, chunk_size=4, return_state=True)
    key_mask = torch.ones(2, 3, dtype=torch.bool)
    key_mask[1, :2] = False  # the second row starts two tokens later
    first = [tensor[:, :, :3] for tensor in (query, key, value)]
    _, state = chunked_window_attention(*first, key_mask=key_mask, **settings)
    assert not (_rows_alike(state.key_present) and _rows_alike(state.sink_count[..., None]))
    rest = [tensor[:, :, 3:] for tensor in (query, key, value)]
    fast = chunked_window_attention(*rest, initial_state=state, return_lse=return_lse, **settings)
    all_present = torch.ones(2, 11, dtype=torch.bool)  # a key mask takes the general path
    slow = chunked_window_attention(
        *rest, initial_state=state, key_mask=all_present, return_lse=return_lse, **settings
    )
    for a, b in zip(fast[:-1], slow[:-1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sinks, query_heads", [(0, 4), (2, 4), (2, 2)])
@pytest.mark.parametrize("length, window, chunk, split", [(13, 5, 4, 6), (16, 6, 4, 1), (20, 3, 8, 13)])
def test_fused_window_log_sum_exp_without_gradients_matches_the_blocked_path(
    length, window, chunk, split, sinks, query_heads, dtype
):
    """``return_lse`` without gradients to track takes the fused kernel's entry point that returns the
    log-sum-exp; with them, the blocked path (the fused kernel gives no gradient for it)."""
    from dofla.ops import chunked_window_attention
    from dofla.ops.window.chunked import takes_fused_lse

    generator = torch.Generator().manual_seed(4)
    query, key, value = (
        torch.randn(2, heads, length, 8, generator=generator, dtype=dtype) for heads in (query_heads, 2, 2)
    )
    settings = dict(scaling=8**-0.5, window=window, sinks=sinks, chunk_size=chunk, return_state=True)
    fast_state = slow_state = None
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for piece in (slice(0, split), slice(split, length)):
        q, k, v = query[:, :, piece], key[:, :, piece], value[:, :, piece]
        assert takes_fused_lse(q, k, v)
        out, lse, fast_state = chunked_window_attention(
            q, k, v, initial_state=fast_state, return_lse=True, **settings
        )
        all_present = torch.ones(2, k.shape[2], dtype=torch.bool)  # a key mask takes the blocked path
        slow, slow_lse, slow_state = chunked_window_attention(
            q, k, v, initial_state=slow_state, key_mask=all_present, return_lse=True, **settings
        )
        torch.testing.assert_close(out, slow, **tolerance)
        torch.testing.assert_close(lse, slow_lse, **tolerance)
        for a, b in zip(fast_state.tensors(), slow_state.tensors(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not takes_fused_lse(query.requires_grad_(), key, value)
    with torch.no_grad():
        assert takes_fused_lse(query, key, value)


def test_prf_key_with_an_overflowing_norm_is_not_silently_dropped():
    """A key whose squared norm overflows float32 makes the attention non-finite with the regrouped map,
    as with the formula as written (not a key of weight 0: a diverged run must show as NaN)."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map("learnable_prf", num_heads=1, head_dim=8, feature_dim=6, scaling=8**-0.5)
    query, key, value = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 3)
    key[0, 0, 1] = 1e20  # finite, but its squared norm is not
    for features in (feature_map, feature_map.reference_forward):
        q_features, _ = features(query, is_query=True)
        k_features, k_log_scale = features(key, is_query=False)
        out = chunked_linear_attention(q_features, k_features, value, k_log_scale=k_log_scale, chunk_size=2)
        assert torch.isnan(out[:, :, 1:]).all()  # every query that sees the key
