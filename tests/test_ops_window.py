"""The sliding-window softmax op (``dofla.ops.window``) and its sinks: the fast forms against the reference
and a brute force, forward and gradients, log-sum-exps, padding, states and state handoff."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_helpers import (
    HYBRID_NAMES,
    WINDOW_NAMES,
    assert_matches_reference,
    brute_force_window,
    brute_force_window_lse,
    chunked_hybrid_attention,
    chunked_window_attention,
    first,
    hybrid_attention,
    make_inputs,
    padded_copy,
    random_key_mask,
    recurrent_hybrid_attention,
    recurrent_window_attention,
    relative_error,
    split,
    weighted_gradients,
    window_attention,
)

from dofla.errors import DoflaError
from dofla.ops import (
    WindowState,
    empty_hybrid_state,
)


@pytest.mark.parametrize("sinks", [0, 3])
def test_window_attention_equals_brute_force_softmax(sinks):
    inputs = make_inputs(2, 4, 2, 11, 2, head_dim=5, seed=4)
    kwargs = {"scaling": 0.8, "window": 4, "sinks": sinks}
    expected = brute_force_window(inputs, **kwargs)
    tensors = {name: inputs[name].detach() for name in WINDOW_NAMES}
    for out in (
        window_attention(**tensors, **kwargs),
        chunked_window_attention(**tensors, **kwargs, chunk_size=3),
        recurrent_window_attention(**tensors, **kwargs)[0],
    ):
        assert relative_error(out, expected) < 1e-12


@pytest.mark.parametrize("sinks", [0, 3])
def test_window_log_sum_exp_equals_brute_force_in_every_form(sinks):
    """``return_lse``: the log-sum-exp of each query's softmax scores over its window and sinks, what the
    gated_delta cell's adaptive mix reads."""
    inputs = make_inputs(2, 4, 2, 11, 2, head_dim=5, seed=4)
    kwargs = {"scaling": 0.8, "window": 4, "sinks": sinks}
    expected_out = brute_force_window(inputs, **kwargs)
    expected = brute_force_window_lse(inputs, **kwargs)
    tensors = {name: inputs[name].detach() for name in WINDOW_NAMES}
    kwargs["return_lse"] = True
    results = [
        window_attention(**tensors, **kwargs),
        chunked_window_attention(**tensors, **kwargs, chunk_size=3),
        chunked_window_attention(**tensors, **kwargs, chunk_size=3, return_state=True)[:2],
        recurrent_window_attention(**tensors, **kwargs)[:2],
    ]
    for out, lse in results:
        assert relative_error(out, expected_out) < 1e-12
        torch.testing.assert_close(lse, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["naive", "chunked", "recurrent"])
def test_window_log_sum_exp_of_a_query_that_sees_nothing_is_minus_infinity_without_nan_gradients(form):
    inputs = make_inputs(2, 4, 2, 9, 2, head_dim=5, seed=5)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[0, :3] = False  # row 0: three absent keys first
    function = {"naive": window_attention, "chunked": chunked_window_attention}.get(
        form, recurrent_window_attention
    )
    tensors = {name: inputs[name] for name in WINDOW_NAMES}
    results = function(**tensors, scaling=0.8, window=3, sinks=2, key_mask=key_mask, return_lse=True)
    lse = results[1]
    assert torch.isneginf(lse[0, :, :3]).all() and torch.isfinite(lse[0, :, 3:]).all()
    assert torch.isfinite(lse[1]).all()
    queries_and_keys = [tensors[name] for name in WINDOW_NAMES[:2]]  # lse does not read the values
    gradients = torch.autograd.grad(torch.where(torch.isfinite(lse), lse, 0).sum(), queries_and_keys)
    assert all(torch.isfinite(gradient).all() and gradient.abs().sum() > 0 for gradient in gradients)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_sinks_with_key_mask_match_reference_forward_and_gradients(form):
    inputs = make_inputs(2, 6, 2, 23, 5, log_scale_std=10.0)
    key_mask = random_key_mask(2, 23)  # row 0 starts with 5 absent keys: its sinks come later
    extra = {"chunk_size": 8} if form == "chunked" else {}
    hybrid = chunked_hybrid_attention if form == "chunked" else recurrent_hybrid_attention
    window = chunked_window_attention if form == "chunked" else recurrent_window_attention
    kwargs = {"key_mask": key_mask, "scaling": 0.5, "window": 4, "sinks": 3}
    assert_matches_reference(
        hybrid, hybrid_attention, inputs, HYBRID_NAMES, torch.float32, 1e-4, extra, **kwargs
    )
    assert_matches_reference(
        window, window_attention, inputs, WINDOW_NAMES, torch.float32, 1e-4, extra, **kwargs
    )
    out = first(window(**{name: inputs[name].detach() for name in WINDOW_NAMES}, **kwargs, **extra))
    assert torch.isfinite(out).all() and (out[0, :, :5] == 0).all()  # nothing to attend to yet


