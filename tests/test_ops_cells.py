"""Ops of the long-context cells: attention sinks in the hybrid, sliding-window softmax attention, and the
gated delta rule. Every fast form against its reference on forward and gradients, state handoff between
the forms, padding, and closed-form checks computed here by brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_helpers import (
    HYBRID_NAMES,
    assert_matches_reference,
    make_inputs,
    random_key_mask,
    relative_error,
    split,
)

from dofla.errors import DoflaError
from dofla.ops import (
    DeltaState,
    WindowState,
    chunked_gated_delta_rule,
    chunked_hybrid_attention,
    chunked_window_attention,
    empty_hybrid_state,
    gated_delta_rule,
    hybrid_attention,
    recurrent_gated_delta_rule,
    recurrent_hybrid_attention,
    recurrent_window_attention,
    window_attention,
)

WINDOW_NAMES = ("query", "key", "v")
DELTA_NAMES = ("q", "k", "v", "log_decay", "beta")


def first(result):
    return result[0] if isinstance(result, tuple) else result


# ---------------------------------------------------------------- brute force: one query, one key at a time


def brute_force_softmax_set(i: int, window: int, sinks: int) -> list[int]:
    """Keys query i attends to by softmax (no padding): its window and the sinks."""
    return [j for j in range(i + 1) if j > i - window or j < sinks]


def brute_force_hybrid(inputs, *, scaling, window, sinks, eps=1e-6):
    query, key, q_features, k_features, v, log_scale, gamma = (
        inputs[name].detach() for name in HYBRID_NAMES
    )  # fmt: skip
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kv = h // group
            for i in range(length):
                soft = brute_force_softmax_set(i, window, sinks)
                linear = [j for j in range(i + 1) if j not in soft]
                scores = torch.stack([scaling * query[b, h, i] @ key[b, kv, j] for j in soft])
                weights = {
                    j: gamma[h] * torch.exp(s - scores.max()) for j, s in zip(soft, scores, strict=True)
                }
                if linear:
                    offset = max(log_scale[b, kv, j] for j in linear)
                    for j in linear:
                        kernel = q_features[b, h, i] @ k_features[b, kv, j]
                        weights[j] = (1 - gamma[h]) * kernel * torch.exp(log_scale[b, kv, j] - offset)
                total = sum(weights.values())
                out[b, h, i] = sum(w * v[b, kv, j] for j, w in weights.items()) / (total + eps)
    return out


def brute_force_window(inputs, *, scaling, window, sinks):
    """Softmax over each query's window and sinks; the sinks scored by ``inputs["sink_query"]`` if given."""
    query, key, v = (inputs[name].detach() for name in WINDOW_NAMES)
    sink_query = query if inputs.get("sink_query") is None else inputs["sink_query"].detach()
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                soft = brute_force_softmax_set(i, window, sinks)
                scores = torch.stack(
                    [
                        scaling * (sink_query if j < sinks else query)[b, h, i] @ key[b, h // group, j]
                        for j in soft
                    ]
                )
                probabilities = torch.softmax(scores, dim=0)
                out[b, h, i] = sum(p * v[b, h // group, j] for p, j in zip(probabilities, soft, strict=True))
    return out


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


def brute_force_window_lse(inputs, *, scaling, window, sinks):
    query, key = (inputs[name].detach() for name in WINDOW_NAMES[:2])
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    lse = torch.zeros(batch, heads, length, dtype=torch.float64)
    for b, h, i in itertools.product(range(batch), range(heads), range(length)):
        soft = brute_force_softmax_set(i, window, sinks)
        lse[b, h, i] = torch.logsumexp(
            torch.stack([scaling * query[b, h, i] @ key[b, h // group, j] for j in soft]), dim=0
        )
    return lse


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


# ---------------------------------------------------------------- hybrid with sinks: fast forms vs reference

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


def padded_copy(tensors, pad):
    """Left-pad every (B, heads, T, ...) tensor with ``pad`` large random tokens (features stay >= 0)."""
    padded = {}
    for name, tensor in tensors.items():
        if tensor is None or tensor.dim() < 3:
            padded[name] = tensor
            continue
        noise = torch.randn_like(tensor[:, :, :pad]) * 1e3
        padded[name] = torch.cat([noise.abs() if "features" in name else noise, tensor], dim=2)
    return padded


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


# ---------------------------------------------------------------- window attention: fast forms vs reference

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


# ---------------------------------------------------------------- states with sinks


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


def test_chunked_states_carry_gradients_and_detach_drops_them():
    inputs = make_inputs(1, 2, 1, 9, 3, log_scale_std=2.0)
    _, state = chunked_hybrid_attention(
        **inputs, scaling=0.5, window=3, sinks=2, return_state=True,
    )  # fmt: skip
    assert state.sink_keys.requires_grad
    assert not any(tensor.requires_grad for tensor in state.detach()._tensors())


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


# ---------------------------------------------------------------- gated delta rule


def make_delta_inputs(batch, heads, kv_heads, length, key_dim=4, value_dim=3, *, seed=0):
    """Leaf float64 tensors: unit-norm keys, log decays < 0 (down to about -5), beta in (0, 1)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    inputs = {
        "q": draw(batch, heads, length, key_dim) / key_dim**0.5,
        "k": F.normalize(draw(batch, kv_heads, length, key_dim), dim=-1),
        "v": draw(batch, kv_heads, length, value_dim),
        "log_decay": F.logsigmoid(2 + 2 * draw(batch, kv_heads, length)),
        "beta": torch.sigmoid(draw(batch, kv_heads, length)),
    }
    return {name: tensor.requires_grad_() for name, tensor in inputs.items()}


# (batch, heads, kv heads, tokens, chunk): T = 1, T < chunk, chunk not dividing T, GQA 6/2 and 4/1.
DELTA_CASES = [
    (1, 2, 2, 1, 8),
    (1, 3, 3, 5, 16),
    (2, 6, 2, 37, 8),
    (2, 4, 1, 32, 16),
]


@pytest.mark.parametrize("case", DELTA_CASES)
def test_chunked_delta_matches_naive_forward_and_gradients(case):
    batch, heads, kv_heads, length, chunk = case
    inputs = make_delta_inputs(batch, heads, kv_heads, length)
    assert_matches_reference(
        chunked_gated_delta_rule, gated_delta_rule, inputs, DELTA_NAMES, torch.float32, 1e-4,
        {"chunk_size": chunk},
    )  # fmt: skip


def test_chunked_delta_takes_strided_inputs_without_padding():
    """Inputs laid out (B, T, H, ...) and transposed, as a model's are, with chunks dividing the length
    (no padding copy, so the chunk views are taken of the caller's strided tensors): the naive form's output."""
    inputs = make_delta_inputs(1, 4, 2, 16)
    strided = {
        name: tensor.detach().movedim(2, 1).contiguous().movedim(1, 2) for name, tensor in inputs.items()
    }
    assert not strided["q"].is_contiguous()
    out = chunked_gated_delta_rule(**strided, chunk_size=4)
    assert relative_error(out, gated_delta_rule(**strided)) < 1e-5


@pytest.mark.parametrize("case", DELTA_CASES[1:])
def test_recurrent_delta_matches_naive_forward_and_gradients(case):
    batch, heads, kv_heads, length, _ = case
    inputs = make_delta_inputs(batch, heads, kv_heads, length)
    assert_matches_reference(
        recurrent_gated_delta_rule, gated_delta_rule, inputs, DELTA_NAMES, torch.float32, 1e-4
    )


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_delta_key_mask_matches_reference_and_padding_changes_nothing(form):
    inputs = make_delta_inputs(2, 4, 2, 23)
    key_mask = random_key_mask(2, 23)
    function = chunked_gated_delta_rule if form == "chunked" else recurrent_gated_delta_rule
    extra = {"chunk_size": 8} if form == "chunked" else {}
    assert_matches_reference(
        function, gated_delta_rule, inputs, DELTA_NAMES, torch.float32, 1e-4, extra, key_mask=key_mask
    )
    # Left padding: the real tokens' outputs are those of the unpadded sequence.
    tensors = {name: t.detach() for name, t in inputs.items()}
    padded = {
        name: torch.cat([torch.rand_like(t[:, :, :5]) * (-3 if name == "log_decay" else 1), t], dim=2)
        for name, t in tensors.items()
    }
    mask = torch.arange(28)[None, :] >= 5
    out = first(function(**padded, key_mask=mask.expand(2, 28), **extra))
    assert relative_error(out[:, :, 5:], gated_delta_rule(**tensors)) < 1e-12


def test_delta_prefill_then_decode_then_chunked_equals_one_pass():
    inputs = make_delta_inputs(2, 6, 2, 40, key_dim=5)
    expected = gated_delta_rule(**split(inputs, DELTA_NAMES, 0, 40))
    out, state = chunked_gated_delta_rule(
        **split(inputs, DELTA_NAMES, 0, 19), chunk_size=8, return_state=True
    )
    # The reference continues from a state too.
    continued = gated_delta_rule(**split(inputs, DELTA_NAMES, 19, 40), initial_state=state)
    assert relative_error(continued, expected[:, :, 19:]) < 1e-12
    pieces = [out]
    for t in range(19, 25):
        out, state = recurrent_gated_delta_rule(**split(inputs, DELTA_NAMES, t, t + 1), state=state)
        pieces.append(out)
    assert state.num_tokens == 25
    out, state = chunked_gated_delta_rule(
        **split(inputs, DELTA_NAMES, 25, 40), chunk_size=8, initial_state=state, return_state=True
    )
    pieces.append(out)
    assert state.num_tokens == 40 and state.kv.dtype == torch.float64
    assert relative_error(torch.cat(pieces, dim=2), expected) < 1e-12
    _, recurrent_state = recurrent_gated_delta_rule(**split(inputs, DELTA_NAMES, 0, 40))
    assert torch.allclose(state.kv, recurrent_state.kv, rtol=1e-10, atol=1e-12)


def test_delta_without_decay_and_full_beta_overwrites_orthonormal_keys():
    """a = 1, beta = 1, orthonormal keys: each write replaces what the key's slot held, exactly."""
    key_dim, length = 4, 11
    basis, _ = torch.linalg.qr(
        torch.randn(key_dim, key_dim, generator=torch.Generator().manual_seed(0)).double()
    )
    slot = torch.tensor([0, 2, 1, 2, 3, 0, 0, 1, 3, 2, 1])  # the key of token t is basis column slot[t]
    k = basis[:, slot].T.reshape(1, 1, length, key_dim)
    v = torch.randn(1, 1, length, 3, dtype=torch.float64)
    q = torch.randn(1, 2, length, key_dim, dtype=torch.float64)
    log_decay, beta = (
        torch.zeros(1, 1, length, dtype=torch.float64),
        torch.ones(1, 1, length, dtype=torch.float64),
    )
    expected = torch.zeros(1, 2, length, 3, dtype=torch.float64)
    for t in range(length):
        memory = torch.zeros(key_dim, 3, dtype=torch.float64)
        for s in set(slot[: t + 1].tolist()):
            last = max(i for i in range(t + 1) if slot[i] == s)
            memory += torch.outer(basis[:, s], v[0, 0, last])  # slot s holds its latest value only
        expected[0, :, t] = q[0, :, t] @ memory
    for out in (
        gated_delta_rule(q, k, v, log_decay, beta),
        chunked_gated_delta_rule(q, k, v, log_decay, beta, chunk_size=4),
        recurrent_gated_delta_rule(q, k, v, log_decay, beta)[0],
    ):
        assert relative_error(out, expected) < 1e-12


def test_delta_long_sequence_is_finite_and_chunked_matches_recurrent():
    torch.manual_seed(0)
    length = 2048
    q = torch.randn(1, 2, length, 8)
    k = F.normalize(torch.randn(1, 1, length, 8), dim=-1)
    v = torch.randn(1, 1, length, 4)
    # Decays from none to very strong (exp(-30) per token): cumulative log decays reach -10^4 in a chunk.
    log_decay = -torch.cat(
        [torch.zeros(1, 1, 512), 30 * torch.rand(1, 1, 512), torch.rand(1, 1, 1024) * 0.05], -1
    )
    beta = torch.sigmoid(torch.randn(1, 1, length))
    chunked, chunked_state = chunked_gated_delta_rule(
        q, k, v, log_decay, beta, chunk_size=64, return_state=True
    )
    recurrent, recurrent_state = recurrent_gated_delta_rule(q, k, v, log_decay, beta)
    assert torch.isfinite(chunked).all() and torch.isfinite(chunked_state.kv).all()
    assert relative_error(chunked, recurrent) < 1e-4
    assert relative_error(chunked_state.kv, recurrent_state.kv) < 1e-4
    assert chunked.abs().max() < 20  # unit keys and beta < 1 keep the memory bounded


def test_delta_normalize_keys_flag_equals_normalising_first():
    inputs = {name: t.detach() for name, t in make_delta_inputs(1, 2, 1, 9).items()}
    raw = {**inputs, "k": inputs["k"] * torch.rand(1, 1, 9, 1, dtype=torch.float64) * 5}
    out = chunked_gated_delta_rule(**raw, normalize_keys=True, chunk_size=4)
    assert relative_error(out, gated_delta_rule(**inputs)) < 1e-12
    assert relative_error(recurrent_gated_delta_rule(**raw, normalize_keys=True)[0], out) < 1e-12


def test_delta_state_helpers_and_errors():
    inputs = {name: t.detach() for name, t in make_delta_inputs(3, 4, 2, 10).items()}
    _, state = chunked_gated_delta_rule(**split(inputs, DELTA_NAMES, 0, 8), chunk_size=4, return_state=True)
    assert state.nbytes() == 3 * 2 * 4 * 3 * 8 and state.kv.shape == (3, 2, 4, 3)
    order = torch.tensor([1, 1, 0])
    reordered = {name: t[order] for name, t in inputs.items()}
    out, _ = recurrent_gated_delta_rule(
        **split(reordered, DELTA_NAMES, 8, 10), state=state.index_select(order)
    )
    assert relative_error(out, gated_delta_rule(**reordered)[:, :, 8:]) < 1e-12
    assert torch.equal(state.repeat_interleave(2).kv[5], state.kv[2])
    assert torch.equal(DeltaState.empty(3, 2, 4, 3).kv, torch.zeros(3, 2, 4, 3))
    with pytest.raises(DoflaError, match="beta"):
        gated_delta_rule(**{**inputs, "beta": inputs["beta"][:, :1]})
    with pytest.raises(DoflaError, match="delta state"):
        recurrent_gated_delta_rule(**inputs, state=DeltaState.empty(3, 2, 5, 3))
    with pytest.raises(DoflaError, match="chunk_size"):
        chunked_gated_delta_rule(**inputs, chunk_size=0)
