"""Every cell's one-token decoding step (``decode_step``, the ring steps of ``dofla.ops.window.step`` and
``dofla.ops.hybrid.step``) against the recurrent and naive forms: outputs, states and gradients.
"""

from __future__ import annotations

import pytest
import torch
from helpers import count_calls
from ops_helpers import make_inputs, weighted_gradients

from dofla.attention import LinearAttention
from dofla.cache import RecurrentCacheLayer
from dofla.cell_inputs import StepInputs
from dofla.cells import build_student
from dofla.config import LayerPlan


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("feature_map", ["learnable_prf", "t2r", "hedgehog", "elu1"])
def test_decode_features_in_one_call_equal_separate_query_and_key_calls(share, feature_map):
    plan = LayerPlan(kind="linear", feature_map=feature_map, feature_dim=6, share_kv_heads=share)
    student = LinearAttention(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = student.double()
    with torch.no_grad():  # parameters away from their (identity-like) start
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(0)
    for batch, length in ((1, 1), (2, 1), (2, 3)):  # calls of up to decode_tokens tokens take the joint call
        query = torch.randn(batch, 4, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
        key = torch.randn(batch, 2, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
        joint = student.features(query, key)
        q_separate, _ = student.feature_map(query, is_query=True)
        k_separate, log_scale = student.feature_map(student.state_heads_view(key), is_query=False)
        separate = (q_separate, k_separate, log_scale)
        for got, expected in zip(joint, separate, strict=True):
            if expected is None:
                assert got is None
            else:
                torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        weights = [
            torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in separate if t is not None
        ]

        inputs = (query, key, *student.feature_map.parameters())
        joint_gradients = weighted_gradients(joint, weights, inputs)
        for got, expected in zip(joint_gradients, weighted_gradients(separate, weights, inputs), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_values_kept_for_decoding_follow_an_in_place_change_of_their_parameter():
    """Hedgehog's signed weight, a hybrid layer's step window factor and the gated delta cell's stacked
    gates, kept between calls without autograd, are rebuilt once a parameter changes in place (an
    optimiser step, a load), is replaced, or moves to another dtype."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map("hedgehog", num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5)
    shape = dict(layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = LinearAttention(LayerPlan(kind="hybrid", feature_map="hedgehog", feature_dim=6), **shape)
    delta = build_student(
        LayerPlan(kind="linear", cell="gated_delta", feature_map="projection", feature_dim=6), **shape
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 1, 8, generator=generator)
    values = torch.randn(3, 2, 8, generator=generator)  # (B, Hs, Dv)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(feature_map.decode_features(x)[0], feature_map(x, is_query=False)[0])
            torch.testing.assert_close(student.step_window_factor(), student.window_factor().view(2, 2, 1))
            weights = delta.step_weights(values.dtype)
            for index, gate in enumerate((delta.decay, delta.write)):
                torch.testing.assert_close(weights.gates[..., index], gate.weight * 8**-0.5)
                torch.testing.assert_close(weights.gate_bias[:, 0, index], gate.bias)
            feature_map.weight.mul_(1.7)
            student.window_factor_logit.add_(0.5)
            for gate in (delta.decay, delta.write):
                gate.weight.add_(torch.randn(gate.weight.shape, generator=generator))
                gate.bias.add_(0.3)
        feature_map.weight = torch.nn.Parameter(torch.randn(feature_map.weight.shape, generator=generator))
        torch.testing.assert_close(feature_map.decode_features(x)[0], feature_map(x, is_query=False)[0])
        feature_map.double()  # the same parameter object, another storage
        torch.testing.assert_close(
            feature_map.decode_features(x.double())[0], feature_map(x.double(), is_query=False)[0]
        )


_DECODE_CASES = [  # cell, kind, feature map, share_kv_heads, window, sinks (the prefill has 7 tokens)
    ("linear", "linear", "learnable_prf", True, 64, 0),
    ("linear", "linear", "hedgehog", False, 64, 0),
    ("gla", "linear", "learnable_prf", True, 64, 0),
    ("gla", "linear", "t2r", False, 64, 0),
    ("gated_delta", "linear", "projection", True, 64, 0),
    ("gated_delta", "linear", "learnable_prf", False, 64, 0),
    ("window", "hybrid", "learnable_prf", True, 3, 0),  # the window is full: its oldest key leaves
    ("window", "hybrid", "learnable_prf", False, 10, 0),  # not yet full
    ("linear", "hybrid", "learnable_prf", True, 3, 0),  # full: the oldest key joins the linear state
    ("linear", "hybrid", "hedgehog", False, 10, 0),  # still filling
    ("linear", "hybrid", "hedgehog", True, 3, 8),  # sinks still filling: the new key becomes one
    ("gla", "hybrid", "hedgehog", True, 3, 2),  # the recipe's cell: sinks held, window full
    ("gla", "hybrid", "learnable_prf", False, 10, 4),
    ("gla", "hybrid", "t2r", False, 2, 7),  # the new key is the last sink
    ("window", "hybrid", "learnable_prf", True, 3, 2),
    ("window", "hybrid", "learnable_prf", False, 10, 8),  # the new key becomes a sink
    ("gated_delta", "hybrid", "projection", True, 3, 2),  # the gated_delta recipe's cell: sinks held
    ("gated_delta", "hybrid", "learnable_prf", False, 10, 8),  # window and sinks still filling
]


DECODE_CASES = [  # ..., cell options
    *[(*case, {}) for case in _DECODE_CASES],
    ("gated_delta", "hybrid", "projection", True, 3, 2, {"mix": "adaptive"}),
    ("gated_delta", "hybrid", "learnable_prf", False, 10, 8, {"mix": "adaptive"}),
    ("gated_delta", "linear", "projection", True, 64, 0, {"short_conv": 4}),
    ("gated_delta", "hybrid", "learnable_prf", False, 10, 8, {"short_conv": 3}),
    ("gated_delta", "linear", "projection", True, 64, 0, {"short_conv": 4, "output_gate": True}),
    ("gated_delta", "hybrid", "projection", True, 3, 2, {"output_gate": True}),
    # the recall cache: full after the prefill (a kept token gives way), and still filling
    ("gated_delta", "hybrid", "projection", True, 3, 2, {"recall_cache": 2}),
    ("gated_delta", "hybrid", "learnable_prf", False, 3, 2, {"recall_cache": 3, "mix": "adaptive"}),
]


@pytest.mark.parametrize("cell, kind, feature_map, share, window, sinks, options", DECODE_CASES)
def test_decode_step_equals_the_recurrent_form_forward_state_and_gradients(
    cell, kind, feature_map, share, window, sinks, options
):
    """A single decoded token through the cell's ``decode_step`` (what generation runs) against the
    recurrent form from the same state: output, new state, and gradients of the inputs and parameters."""
    from dofla.cache import RecurrentCacheLayer

    plan = LayerPlan(
        kind=kind,
        cell=cell,
        feature_map=feature_map,
        feature_dim=6,
        share_kv_heads=share,
        window=window,
        sinks=sinks,
        options=options,
    )
    torch.manual_seed(0)
    student = build_student(
        plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5
    ).double()
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(2)

    def draw(heads, length, grad=False):
        tensor = torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64)
        return tensor.requires_grad_(grad)

    layer = RecurrentCacheLayer()
    student.pending_cache_layer = layer
    student(draw(4, 7), draw(2, 7), draw(2, 7))  # the prefill that makes the state (its graph kept)
    state = layer.state
    query, key, value = draw(4, 1, True), draw(2, 1, True), draw(2, 1, True)
    assert student.decode_step(StepInputs(query, key, value, state, 8**-0.5)) is not None
    results = {}
    for form in (None, "recurrent"):
        layer.state = state
        student.pending_cache_layer = layer
        output = student(query, key, value, form=form)
        weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
        inputs = [query, key, value, *student.trainable_parameters()]
        # allow_unused: a hybrid step's new key only enters the window, so its decay gate is unused
        gradients = torch.autograd.grad(
            (output * weights).sum(), inputs, allow_unused=True, retain_graph=True
        )  # the prefill's graph serves both forms
        results[form] = (output, layer.state, gradients)
    (fast, fast_state, fast_gradients), (slow, slow_state, slow_gradients) = (
        results[None],
        results["recurrent"],
    )
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    fast_state = fast_state.general_layout()  # a hybrid step's ring buffers, in order
    assert type(fast_state) is type(slow_state) and fast_state.num_tokens == slow_state.num_tokens == 8
    for a, b in zip(fast_state.tensors(), slow_state.tensors(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert [a is None for a in fast_gradients] == [b is None for b in slow_gradients]
    assert all(a is not None for a in fast_gradients[:3])  # query, key, value
    for a, b in zip(fast_gradients, slow_gradients, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("recall_cache", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adaptive_mix_decoding_without_gradients_equals_the_recurrent_form(dtype, recall_cache):
    """Generation (no autograd): the ring step's softmax and log-sum-exp come from one fused kernel call
    (with ``recall_cache``, over the window and the cache); token by token, against the recurrent form from
    the same state."""
    from dofla.cache import RecurrentCacheLayer

    plan = LayerPlan(
        kind="hybrid",
        cell="gated_delta",
        feature_map="projection",
        feature_dim=6,
        window=3,
        sinks=2,
        options={"mix": "adaptive", **({"recall_cache": recall_cache} if recall_cache else {})},
    )
    torch.manual_seed(0)
    student = build_student(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = student.to(dtype)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=dtype))

        def draw(heads, length):
            return torch.randn(2, heads, length, 8, generator=generator, dtype=dtype)

        fast, slow = RecurrentCacheLayer(), RecurrentCacheLayer()
        student.pending_cache_layer = fast
        student(draw(4, 7), draw(2, 7), draw(2, 7))
        slow.state = fast.state.map_tensors(torch.clone)  # steps update their state in place
        tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        for _ in range(4):
            query, key, value = draw(4, 1), draw(2, 1), draw(2, 1)
            student.pending_cache_layer = fast
            got = student(query, key, value)
            student.pending_cache_layer = slow
            expected = student(query, key, value, form="recurrent")
            torch.testing.assert_close(got, expected, **tolerance)
    assert type(fast.state.window).__name__ == "RingWindow"  # the decoding layout ran


def test_greedy_generate_of_the_recipe_cell_takes_the_hybrid_step_and_equals_full_forwards(monkeypatch):
    """The default recipe's cell (gla hybrid with sinks): generate() decodes through ``hybrid_decode_step``
    in every layer, and its greedy tokens equal the argmax of full forwards over the growing sequence
    (window 4 and 2 sinks: the window fills and slides during the 9 new tokens)."""
    import dofla.attention as attention_module
    from dofla.convert import convert, plan_for
    from dofla.models import build_tiny_model
    from dofla.models.tiny import TINY_VOCAB

    steps = count_calls(monkeypatch, attention_module, "hybrid_decode_step")
    model = build_tiny_model("llama", seed=0)
    convert(
        model,
        plan_for(model, kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=4, sinks=2),
    )
    prompt = torch.randint(1, TINY_VOCAB, (1, 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=9,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected = prompt
        for _ in range(9):
            next_token = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected)
    assert len(steps) == 8 * model.config.num_hidden_layers  # every decoded token after the first


@pytest.mark.parametrize("prefill, window, sinks", [(2, 3, 2), (0, 4, 2), (1, 3, 3), (5, 3, 0)])
@pytest.mark.parametrize("frozen", [False, True])
def test_ring_decode_steps_in_place_equal_the_recurrent_and_naive_forms(prefill, window, sinks, frozen):
    """Many steps of the ring-buffer decode ops (``dofla.ops.window.step``) without autograd, the buffers
    updated in place and the ring wrapping around several times, sinks filling during the steps or before:
    outputs against the recurrent form over all tokens and the naive form, the final state (put back in
    order) against the recurrent form's; the hybrid with key log scales, the window alone. ``frozen``: once
    a ring is in its steady state its token count stays put and the steps write the slot kept as a tensor
    (as a frozen decoding step does)."""
    from dofla.ops import (
        HybridInputs,
        HybridOptions,
        WindowInputs,
        WindowOptions,
        hybrid_attention,
        recurrent_window_attention,
        window_attention,
    )
    from dofla.ops.hybrid.recurrent import empty_hybrid_state, recurrent_hybrid_attention
    from dofla.ops.hybrid.step import hybrid_decode_step
    from dofla.ops.state import WindowState
    from dofla.ops.window.step import frozen_slot, ring_window, ring_window_step, steady_ring

    length, group = 13, 2
    inputs = {
        name: None if tensor is None else tensor.detach()
        for name, tensor in make_inputs(2, 4, 2, length, 5, log_scale_std=1.0, seed=4).items()
    }
    query, key, v, log_scale = inputs["query"], inputs["key"], inputs["v"], inputs["k_log_scale"]
    q_features, k_features, gamma = inputs["q_features"], inputs["k_features"], inputs["window_factor"]
    settings = dict(scaling=0.5, window=window, sinks=sinks)
    hybrid = HybridInputs(query, key, q_features, k_features, v, window_factor=gamma, k_log_scale=log_scale)
    expected, expected_state = recurrent_hybrid_attention(hybrid, HybridOptions(**settings))
    naive = hybrid_attention(hybrid, HybridOptions(**settings))
    expected_window, expected_window_state = recurrent_window_attention(
        WindowInputs(query, key, v), WindowOptions(**settings)
    )
    naive_window = window_attention(WindowInputs(query, key, v), WindowOptions(**settings))
    torch.testing.assert_close(expected, naive, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expected_window, naive_window, rtol=1e-10, atol=1e-12)

    def split(tensor, t):  # (B, H, T, X) -> token t grouped by key/value head (B, Hk, G, X)
        return tensor[:, :, t].view(2, 2, group, -1)

    with torch.no_grad():
        if prefill:
            first = [tensor[:, :, :prefill] for tensor in (query, key, q_features, k_features, v)]
            _, state = recurrent_hybrid_attention(
                HybridInputs(*first, window_factor=gamma, k_log_scale=log_scale[:, :, :prefill]),
                HybridOptions(**settings),
            )
            _, ring = recurrent_window_attention(
                WindowInputs(first[0], first[1], first[4]), WindowOptions(**settings)
            )
        else:
            state = empty_hybrid_state(
                2, 2, 4, 5, 3, window, sinks=sinks, dtype=torch.float64, state_dtype=torch.float64
            )
            ring = WindowState.empty(2, 2, 4, 3, window, sinks, dtype=torch.float64)
        ring = ring_window(ring, prefill)  # the hybrid step converts its state itself
        outputs, window_outputs = [], []
        slots, frozen_steps = {}, {"hybrid": 0, "window": 0}
        for t in range(prefill, length):
            rings = {"hybrid": getattr(state, "ring", None), "window": ring}
            for name, held in rings.items():
                if frozen and name not in slots and steady_ring(held):
                    slots[name] = frozen_slot(held)
                frozen_steps[name] += name in slots
            output, state = hybrid_decode_step(
                state,
                split(query, t),
                split(q_features, t),
                key[:, :, t],
                k_features[:, :, t],
                v[:, :, t],
                log_scale[:, :, t],
                gamma.view(2, group, 1),
                scaling=0.5,
                slot=slots.get("hybrid"),
            )
            outputs.append(output.reshape(2, 4, -1))
            window_output, ring = ring_window_step(
                ring, split(query, t), key[:, :, t], v[:, :, t], scaling=0.5, slot=slots.get("window")
            )
            window_outputs.append(window_output.reshape(2, 4, -1))
        state.ring.num_tokens += frozen_steps["hybrid"]  # what a frozen decoder's finish() does
        ring.num_tokens += frozen_steps["window"]
        assert bool(slots) == (frozen and length - prefill > window + 1)
    torch.testing.assert_close(torch.stack(outputs, 2), expected[:, :, prefill:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        torch.stack(window_outputs, 2), expected_window[:, :, prefill:], rtol=1e-10, atol=1e-12
    )
    for got, want in ((state, expected_state), (ring, expected_window_state)):
        got = got.general_layout()
        assert type(got) is type(want) and got.num_tokens == want.num_tokens == length
        for a, b in zip(got.tensors(), want.tensors(), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ring_state_made_in_inference_mode_decodes_on_outside_it():
    """Ring buffers made under ``torch.inference_mode`` cannot be written outside it: the step copies them."""

    plan = LayerPlan(kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=6, window=3, sinks=2)
    student = build_student(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    query, key, value = (torch.randn(1, heads, 6, 8) for heads in (4, 2, 2))
    layer, outputs = RecurrentCacheLayer(), []
    for start, mode in ((0, torch.inference_mode), (4, torch.inference_mode), (5, torch.no_grad)):
        stop = 4 if start == 0 else start + 1  # a prefill, then one step in each mode
        with mode():
            student.pending_cache_layer = layer
            outputs.append(student(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]))
    with torch.no_grad():
        expected = student(query, key, value)
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-6)


def test_ring_layout_round_trip_keeps_padded_keys_sinks_and_a_partial_window():
    """A general hybrid state (left-padded rows, sinks, window not yet full in one call and wrapped in the
    other) put in the decoding layout and back is the same state, exactly."""
    from dofla.ops import HybridInputs, HybridOptions, chunked_hybrid_attention
    from dofla.ops.hybrid.step import ring_hybrid_state

    for length in (5, 11):  # window 7: partial, then wrapped
        inputs = make_inputs(2, 4, 2, length, 5, log_scale_std=1.0, seed=5)
        key_mask = torch.ones(2, length, dtype=torch.bool)
        key_mask[1, :3] = False  # left padding: absent keys, sinks counted from the first real token
        with torch.no_grad():
            _, state = chunked_hybrid_attention(
                HybridInputs(**inputs, key_mask=key_mask),
                HybridOptions(scaling=0.5, window=7, sinks=2),
                chunk_size=4,
                return_state=True,
            )
        back = ring_hybrid_state(state).general_layout()
        assert (
            back.num_tokens == state.num_tokens == length
            and back.linear.num_tokens == state.linear.num_tokens
        )
        for a, b in zip(back.tensors(), state.tensors(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