@pytest.mark.parametrize("kind", ["hybrid", "window"])
def test_left_padding_with_sinks_equals_the_unpadded_sequence(kind):
    inputs = make_inputs(1, 4, 2, 20, 5, log_scale_std=3.0)
    pad = 7
    if kind == "hybrid":
        names, function, reference = HYBRID_NAMES[:-1], chunked_hybrid_attention, hybrid_attention
        kwargs = {"scaling": 0.5, "window": 6, "sinks": 3, "window_factor": inputs["window_factor"].detach()}
    else:
        names, function, reference = WINDOW_NAMES, chunked_window_attention, window_attention
        kwargs = {"scaling": 0.5, "window": 6, "sinks": 3}
    expected = reference(**split(inputs, names, 0, 20), **kwargs)
    padded = padded_copy(split(inputs, names, 0, 20), pad)
    key_mask = torch.arange(20 + pad)[None, :] >= pad  # (1, T)
    out = function(**padded, key_mask=key_mask, chunk_size=8, **kwargs)
    assert relative_error(out[:, :, pad:], expected) < 1e-12
    # The padded keys are not sinks: the sinks are the first 3 real tokens.
    _, state = function(**padded, key_mask=key_mask, chunk_size=8, return_state=True, **kwargs)
    assert torch.equal(state.sink_keys, inputs["key"].detach()[:, :, :3])
    assert (state.sink_count == 3).all()


@pytest.mark.parametrize("prefill", [1, 11])
def test_window_prefill_then_decode_then_chunked_equals_one_pass(prefill):
    inputs = make_inputs(2, 6, 2, 30, 2, head_dim=6, seed=5)
    key_mask = torch.ones(2, 30, dtype=torch.bool)
    key_mask[0, :2] = False
    kwargs = {"scaling": 0.5, "window": 4, "sinks": 2, "softcap": 2.0}
    expected = window_attention(**split(inputs, WINDOW_NAMES, 0, 30), key_mask=key_mask, **kwargs)

    def part(start, stop):
        return {**split(inputs, WINDOW_NAMES, start, stop), "key_mask": key_mask[:, start:stop]}

    out, state = chunked_window_attention(**part(0, prefill), chunk_size=4, return_state=True, **kwargs)
    pieces = [out]
    for t in range(prefill, prefill + 6):
        out, state = recurrent_window_attention(**part(t, t + 1), state=state, **kwargs)
        pieces.append(out)
    out, state = chunked_window_attention(
        **part(prefill + 6, 30), chunk_size=4, initial_state=state, return_state=True, **kwargs
    )
    pieces.append(out)
    assert relative_error(torch.cat(pieces, dim=2), expected) < 1e-12
    assert state.num_tokens == 30 and state.keys.shape[2] == 4 and state.sink_keys.shape[2] == 2
    # The recurrent form's final state is the chunked form's.
    _, recurrent_state = recurrent_window_attention(**part(0, 30), **kwargs)
    for name in ("keys", "values", "key_present", "sink_keys", "sink_values", "sink_count"):
        assert torch.equal(getattr(recurrent_state, name), getattr(state, name)), name


# (batch, heads, kv heads, tokens, chunk, window, sinks)
WINDOW_CASES = [
    (1, 2, 2, 1, 8, 3, 0),
    (2, 6, 2, 29, 8, 5, 0),
    (1, 4, 1, 30, 4, 9, 3),
    (2, 3, 3, 6, 16, 2, 8),
]


