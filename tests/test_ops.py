"""The chunked and recurrent forms against the quadratic reference, forward and gradients, and state handoff."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_helpers import (
    HYBRID_NAMES,
    LINEAR_NAMES,
    assert_chunked_linear_matches_naive,
    assert_matches_reference,
    make_inputs,
    random_key_mask,
    relative_error,
    split,
)

from dofla.errors import DoflaError
from dofla.feature_maps import build_feature_map
from dofla.ops import (
    LinearState,
    chunked_hybrid_attention,
    chunked_linear_attention,
    hybrid_attention,
    linear_attention,
    recurrent_hybrid_attention,
    recurrent_linear_attention,
)

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


def test_linear_state_empty_reads_as_nothing_seen():
    state = LinearState.empty(2, 3, 4, 5)
    assert state.kv.shape == (2, 3, 4, 5) and torch.isneginf(state.log_offset).all()
    q, k, v = torch.rand(2, 3, 1, 4), torch.rand(2, 3, 1, 4), torch.randn(2, 3, 1, 5)
    out, _ = recurrent_linear_attention(q, k, v, state=state)
    assert torch.allclose(out, linear_attention(q, k, v))


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
