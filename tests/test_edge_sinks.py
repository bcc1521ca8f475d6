"""Sinks seen from the window's edge (``sink_query`` in the ops, ``sinks_at_edge`` in a plan).

The ops' reference is a brute force here (the sinks' columns scored by their own queries, query by query);
every fast form (chunked fused and general, recurrent, the decoding ring steps) is compared with the naive
form on forward and gradients, and across calls. Through a model, the window-only student with its sinks at
the edge must equal the teacher cut to the same window by ``window_restricted(..., sinks_at_edge=True)``
(an independent implementation, tested against its own query-by-query reference), and decoding token by
token must equal the full forward for every hybrid cell.
"""

from __future__ import annotations

import pytest
import torch
from ops_helpers import (
    HYBRID_NAMES,
    assert_matches_reference,
    brute_force_window,
    chunked_hybrid_attention,
    chunked_window_attention,
    hybrid_attention,
    make_inputs,
    random_key_mask,
    recurrent_hybrid_attention,
    recurrent_window_attention,
    split,
    window_attention,
)
from test_position_period import decode_logits, record_decode_steps, rotate, tokens

from dofla.config import ConversionPlan
from dofla.convert import convert, plan_for, set_sinks_at_edge
from dofla.errors import DoflaError
from dofla.evaluation.window_baseline import window_restricted
from dofla.loading import load_converted
from dofla.models import build_tiny_model
from dofla.models.surgery import students
from dofla.ops.hybrid.step import hybrid_decode_step
from dofla.ops.state import WindowState
from dofla.ops.window.step import ring_window, ring_window_step
from dofla.saving import save_converted

WINDOW_NAMES = ("query", "key", "v", "sink_query")
EDGE_HYBRID_NAMES = (*HYBRID_NAMES, "sink_query")


def with_sink_query(inputs, seed=7):
    generator = torch.Generator().manual_seed(seed)
    sink_query = torch.randn(inputs["query"].shape, generator=generator, dtype=torch.float64)
    return {**inputs, "sink_query": sink_query.requires_grad_()}


def test_window_with_sink_queries_equals_brute_force_in_every_form():
    inputs = {
        k: t.detach()
        for k, t in with_sink_query(make_inputs(2, 4, 2, 13, 2, head_dim=6)).items()
        if t is not None
    }
    kwargs = {"scaling": 0.8, "window": 4, "sinks": 3}
    tensors = {name: inputs[name] for name in WINDOW_NAMES}
    expected = brute_force_window(tensors, **kwargs)
    without = window_attention(**{**tensors, "sink_query": None}, **kwargs)
    assert (without - expected).abs().amax() > 1e-2  # the sink queries matter
    outputs = [
        window_attention(**tensors, **kwargs),
        chunked_window_attention(**tensors, **kwargs, chunk_size=4),  # fused, no gradient: sinks apart
        chunked_window_attention(**tensors, **kwargs, chunk_size=5, key_mask=torch.ones(2, 13, dtype=bool)),
        recurrent_window_attention(**tensors, **kwargs)[0],
    ]
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