@pytest.mark.parametrize("case", WINDOW_CASES)
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_chunked_window_matches_naive_forward_and_gradients(case, softcap):
    batch, heads, kv_heads, length, chunk, window, sinks = case
    inputs = make_inputs(batch, heads, kv_heads, length, 2, head_dim=5)
    kwargs = {"scaling": 0.7, "window": window, "sinks": sinks, "softcap": softcap}
    assert_matches_reference(
        chunked_window_attention, window_attention, inputs, WINDOW_NAMES, torch.float32, 1e-4,
        {"chunk_size": chunk}, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("case", WINDOW_CASES[1:])
def test_recurrent_window_matches_naive_forward_and_gradients(case):
    batch, heads, kv_heads, length, _, window, sinks = case
    inputs = make_inputs(batch, heads, kv_heads, length, 2, head_dim=5)
    kwargs = {"scaling": 0.7, "window": window, "sinks": sinks}
    assert_matches_reference(
        recurrent_window_attention, window_attention, inputs, WINDOW_NAMES, torch.float32, 1e-4, **kwargs
    )


def test_window_bfloat16_inputs_match_reference_within_rounding():
    inputs = make_inputs(2, 6, 2, 29, 2, head_dim=8)
    assert_matches_reference(
        chunked_window_attention, window_attention, inputs, WINDOW_NAMES, torch.bfloat16, 2e-2,
        {"chunk_size": 8}, scaling=0.5, window=5, sinks=2,
    )  # fmt: skip


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    length=st.integers(1, 30),
    chunk=st.integers(1, 12),
    window=st.integers(1, 10),
    sinks=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_any_shape_window_and_hybrid_with_sinks_agree_with_reference(
    batch, kv_heads, group, length, chunk, window, sinks, seed
):
    inputs = make_inputs(batch, kv_heads * group, kv_heads, length, 3, log_scale_std=8.0, seed=seed)
    tensors = {name: None if t is None else t.detach() for name, t in inputs.items()}
    kwargs = {"scaling": 0.6, "window": window, "sinks": sinks}
    hybrid = {name: tensors[name] for name in HYBRID_NAMES}
    expected = hybrid_attention(**hybrid, **kwargs)
    assert relative_error(chunked_hybrid_attention(**hybrid, **kwargs, chunk_size=chunk), expected) < 1e-12
    assert relative_error(recurrent_hybrid_attention(**hybrid, **kwargs)[0], expected) < 1e-12
    plain = {name: tensors[name] for name in WINDOW_NAMES}
    expected = window_attention(**plain, **kwargs)
    assert relative_error(chunked_window_attention(**plain, **kwargs, chunk_size=chunk), expected) < 1e-12
    assert relative_error(recurrent_window_attention(**plain, **kwargs)[0], expected) < 1e-12


@pytest.mark.parametrize("kind", ["hybrid", "window"])
def test_states_with_sinks_follow_batch_rows_devices_and_count_their_bytes(kind):
    inputs = make_inputs(3, 4, 2, 12, 3, log_scale_std=3.0)
    if kind == "hybrid":
        names = HYBRID_NAMES[:-1]
        chunked, recurrent, reference = chunked_hybrid_attention, recurrent_hybrid_attention, hybrid_attention
        extra = {"window_factor": inputs["window_factor"].detach()}
    else:
        names = WINDOW_NAMES
        chunked, recurrent, reference = chunked_window_attention, recurrent_window_attention, window_attention
        extra = {}
    kwargs = {"scaling": 0.5, "window": 3, "sinks": 2, **extra}
    _, state = chunked(**split(inputs, names, 0, 10), chunk_size=4, return_state=True, **kwargs)
    order = torch.tensor([2, 0, 2])
    reordered = {name: None if t is None else t.detach()[order] for name, t in inputs.items()}
    expected = reference(**split(reordered, names, 0, 12), **kwargs)[:, :, 10:]
    out, _ = recurrent(**split(reordered, names, 10, 12), state=state.index_select(order), **kwargs)
    assert relative_error(out, expected) < 1e-12
    repeated = state.repeat_interleave(2)
    assert repeated.sink_keys.shape[0] == 6 and torch.equal(repeated.sink_values[4], state.sink_values[2])
    assert torch.equal(state.to("cpu").sink_keys, state.sink_keys) and state.detach().sinks == 2
    # Two sink slots of keys (D = 4) and values (Dv = 3) per batch row and kv head, in float64.
    _, no_sinks = chunked(
        **split(inputs, names, 0, 10), chunk_size=4, return_state=True, **{**kwargs, "sinks": 0}
    )
    assert state.nbytes() - no_sinks.nbytes() == 3 * 2 * 2 * (4 + 3) * 8


def test_empty_states_read_as_nothing_seen():
    inputs = {name: t.detach() for name, t in make_inputs(2, 4, 2, 7, 3, log_scale_std=2.0).items()}
    kwargs = {"scaling": 0.5, "window": 3, "sinks": 2}
    empty = empty_hybrid_state(2, 2, 4, 3, 3, 3, sinks=2, dtype=torch.float64, state_dtype=torch.float64)
    out, _ = recurrent_hybrid_attention(**inputs, state=empty, **kwargs)
    assert relative_error(out, hybrid_attention(**inputs, **kwargs)) < 1e-12
    tensors = {name: inputs[name] for name in WINDOW_NAMES}
    empty = WindowState.empty(2, 2, 4, 3, window=3, sinks=2, dtype=torch.float64)
    out = chunked_window_attention(**tensors, initial_state=empty, chunk_size=2, **kwargs)
    assert relative_error(out, window_attention(**tensors, **kwargs)) < 1e-12


def test_sink_and_window_errors_are_dofla_errors():
    inputs = {name: t.detach() for name, t in make_inputs(1, 4, 2, 8, 2, log_scale_std=1.0).items()}
    with pytest.raises(DoflaError, match="attention-sink tokens must be 0 or more"):
        hybrid_attention(**inputs, scaling=0.5, window=3, sinks=-1)
    window_inputs = {name: inputs[name] for name in WINDOW_NAMES}
    with pytest.raises(DoflaError, match="window must be positive"):
        window_attention(**window_inputs, scaling=0.5, window=0)
    with pytest.raises(DoflaError, match="not a multiple"):
        chunked_window_attention(inputs["query"][:, :3], inputs["key"], inputs["v"], scaling=0.5, window=2)
    _, state = chunked_window_attention(**window_inputs, scaling=0.5, window=3, sinks=1, return_state=True)
    with pytest.raises(DoflaError, match="built with window 3 and 1 sinks"):
        recurrent_window_attention(**window_inputs, scaling=0.5, window=3, sinks=2, state=state)
    _, state = chunked_hybrid_attention(**inputs, scaling=0.5, window=3, return_state=True)
    with pytest.raises(DoflaError, match="built with window 3 and 0 sinks"):
        chunked_hybrid_attention(**inputs, scaling=0.5, window=3, sinks=1, initial_state=state)


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
