"""The hybrid op (``dofla.ops.hybrid``: the window softmax and linear attention in one normalisation), and
what it shares with the linear op (padding, errors, any shape): the fast forms against the reference and a
brute force, forward and gradients, sinks, state handoff."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_helpers import (
    HYBRID_NAMES,
    LINEAR_NAMES,
    assert_matches_reference,
    brute_force_hybrid,
    by_keywords,
    make_inputs,
    random_key_mask,
    relative_error,
    split,
)

from dofla import ops
from dofla.errors import DoflaError
from dofla.ops import (
    HybridInputs,
    HybridOptions,
    LinearInputs,
)

# the forms called with keywords, as the cases below write them
chunked_linear_attention = by_keywords(ops.chunked_linear_attention, LinearInputs)
linear_attention = by_keywords(ops.linear_attention, LinearInputs)
recurrent_linear_attention = by_keywords(ops.recurrent_linear_attention, LinearInputs)
chunked_hybrid_attention = by_keywords(ops.chunked_hybrid_attention, HybridInputs, HybridOptions)
hybrid_attention = by_keywords(ops.hybrid_attention, HybridInputs, HybridOptions)
recurrent_hybrid_attention = by_keywords(ops.recurrent_hybrid_attention, HybridInputs, HybridOptions)

# (batch, heads, kv heads, tokens, features, chunk, window): window 1, window not dividing chunk,
# window > chunk, T < window, T < chunk.
HYBRID_CASES = [
    (1, 2, 2, 17, 4, 8, 1),
    (2, 6, 2, 37, 5, 8, 3),
    (1, 4, 1, 30, 3, 4, 9),
    (1, 2, 1, 20, 6, 16, 64),
    (2, 3, 3, 6, 4, 16, 4),
]


def assert_hybrid_form_matches_naive(form, case, log_scale_std, softcap):
    """One fast hybrid form ("chunked" or "recurrent") against the naive one on a HYBRID_CASES case."""
    batch, heads, kv_heads, length, features, chunk, window = case
    inputs = make_inputs(batch, heads, kv_heads, length, features, log_scale_std=log_scale_std)
    fast, fast_kwargs = {
        "chunked": (chunked_hybrid_attention, {"chunk_size": chunk}),
        "recurrent": (recurrent_hybrid_attention, None),
    }[form]
    # With no key past the window the output does not depend on window_factor: its true gradient is 0 and the
    # float32 one is rounding noise of the shared normalisation, up to 1.04e-4 of the floor on some CPUs.
    tolerance = 2e-4 if length <= window else 1e-4
    assert_matches_reference(
        fast, hybrid_attention, inputs, HYBRID_NAMES, torch.float32, tolerance, fast_kwargs,
        scaling=0.7, window=window, softcap=softcap,
    )  # fmt: skip


@pytest.mark.parametrize("case", HYBRID_CASES)
@pytest.mark.parametrize("log_scale_std", [None, 30.0])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_chunked_hybrid_matches_naive_forward_and_gradients(case, log_scale_std, softcap):
    assert_hybrid_form_matches_naive("chunked", case, log_scale_std, softcap)


@pytest.mark.parametrize("case", HYBRID_CASES[1:4])
@pytest.mark.parametrize("log_scale_std", [None, 30.0])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_recurrent_hybrid_matches_naive_forward_and_gradients(case, log_scale_std, softcap):
    assert_hybrid_form_matches_naive("recurrent", case, log_scale_std, softcap)


def test_hybrid_bfloat16_inputs_match_reference_within_rounding():
    inputs = make_inputs(2, 6, 2, 29, 6, log_scale_std=5.0)
    kwargs = {"scaling": 0.5, "window": 5}
    assert_matches_reference(
        chunked_hybrid_attention, hybrid_attention, inputs, HYBRID_NAMES, torch.bfloat16, 2e-2,
        {"chunk_size": 8}, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("log_scale_std", [None, 20.0])
@pytest.mark.parametrize("prefill", [2, 13])  # prefill shorter and longer than the window
def test_hybrid_prefill_then_decode_then_chunked_equals_one_pass(log_scale_std, prefill):
    inputs = make_inputs(2, 6, 2, 36, 5, log_scale_std=log_scale_std)
    kwargs = {"scaling": 0.5, "window": 5, "window_factor": inputs["window_factor"].detach()}
    expected = hybrid_attention(**split(inputs, HYBRID_NAMES[:-1], 0, 36), **kwargs)
    out, state = chunked_hybrid_attention(
        **split(inputs, HYBRID_NAMES[:-1], 0, prefill), chunk_size=8, return_state=True, **kwargs
    )
    pieces = [out]
    for t in range(prefill, prefill + 7):
        out, state = recurrent_hybrid_attention(
            **split(inputs, HYBRID_NAMES[:-1], t, t + 1), state=state, **kwargs
        )
        pieces.append(out)
    assert state.keys.shape[2] == 5 and state.num_tokens == prefill + 7
    out, state = chunked_hybrid_attention(
        **split(inputs, HYBRID_NAMES[:-1], prefill + 7, 36), chunk_size=8, initial_state=state, return_state=True,
        **kwargs,
    )  # fmt: skip
    pieces.append(out)
    assert state.num_tokens == 36 and state.linear.num_tokens == 31
    assert relative_error(torch.cat(pieces, dim=2), expected) < 1e-12


def test_errors_are_dofla_errors_with_the_offending_values():
    inputs = {
        name: t.detach() for name, t in split(make_inputs(1, 4, 3, 8, 2), LINEAR_NAMES[:3], 0, 8).items()
    }
    with pytest.raises(DoflaError, match="4 query heads are not a multiple of 3"):
        chunked_linear_attention(**inputs)
    good = {name: t.detach() for name, t in split(make_inputs(1, 4, 2, 8, 2), LINEAR_NAMES[:3], 0, 8).items()}
    with pytest.raises(DoflaError, match="chunk_size"):
        chunked_linear_attention(**good, chunk_size=0)
    with pytest.raises(DoflaError, match="k_log_scale"):
        recurrent_linear_attention(**good, k_log_scale=torch.zeros(1, 2, 7))
    query, key = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4)
    with pytest.raises(DoflaError, match="window_factor"):
        chunked_hybrid_attention(query, key, **good, scaling=0.5, window=4, window_factor=torch.ones(2))
    with pytest.raises(DoflaError, match="window must be positive"):
        hybrid_attention(query, key, **good, scaling=0.5, window=0, window_factor=torch.ones(4) / 2)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("log_scale_std", [None, 10.0])
def test_key_mask_matches_reference_forward_and_gradients_without_nans(form, log_scale_std):
    inputs = make_inputs(2, 6, 2, 23, 5, log_scale_std=log_scale_std)
    key_mask = random_key_mask(2, 23)
    linear = chunked_linear_attention if form == "chunked" else recurrent_linear_attention
    hybrid = chunked_hybrid_attention if form == "chunked" else recurrent_hybrid_attention
    extra = {"chunk_size": 8} if form == "chunked" else {}
    assert_matches_reference(
        linear, linear_attention, inputs, LINEAR_NAMES, torch.float32, 1e-4, extra, key_mask=key_mask
    )
    assert_matches_reference(
        hybrid, hybrid_attention, inputs, HYBRID_NAMES, torch.float32, 1e-4, extra,
        key_mask=key_mask, scaling=0.5, window=4,
    )  # fmt: skip
    out = hybrid(**split(inputs, HYBRID_NAMES[:-1], 0, 23), key_mask=key_mask, scaling=0.5, window=4,
                 window_factor=inputs["window_factor"].detach(), **extra)  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all() and (out[0, :, :5] == 0).all()  # nothing to attend to yet


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_left_padding_with_key_mask_equals_the_unpadded_sequence(kind):
    inputs = make_inputs(1, 4, 2, 20, 5, log_scale_std=3.0)
    pad = 7
    padded = {
        name: None
        if t is None
        else torch.cat([torch.randn_like(t.detach()[:, :, :pad]) * 1e3, t.detach()], dim=2)
        for name, t in split(inputs, HYBRID_NAMES[:-1], 0, 20).items()
    }
    padded["k_features"] = padded["k_features"].abs()
    padded["q_features"] = padded["q_features"].abs()
    key_mask = torch.arange(20 + pad)[None, :] >= pad  # (1, T)
    if kind == "linear":
        names, function, reference, kwargs = LINEAR_NAMES, chunked_linear_attention, linear_attention, {}
    else:
        names, function, reference = HYBRID_NAMES[:-1], chunked_hybrid_attention, hybrid_attention
        kwargs = {"scaling": 0.5, "window": 6, "window_factor": inputs["window_factor"].detach()}
    expected = reference(**split(inputs, names, 0, 20), **kwargs)
    out = function(**{name: padded[name] for name in names}, key_mask=key_mask, chunk_size=8, **kwargs)
    assert relative_error(out[:, :, pad:], expected) < 1e-12


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    length=st.integers(1, 40),
    features=st.integers(1, 6),
    chunk=st.integers(1, 17),
    window=st.integers(1, 12),
    with_log_scale=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_shape_chunked_and_recurrent_agree_with_reference(
    batch, kv_heads, group, length, features, chunk, window, with_log_scale, seed
):
    inputs = make_inputs(
        batch,
        kv_heads * group,
        kv_heads,
        length,
        features,
        log_scale_std=8.0 if with_log_scale else None,
        seed=seed,
    )
    tensors = {name: None if t is None else t.detach() for name, t in inputs.items()}
    linear = {name: tensors[name] for name in LINEAR_NAMES}
    expected = linear_attention(**linear)
    assert relative_error(chunked_linear_attention(**linear, chunk_size=chunk), expected) < 1e-12
    assert relative_error(recurrent_linear_attention(**linear)[0], expected) < 1e-12
    hybrid = {name: tensors[name] for name in HYBRID_NAMES}
    expected = hybrid_attention(**hybrid, scaling=0.6, window=window)
    assert (
        relative_error(
            chunked_hybrid_attention(**hybrid, scaling=0.6, window=window, chunk_size=chunk), expected
        )
        < 1e-12
    )
    assert (
        relative_error(recurrent_hybrid_attention(**hybrid, scaling=0.6, window=window)[0], expected) < 1e-12
    )


@pytest.mark.parametrize("sinks", [0, 2, 12])  # none, fewer than the window, more than the sequence
def test_hybrid_with_sinks_equals_brute_force(sinks):
    inputs = make_inputs(1, 4, 2, 10, 3, log_scale_std=4.0, seed=3)
    kwargs = {"scaling": 0.7, "window": 3, "sinks": sinks}
    expected = brute_force_hybrid(inputs, **kwargs)
    tensors = {name: inputs[name].detach() for name in HYBRID_NAMES}
    for out in (
        hybrid_attention(**tensors, **kwargs),
        chunked_hybrid_attention(**tensors, **kwargs, chunk_size=4),
        recurrent_hybrid_attention(**tensors, **kwargs)[0],
    ):
        assert relative_error(out, expected) < 1e-12
    if sinks:  # the sinks really change the outputs of queries whose window has moved past them
        without = hybrid_attention(**tensors, **{**kwargs, "sinks": 0})
        assert torch.equal(without[:, :, :3], hybrid_attention(**tensors, **kwargs)[:, :, :3])
        assert (without[:, :, 3:] - expected[:, :, 3:]).abs().amax() > 1e-3


# (batch, heads, kv heads, tokens, features, chunk, window, sinks): sinks inside the window, sinks beyond
# the window with a chunk that does not divide T, T < sinks and T < chunk, window 1.
SINK_CASES = [
    (1, 2, 1, 19, 3, 8, 3, 2),
    (2, 6, 2, 37, 5, 8, 4, 6),
    (1, 3, 3, 5, 4, 16, 2, 8),
    (1, 4, 2, 24, 3, 5, 1, 1),
]


@pytest.mark.parametrize("case", SINK_CASES)
@pytest.mark.parametrize("log_scale_std", [None, 30.0])
def test_chunked_hybrid_with_sinks_matches_naive_forward_and_gradients(case, log_scale_std):
    batch, heads, kv_heads, length, features, chunk, window, sinks = case
    inputs = make_inputs(batch, heads, kv_heads, length, features, log_scale_std=log_scale_std)
    kwargs = {"scaling": 0.7, "window": window, "sinks": sinks, "softcap": 1.5 if window == 4 else None}
    assert_matches_reference(
        chunked_hybrid_attention, hybrid_attention, inputs, HYBRID_NAMES, torch.float32, 1e-4,
        {"chunk_size": chunk}, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("case", SINK_CASES[:3])
def test_recurrent_hybrid_with_sinks_matches_naive_forward_and_gradients(case):
    batch, heads, kv_heads, length, features, _, window, sinks = case
    inputs = make_inputs(batch, heads, kv_heads, length, features, log_scale_std=30.0)
    kwargs = {"scaling": 0.7, "window": window, "sinks": sinks}
    assert_matches_reference(
        recurrent_hybrid_attention, hybrid_attention, inputs, HYBRID_NAMES, torch.float32, 1e-4, **kwargs
    )


@pytest.mark.parametrize("prefill", [2, 13])  # prefill shorter than the sinks, and longer than the window
def test_hybrid_with_sinks_prefill_then_decode_then_chunked_equals_one_pass(prefill):
    inputs = make_inputs(2, 6, 2, 36, 5, log_scale_std=20.0)
    key_mask = torch.ones(2, 36, dtype=torch.bool)
    key_mask[1, :3] = False  # row 1 is left-padded: its sinks are tokens 3, 4, 5
    names = HYBRID_NAMES[:-1]
    kwargs = {"scaling": 0.5, "window": 5, "sinks": 3, "window_factor": inputs["window_factor"].detach()}
    expected = hybrid_attention(**split(inputs, names, 0, 36), key_mask=key_mask, **kwargs)

    def part(start, stop):
        return {**split(inputs, names, start, stop), "key_mask": key_mask[:, start:stop]}

    out, state = chunked_hybrid_attention(**part(0, prefill), chunk_size=8, return_state=True, **kwargs)
    pieces = [out]
    for t in range(prefill, prefill + 7):
        out, state = recurrent_hybrid_attention(**part(t, t + 1), state=state, **kwargs)
        pieces.append(out)
    assert state.keys.shape[2] == 5 and state.sink_keys.shape[2] == 3 and state.num_tokens == prefill + 7
    out, state = chunked_hybrid_attention(
        **part(prefill + 7, 36), chunk_size=8, initial_state=state, return_state=True, **kwargs
    )
    pieces.append(out)
    assert relative_error(torch.cat(pieces, dim=2), expected) < 1e-12
    assert state.num_tokens == 36 and state.linear.num_tokens == 31 and (state.sink_count == 3).all()
    assert torch.equal(state.sink_keys[1], inputs["key"].detach()[1, :, 3:6])


def test_chunked_states_carry_gradients_and_detach_drops_them():
    inputs = make_inputs(1, 2, 1, 9, 3, log_scale_std=2.0)
    _, state = chunked_hybrid_attention(
        **inputs, scaling=0.5, window=3, sinks=2, return_state=True,
    )  # fmt: skip
    assert state.sink_keys.requires_grad
    assert not any(tensor.requires_grad for tensor in state.detach().tensors())