# (batch, heads, kv heads, tokens, chunk, window, sinks, softcap)
CASES = [(1, 2, 1, 19, 8, 3, 2, None), (2, 6, 2, 37, 8, 4, 6, 1.5), (1, 4, 2, 24, 5, 1, 1, None)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("form", ["chunked", "chunked_general", "recurrent"])
def test_window_with_sink_queries_matches_naive_forward_and_gradients(case, form):
    batch, heads, kv_heads, length, chunk, window, sinks, softcap = case
    inputs = with_sink_query(make_inputs(batch, heads, kv_heads, length, 2, head_dim=4, value_dim=4))
    kwargs = {"scaling": 0.7, "window": window, "sinks": sinks, "softcap": softcap}
    extra = {"chunk_size": chunk} if form.startswith("chunked") else {}
    if form == "chunked_general":
        kwargs["key_mask"] = random_key_mask(batch, length)
    fast = recurrent_window_attention if form == "recurrent" else chunked_window_attention
    # with gradients the fused chunked path scores window and sinks in one call of doubled key width
    assert_matches_reference(
        fast, window_attention, inputs, WINDOW_NAMES, torch.float32, 1e-4, extra, **kwargs
    )


def test_fused_window_log_sum_exp_with_sink_queries_matches_naive():
    inputs = with_sink_query(make_inputs(2, 4, 2, 30, 2, head_dim=4, value_dim=4))
    tensors = {name: inputs[name].detach().float() for name in WINDOW_NAMES}
    kwargs = {"scaling": 0.6, "window": 5, "sinks": 3, "return_lse": True}
    with torch.no_grad():
        out, lse = chunked_window_attention(**tensors, **kwargs, chunk_size=8)
    expected, expected_lse = window_attention(**{k: t.double() for k, t in tensors.items()}, **kwargs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_hybrid_with_sink_queries_matches_naive_forward_and_gradients(form):
    inputs = with_sink_query(make_inputs(2, 6, 2, 29, 5, log_scale_std=10.0))
    kwargs = {"scaling": 0.5, "window": 4, "sinks": 3, "key_mask": random_key_mask(2, 29)}
    fast = chunked_hybrid_attention if form == "chunked" else recurrent_hybrid_attention
    extra = {"chunk_size": 8} if form == "chunked" else {}
    assert_matches_reference(
        fast, hybrid_attention, inputs, EDGE_HYBRID_NAMES, torch.float32, 1e-4, extra, **kwargs
    )


def test_hybrid_with_sink_queries_prefill_then_decode_steps_then_chunked_equals_one_pass():
    """Chunked prefill, the one-token ring step, the recurrent form and chunked again, as one naive pass."""
    inputs = {
        k: None if t is None else t.detach()
        for k, t in with_sink_query(make_inputs(2, 6, 2, 36, 5, log_scale_std=5.0)).items()
    }
    names = (*HYBRID_NAMES[:-1], "sink_query")
    gamma = inputs["window_factor"]
    kwargs = {"scaling": 0.5, "window": 5, "sinks": 3}
    expected = hybrid_attention(**split(inputs, names, 0, 36), window_factor=gamma, **kwargs)
    out, state = chunked_hybrid_attention(
        **split(inputs, names, 0, 11), window_factor=gamma, chunk_size=4, return_state=True, **kwargs
    )
    pieces = [out]
    for t in range(11, 20):  # the decoding ring step
        step = split(inputs, names, t, t + 1)
        batch, heads = 2, 2
        out, state = hybrid_decode_step(
            state,
            step["query"].reshape(batch, heads, 3, -1),
            step["q_features"].reshape(batch, heads, 3, -1),
            step["key"][:, :, 0],
            step["k_features"][:, :, 0],
            step["v"][:, :, 0],
            step["k_log_scale"][:, :, 0],
            gamma.view(heads, 3, 1),
            scaling=0.5,
            sink_queries=step["sink_query"].reshape(batch, heads, 3, -1),
        )
        pieces.append(out.reshape(batch, 6, 1, -1))
    state = state.general_layout()
    for t in range(20, 23):
        out, state = recurrent_hybrid_attention(
            **split(inputs, names, t, t + 1), window_factor=gamma, state=state, **kwargs
        )
        pieces.append(out)
    out = chunked_hybrid_attention(
        **split(inputs, names, 23, 36), window_factor=gamma, chunk_size=4, initial_state=state, **kwargs
    )
    pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("return_lse", [False, True])
def test_window_ring_step_with_sink_queries_equals_the_recurrent_form(return_lse):
    inputs = {
        k: t.detach()
        for k, t in with_sink_query(make_inputs(1, 4, 2, 20, 2, head_dim=4, value_dim=4)).items()
        if t is not None
    }
    kwargs = {"scaling": 0.9, "window": 4, "sinks": 2}
    tensors = {name: inputs[name] for name in WINDOW_NAMES}
    expected, expected_lse, _ = recurrent_window_attention(**tensors, **kwargs, return_lse=True)
    ring = ring_window(WindowState.empty_like(tensors["key"], tensors["v"], 4, 2), 0)
    for t in range(20):
        result = ring_window_step(
            ring,
            tensors["query"][:, :, t].reshape(1, 2, 2, 4),
            tensors["key"][:, :, t],
            tensors["v"][:, :, t],
            scaling=0.9,
            return_lse=return_lse,
            sink_queries=tensors["sink_query"][:, :, t].reshape(1, 2, 2, 4),
        )
        ring = result[-1]
        torch.testing.assert_close(result[0].reshape(1, 4, -1), expected[:, :, t], rtol=1e-10, atol=1e-10)
        if return_lse:
            torch.testing.assert_close(result[1].reshape(1, 4), expected_lse[:, :, t], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("step", ["window", "window_lse", "hybrid"])
@pytest.mark.parametrize("rows", [1, 2])  # one position for the batch, or one per row
def test_ring_steps_with_sink_keys_turned_back_equal_turned_sink_queries(step, rows):
    """A decoding step turns the sinks' keys the opposite way (one product) and scores every slot in one
    softmax (``sink_key_turn``): the same as scoring the sinks with the turned queries, forward and gradients."""
    from dofla.rotary import edge_turns

    batch, heads, kv_heads, dim = 2, 6, 2, 8
    inputs = {
        k: None if t is None else t.detach()
        for k, t in make_inputs(batch, heads, kv_heads, 12, 5, head_dim=dim, log_scale_std=1.0).items()
    }
    names = HYBRID_NAMES[:-1]
    kwargs = {"scaling": 0.7, "window": 4, "sinks": 2}
    gamma = inputs["window_factor"]
    _, state = chunked_hybrid_attention(
        **split(inputs, names, 0, 11), window_factor=gamma, chunk_size=4, return_state=True, **kwargs
    )
    now = split(inputs, names, 11, 12)
    query = now["query"].reshape(batch, kv_heads, 3, dim).clone().requires_grad_()
    key, value = now["key"][:, :, 0], now["v"][:, :, 0]
    positions = torch.tensor([[15], [40]])[:rows]
    turns = edge_turns(positions, 1, 6, torch.tensor([1.0, 0.2, 0.03]), torch.float64, dim)
    assert turns is not None and turns.matrix is not None

    def run(**sinks_by):
        if step == "hybrid":
            out, _ = hybrid_decode_step(
                state, query, now["q_features"].reshape(batch, kv_heads, 3, -1), key,
                now["k_features"][:, :, 0], value, now["k_log_scale"][:, :, 0],
                gamma.view(kv_heads, 3, 1), scaling=0.7, **sinks_by,
            )  # fmt: skip
            return (out,)
        ring = ring_window(state.window_state(), state.num_tokens)
        result = ring_window_step(ring, query, key, value, scaling=0.7, return_lse=step == "window_lse",
                                  **sinks_by)  # fmt: skip
        return result[:-1]

    turned = turns(query.reshape(batch, kv_heads * 3, 1, dim)).view(query.shape)
    expected = run(sink_queries=turned)
    result = run(sink_key_turn=turns.keys_for_turned_query)
    for got, want in zip(result, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn(expected[0].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (want_grad,) = torch.autograd.grad((expected[0] * weights).sum(), query)
    (got_grad,) = torch.autograd.grad((result[0] * weights).sum(), query)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-10)
    plain = run()  # the sinks at their true positions score differently
    assert (plain[0] - expected[0]).abs().max() > 1e-6


def test_a_wrongly_shaped_sink_query_is_refused():
    inputs = {k: t.detach() for k, t in make_inputs(1, 4, 2, 6, 2).items() if t is not None}
    with pytest.raises(DoflaError, match="sink_query"):
        window_attention(inputs["query"], inputs["key"], inputs["v"], scaling=1.0, window=2, sinks=1,
                         sink_query=inputs["query"][:, :2])  # fmt: skip


# ---------------------------------------------------------------- through a model

WINDOW_PLAN = dict(kind="hybrid", cell="window", window=6, sinks=3)
HYBRID_PLANS = {
    "hybrid": dict(kind="hybrid", feature_map="hedgehog", feature_dim=8, window=6, sinks=3),
    "gla": dict(kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=6, sinks=3),
    "gated_delta": dict(kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=8, window=6,
                        sinks=3),
    "gated_delta_adaptive": dict(kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=8,
                                 window=6, sinks=3, options={"mix": "adaptive"}),
    "window": WINDOW_PLAN,
}  # fmt: skip


def converted(plan: dict, *, edge: bool = True, family: str = "llama"):
    model = build_tiny_model(family, seed=0)
    convert(model, plan_for(model, **plan))
    if edge:
        set_sinks_at_edge(model, True)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_the_window_cell_with_edge_sinks_equals_the_teacher_cut_to_its_window_with_edge_sinks(family):
    ids = tokens(40)
    teacher = build_tiny_model(family, seed=0).eval()
    with torch.no_grad(), window_restricted(teacher, 6, 3, sinks_at_edge=True):
        expected = teacher(ids).logits
    with torch.no_grad(), window_restricted(teacher, 6, 3):
        true_positions = teacher(ids).logits
    model = converted(WINDOW_PLAN, family=family)
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert (out - true_positions)[:, 9:].abs().max() > 1e-3  # past the edge the sinks moved
    torch.testing.assert_close(out[:, :9], true_positions[:, :9], rtol=1e-4, atol=1e-4)  # before it, not


@pytest.mark.parametrize("name", sorted(HYBRID_PLANS))
def test_decoding_with_edge_sinks_equals_the_full_forward(name):
    """Prefill (past the edge) then token by token: the fast ring steps and the general forms."""
    model = converted(HYBRID_PLANS[name])
    ids = tokens(30)
    with torch.no_grad():
        full = model(ids).logits
    steps = record_decode_steps(model)
    torch.testing.assert_close(decode_logits(model, ids, prefill=11), full, rtol=1e-4, atol=1e-4)
    assert None not in steps and len(steps) == (30 - 11) * len(students(model))
    set_sinks_at_edge(model, False)
    with torch.no_grad():
        true_positions = model(ids).logits
    assert (true_positions - full)[:, 9:].abs().max() > 1e-4  # the edge changed the sinks' scores
    torch.testing.assert_close(true_positions[:, :9], full[:, :9], rtol=1e-5, atol=1e-5)


def test_a_short_prefill_then_decoding_past_the_edge_and_with_a_period():
    from dofla.convert import set_position_period

    model = converted(HYBRID_PLANS["gated_delta"])
    set_position_period(model, 8)
    ids = tokens(26)
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(decode_logits(model, ids, prefill=3), full, rtol=1e-4, atol=1e-4)


def test_window_memory_parts_see_the_sinks_from_the_edge():
    model = converted(HYBRID_PLANS["gated_delta"])
    student = students(model)[0]
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = student.num_heads, student.num_kv_heads, student.head_dim
    query = torch.randn(1, heads, 20, dim, generator=generator)
    key, value = torch.randn(1, kv_heads, 20, dim, generator=generator), torch.randn(1, kv_heads, 20, dim)
    with torch.no_grad():
        parts = student.window_memory_parts(query, key, value)
        output = student(query, key, value)
        mixed = parts["gamma"] * parts["window"] + (1 - parts["gamma"]) * parts["memory"]
        torch.testing.assert_close(mixed, output, rtol=1e-5, atol=1e-5)
        student.edge_sink_frequencies = None
        assert (student(query, key, value) - output).abs().max() > 1e-4


def test_the_option_is_saved_with_the_model_and_old_plans_read_as_true_positions(tmp_path):
    model = converted(HYBRID_PLANS["hybrid"])
    assert model.dofla_plan.sinks_at_edge
    save_converted(model, tmp_path / "model")
    loaded, _, plan = load_converted(str(tmp_path / "model"))
    assert plan.sinks_at_edge
    assert all(layer.edge_sink_frequencies is not None for layer in students(loaded).values())
    ids = tokens(30)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    old = plan.to_dict()
    del old["sinks_at_edge"]
    assert ConversionPlan.from_dict(old).sinks_at_edge is False
    with pytest.raises(DoflaError, match="true or false"):
        ConversionPlan.from_dict({**old, "sinks_at_edge": "yes"})


def test_a_model_without_rotary_embeddings_is_refused_in_one_sentence():
    model = build_tiny_model("gpt2", seed=0)
    convert(model, plan_for(model, **WINDOW_PLAN))
    with pytest.raises(DoflaError, match="rotary"):
        set_sinks_at_edge(model, True)
    set_sinks_at_edge(model, False)  # turning it off needs nothing


@pytest.mark.parametrize("name", ["gla", "gated_delta"])
def test_a_left_padded_batch_generates_what_each_prompt_gives_alone(name):
    """The edge is placed by each row's positions (left padding shifts a row's tokens, not its positions)."""
    assert_left_padded_batch_generates_each_prompt_alone(converted(HYBRID_PLANS[name]), new_tokens=8)


def assert_left_padded_batch_generates_each_prompt_alone(model, new_tokens: int) -> None:
    """Greedy generation of two prompts (5 and 12 tokens) in one left-padded batch gives each row's logits
    as the prompt alone does."""
    generator = torch.Generator().manual_seed(0)
    short, long_ = (torch.randint(3, 60, (1, length), generator=generator) for length in (5, 12))
    batch = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1), long_])  # left padding
    mask = torch.ones_like(batch)
    mask[0, :7] = 0
    options = dict(
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        together = torch.stack(model.generate(batch, attention_mask=mask, **options).logits, 1)
        for row, prompt in enumerate((short, long_)):
            alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options).logits
            torch.testing.assert_close(together[row], torch.cat(alone), rtol=1e-4, atol=1e-4)


def test_edge_turns_are_computed_once_per_positions_tensor_and_again_when_it_changes():
    from dofla.rotary import edge_turns

    frequencies = torch.tensor([1.0, 0.1, 0.01])
    positions = torch.arange(20)[None]
    first = edge_turns(positions, 20, 9, frequencies, torch.float32)
    assert edge_turns(positions, 20, 9, frequencies, torch.float32) is first  # the next layer's call
    x = torch.randn(1, 2, 20, 8)
    shift = (positions.clamp(max=9) - positions).float()[:, None, :, None] * frequencies
    torch.testing.assert_close(rotate(x, shift), rotate(x, torch.atan2(first.sin, first.cos)))
    positions += 1  # changed in place: computed again
    moved = edge_turns(positions, 20, 9, frequencies, torch.float32)
    assert moved is not first and not torch.equal(moved.cos, first.cos)
    assert edge_turns(positions.clone(), 20, 9, frequencies, torch.float32) is not moved  # another tensor
    assert edge_turns(torch.arange(9)[None], 9, 9, frequencies, torch.float32) is None  # none past the edge


def test_turns_of_positions_made_in_inference_mode_are_kept_and_computed_again_when_they_change():
    """Inference tensors keep no version counter: the kept turns compare the positions themselves."""
    from dofla.rotary import edge_turns

    frequencies = torch.tensor([1.0, 0.1, 0.01])
    with torch.inference_mode():
        positions = torch.arange(20)[None]
        first = edge_turns(positions, 20, 9, frequencies, torch.float32)
        assert edge_turns(positions, 20, 9, frequencies, torch.float32) is first
        positions += 1  # changed in place: computed again
        moved = edge_turns(positions, 20, 9, frequencies, torch.float32)
        assert moved is not first and not torch.equal(moved.cos, first.cos)


@pytest.mark.parametrize("name", ["gla", "gated_delta"])
def test_decoding_in_inference_mode_with_edge_sinks_and_a_period_equals_the_full_forward(name):
    from dofla.convert import set_position_period

    model = converted(HYBRID_PLANS[name])
    set_position_period(model, 8)
    ids = tokens(26)
    with torch.no_grad():
        full = model(ids).logits
    logits = decode_logits(model, ids, prefill=11, mode=torch.inference_mode)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
