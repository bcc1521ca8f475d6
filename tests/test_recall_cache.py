"""The recall cache (dofla.ops.recall_cache): its fast form against the references, forward and gradients,
whatever the chunking and however a sequence is split into calls."""

import pytest
import torch
import torch.nn.functional as F

from dofla.ops import (
    DeltaInputs,
    WindowInputs,
    WindowOptions,
    chunked_gated_delta_rule,
    chunked_window_attention,
)
from dofla.ops.recall_cache import (
    RecallCache,
    attention_scores_naive,
    insert_recall_candidate,
    leaving_tokens,
    merge_softmax_parts,
    recall_cache_attention,
    recall_cache_window_attention,
    recall_errors,
    recall_scores_naive,
    window_attention_scores,
)
from dofla.ops.window.naive import window_attention

WINDOW, SINKS, BUDGET, LENGTH = 5, 2, 3, 23


def draw(seed=0, batch=2, heads=4, kv_heads=2, length=LENGTH, head_dim=4, value_dim=3):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return dict(
        query=normal(batch, heads, length, head_dim).requires_grad_(),
        key=normal(batch, kv_heads, length, head_dim).requires_grad_(),
        value=normal(batch, kv_heads, length, value_dim).requires_grad_(),
        log_decay=F.logsigmoid(normal(batch, kv_heads, length) + 3),
        beta=torch.sigmoid(normal(batch, kv_heads, length)),
    )


def fast_scores(key, value, log_decay, beta, window_state=None, memory_state=None):
    """Step-indexed recall errors: the chunked delta rule read at each leaving token's key."""
    keys = F.normalize(key, dim=-1)
    before = None if window_state is None else window_state
    leaving_key, leaving_value, positions, valid = leaving_tokens(key, value, before, WINDOW, SINKS)
    recalled, memory = chunked_gated_delta_rule(
        DeltaInputs(F.normalize(leaving_key, dim=-1), keys, value, log_decay, beta),
        chunk_size=4,
        initial_state=memory_state,
        return_state=True,
    )
    return leaving_key, leaving_value, positions, recall_errors(recalled, leaving_value, valid), memory


def test_recall_errors_match_the_token_loop():
    inputs = draw()
    _, _, positions, scores, _ = fast_scores(
        inputs["key"], inputs["value"], inputs["log_decay"], inputs["beta"]
    )
    reference = recall_scores_naive(
        F.normalize(inputs["key"], dim=-1),
        inputs["value"],
        inputs["log_decay"],
        inputs["beta"],
        window=WINDOW,
        sinks=SINKS,
    )
    steps = positions >= SINKS
    assert steps.sum() == LENGTH - WINDOW - SINKS
    torch.testing.assert_close(scores[..., steps], reference[..., positions[steps]], rtol=1e-6, atol=1e-6)
    assert torch.isinf(scores[..., ~steps]).all()


@pytest.mark.parametrize("cuts", [(), (9,), (3, 4, 11, 12, 13)])
def test_attention_scores_match_the_query_loop_however_the_calls_split(cuts):
    inputs = draw(seed=4)
    query, key = inputs["query"].detach(), inputs["key"].detach()
    scaling = 0.5
    options = WindowOptions(scaling, WINDOW, SINKS, None)
    _, lse = window_attention(WindowInputs(query, key, inputs["value"].detach()), options, return_lse=True)
    by_token = attention_scores_naive(query, key, lse, scaling=scaling, window=WINDOW, sinks=SINKS)
    assert torch.isfinite(by_token[..., SINKS : LENGTH - WINDOW]).all()
    assert torch.isinf(by_token[..., :SINKS]).all() and torch.isinf(by_token[..., LENGTH - WINDOW :]).all()
    pending, pieces = torch.zeros(2, 2, WINDOW), []
    for start, stop in zip((0, *cuts), (*cuts, LENGTH), strict=True):
        held = min(start, WINDOW)
        scores, pending = window_attention_scores(
            query[:, :, start:stop],
            key[:, :, start - held : stop],
            lse[:, :, start:stop],
            pending,
            start,
            scaling=scaling,
            window=WINDOW,
            sinks=SINKS,
            block=3,
        )
        pieces.append(scores)
    by_step = torch.cat(pieces, dim=-1)
    torch.testing.assert_close(by_step[..., WINDOW:], by_token[..., : LENGTH - WINDOW])
    assert torch.isinf(by_step[..., :WINDOW]).all()
    # each query's weights sum to at most 1, so a token seen by W queries of G heads scores at most G * W
    assert float(by_token[..., SINKS : LENGTH - WINDOW].max()) <= 2 * WINDOW


def fast_window_with_cache(
    query, key, value, scores, leaving_key, leaving_value, positions, chunk_size, state=None
):
    window_state, cache = (None, None) if state is None else state
    window, lse, new_window = chunked_window_attention(
        WindowInputs(query, key, value),
        WindowOptions(scaling=0.5, window=WINDOW, sinks=SINKS),
        chunk_size=4,
        initial_state=window_state,
        return_state=True,
        return_lse=True,
    )
    cache = RecallCache.empty(key, value, BUDGET) if cache is None else cache
    kept, kept_lse, cache = recall_cache_attention(
        query, leaving_key, leaving_value, scores, positions, cache, scaling=0.5, chunk_size=chunk_size
    )
    out, _ = merge_softmax_parts(window, lse, kept, kept_lse)
    return out, (new_window, cache)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_window_with_cache_matches_the_dense_reference(chunk_size):
    inputs = draw(seed=1)
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    leaving_key, leaving_value, positions, scores, _ = fast_scores(
        key, value, inputs["log_decay"], inputs["beta"]
    )
    token_scores = torch.full_like(scores, float("-inf"))
    steps = positions >= SINKS
    token_scores[..., positions[steps]] = scores[..., steps]
    reference = recall_cache_window_attention(
        query, key, value, token_scores, scaling=0.5, window=WINDOW, sinks=SINKS, budget=BUDGET
    )
    fast, _ = fast_window_with_cache(
        query, key, value, scores, leaving_key, leaving_value, positions, chunk_size
    )
    torch.testing.assert_close(fast, reference, rtol=1e-10, atol=1e-10)
    weight = torch.linspace(-1, 1, reference.numel(), dtype=torch.float64).view_as(reference)
    expected = torch.autograd.grad((reference * weight).sum(), (query, key, value))
    got = torch.autograd.grad((fast * weight).sum(), (query, key, value))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    # the cache changes the output: without it the window alone differs
    window_only = chunked_window_attention(
        WindowInputs(query, key, value), WindowOptions(scaling=0.5, window=WINDOW, sinks=SINKS)
    )
    assert (window_only - reference).abs().max() > 1e-3


def test_two_calls_equal_one():
    inputs = draw(seed=2)
    query, key, value, log_decay, beta = (
        inputs[name].detach() for name in ("query", "key", "value", "log_decay", "beta")
    )
    *leaving, scores, _ = fast_scores(key, value, log_decay, beta)
    whole, _ = fast_window_with_cache(query, key, value, scores, *leaving[:2], leaving[2], chunk_size=4)
    split = 13
    parts = []
    state, memory = None, None
    for start, stop in ((0, split), (split, LENGTH)):
        piece = [tensor[:, :, start:stop] for tensor in (query, key, value, log_decay, beta)]
        *leaving, scores, memory = fast_scores(
            piece[1], piece[2], piece[3], piece[4], None if state is None else state[0], memory
        )
        out, state = fast_window_with_cache(
            piece[0], piece[1], piece[2], scores, *leaving[:2], leaving[2], 4, state
        )
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=1e-10, atol=1e-10)
    assert state[1].scores.isfinite().sum() == state[1].scores.numel()  # every slot filled by then


@pytest.mark.parametrize("tied, budgets", [(False, None), (True, None), (False, (1, 2)), (True, (2, 1))])
def test_the_one_token_insertion_keeps_the_cache_of_the_chunked_form(tied, budgets):
    """``insert_recall_candidate`` (the cells' decoding step) against ``recall_cache_attention`` on chunks of
    one: the same cache, tensor for tensor, while it fills, when a token is not kept and when one gives
    way; ``tied`` draws scores from three values, so ties are decided by age; ``budgets``: two scores, the
    second the first reversed, each keeping its own number of tokens. (The decoding step's outputs:
    tests/test_decode_steps.py.)"""
    inputs = draw(seed=4)
    query, key, value = (inputs[name].detach() for name in ("query", "key", "value"))
    *leaving, scores, _ = fast_scores(key, value, inputs["log_decay"], inputs["beta"])
    leaving_key, leaving_value, positions = leaving
    if tied:
        generator = torch.Generator().manual_seed(7)
        drawn = torch.randint(0, 3, scores.shape, generator=generator).to(scores.dtype)
        scores = torch.where(torch.isfinite(scores), drawn, scores)
    if budgets:  # a second score that ranks the tokens the other way
        scores = torch.stack(
            [scores, -scores.nan_to_num(neginf=0.0).masked_fill(~torch.isfinite(scores), float("-inf"))], -1
        )
    slow = fast = RecallCache.empty(key, value, BUDGET, kinds=2 if budgets else 1)
    gave_way = refused = 0
    for t in range(LENGTH):
        step = slice(t, t + 1)
        *_, slow = recall_cache_attention(
            query[:, :, step], leaving_key[:, :, step], leaving_value[:, :, step], scores[:, :, step],
            positions[step], slow, scaling=0.5, chunk_size=1, budgets=budgets,
        )  # fmt: skip
        if positions[t] < SINKS:  # no token leaves: the step leaves the cache as it is
            continue
        before = fast
        fast = insert_recall_candidate(
            fast, leaving_key[:, :, t], leaving_value[:, :, t], scores[:, :, t], int(positions[t]), budgets
        )
        for got, want in zip(fast.tensors(), slow.tensors(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        full = torch.isfinite(before.scores[..., 0]).all(-1)
        gave_way += int((full & torch.isin(fast.positions, positions[t]).any(-1)).sum())
        refused += int((full & ~torch.isin(fast.positions, positions[t]).any(-1)).sum())
    assert gave_way > 0 and refused > 0  # full caches both took tokens and turned them away


# --- the gated-delta cell with the recall cache (dofla.cells.recall_cache) ---

from helpers import assert_student_forms_agree, count_calls  # noqa: E402

from dofla.cache import RecurrentCacheLayer  # noqa: E402
from dofla.cells import build_student  # noqa: E402
from dofla.config import LayerPlan  # noqa: E402
from dofla.errors import DoflaError  # noqa: E402

CELL_SHAPE = dict(layer_index=1, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)


def recall_cell(budget=3, **options):
    plan = LayerPlan(
        kind="hybrid",
        cell="gated_delta",
        feature_map="projection",
        feature_dim=6,
        window=4,
        sinks=2,
        options={"chunk_size": 4, "recall_cache": budget, **options},
    )
    torch.manual_seed(0)
    student = build_student(plan, **CELL_SHAPE).double()
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
        student.decay.bias.fill_(1.0)
    return student


def cell_inputs(length=17, seed=3):
    generator = torch.Generator().manual_seed(seed)

    def normal(heads):
        return torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64).requires_grad_()

    return normal(4), normal(2), normal(2)


BY_ATTENTION = {"recall_cache": 0, "heavy_hitters": 3}  # the heavy hitters alone
BOTH = {"recall_cache": 2, "heavy_hitters": 2}  # the union of the two


@pytest.mark.parametrize(
    "options",
    [{}, {"mix": "adaptive"}, {"output_gate": True}, BY_ATTENTION, BOTH, {**BOTH, "mix": "adaptive"}],
)
def test_cell_forms_agree_with_the_recall_cache(options):
    student = recall_cell(**options)
    output, _ = assert_student_forms_agree(student, *cell_inputs())
    without = recall_cell(budget=0, **{k: v for k, v in options.items() if k not in BOTH})
    without.load_state_dict(student.state_dict())
    assert (without(*cell_inputs(), form="naive") - output).abs().max() > 1e-4  # the cache is read


def test_the_heavy_hitters_keep_other_tokens_than_the_worst_recalled():
    by_error, by_attention, both = recall_cell(), recall_cell(**BY_ATTENTION), recall_cell(**BOTH)
    by_attention.load_state_dict(by_error.state_dict())
    both.load_state_dict(by_error.state_dict())
    inputs = cell_inputs()
    outputs = [cell(*inputs) for cell in (by_error, by_attention, both)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert (outputs[a] - outputs[b]).abs().max() > 1e-4


@pytest.mark.parametrize("options", [{}, BY_ATTENTION, BOTH])
def test_cell_prefill_then_decode_equals_one_pass(options):
    student = recall_cell(**options)
    query, key, value = (tensor.detach() for tensor in cell_inputs(length=19))
    full = student(query, key, value)
    layer, pieces = RecurrentCacheLayer(), []
    for start, stop in ((0, 9), (9, 10), (10, 11), (11, 14), (14, 19)):
        layer.update(key[:, :, start:stop], value[:, :, start:stop])
        student.pending_cache_layer = layer
        pieces.append(student(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
    kept = layer.state.recall
    filled = kept.scores[..., 0].isfinite().sum(-1)
    if options == BOTH:  # 2 + 2 slots: a token best by both scores takes one, and leaves one empty
        assert kept.keys.shape[2] == 4 and bool(((filled >= 2) & (filled <= 4)).all())
    else:
        assert kept.keys.shape[2] == 3 and bool((filled == 3).all())
    assert (kept.attention is None) == (options == {})
    if kept.attention is not None:  # the sums of the tokens in the window, held as state
        assert kept.attention.shape == (2, 2, 4) and bool((kept.attention > 0).all())
    assert layer.nbytes() >= kept.nbytes()


@pytest.mark.parametrize(
    "kind, options, message",
    [
        ("hybrid", {"recall_cache": -1}, "whole number"),
        ("hybrid", {"recall_cache": 2.5}, "whole number"),
        ("linear", {"recall_cache": 4}, "needs kind hybrid"),
        ("hybrid", {"recall_cache": 4, "short_conv": 3}, "without short_conv"),
        ("hybrid", {"heavy_hitters": -2}, "heavy_hitters is the number of tokens"),
        ("linear", {"heavy_hitters": 4}, "needs kind hybrid"),
    ],
)
def test_bad_recall_budgets_are_refused(kind, options, message):
    plan = LayerPlan(kind=kind, cell="gated_delta", feature_map="projection", window=4, options=options)
    with pytest.raises(DoflaError, match=message):
        build_student(plan, **CELL_SHAPE)


@pytest.mark.parametrize(
    "kept", [{"recall_cache": 3}, {"heavy_hitters": 3}, {"recall_cache": 1, "heavy_hitters": 2}]
)
def test_a_converted_model_with_the_recall_cache_decodes_as_it_runs_whole(monkeypatch, kept):
    """Token by token through the cells' decoding step (``window_step_with_recall_cache``, counted), the
    logits of one pass over the whole sequence."""
    from transformers import DynamicCache

    import dofla.cells.delta as delta_module
    from dofla.convert import convert, plan_for
    from dofla.models import build_tiny_model

    model = build_tiny_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8, seed=0)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    options = {"window_factor": 0.9, **kept}
    convert(
        model,
        plan_for(
            model,
            kind="hybrid",
            cell="gated_delta",
            feature_map="projection",
            feature_dim=8,
            window=4,
            sinks=2,
            options=options,
        ),
    )
    steps = count_calls(monkeypatch, delta_module, "window_step_with_recall_cache")
    with torch.no_grad():
        full = model(tokens).logits
        cache = DynamicCache(config=model.config)
        pieces = [model(tokens[:, :11], past_key_values=cache, use_cache=True).logits]
        for position in range(11, tokens.shape[1]):
            pieces.append(
                model(tokens[:, position : position + 1], past_key_values=cache, use_cache=True).logits
            )
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)
    assert len(steps) == 2 * (tokens.shape[1] - 11)  # every layer, every decoded token


def tiny_hybrid(recall_cache=0):
    from dofla.convert import convert, plan_for
    from dofla.models import build_tiny_model

    model = build_tiny_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8, seed=0)
    options = {"window_factor": 0.9, **({"recall_cache": recall_cache} if recall_cache else {})}
    plan = plan_for(
        model, kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=8, window=4, sinks=2
    )
    for layer in plan.layers:
        layer.options = {**layer.options, **options}
    torch.manual_seed(5)
    return convert(model, plan)


def test_the_cache_switched_on_after_training_is_the_cell_option_and_is_saved(tmp_path):
    from dofla.cells.recall_cache import switch_on_recall_cache
    from dofla.loading import load_converted
    from dofla.saving import save_converted

    tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    trained, built_with = tiny_hybrid(), tiny_hybrid(recall_cache=3)
    built_with.load_state_dict(trained.state_dict())  # no parameters of its own: the same state dict
    with torch.no_grad():
        before = trained(tokens).logits
        assert switch_on_recall_cache(trained, 3) == [0, 1]
        after, expected = trained(tokens).logits, built_with(tokens).logits
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    assert (after - before).abs().max() > 1e-4  # the cache is read
    assert [layer.options["recall_cache"] for layer in trained.dofla_plan.layers] == [3, 3]
    save_converted(trained, tmp_path / "model")
    loaded, _, plan = load_converted(tmp_path / "model")
    assert [layer.options["recall_cache"] for layer in plan.layers] == [3, 3]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, expected)


def test_the_cache_is_switched_on_only_where_it_can_be_read():
    from dofla.cells.recall_cache import switch_on_recall_cache
    from dofla.convert import convert, plan_for, set_position_period
    from dofla.models import build_tiny_model

    with pytest.raises(DoflaError, match="whole number >= 1 of tokens per head; got 0"):
        switch_on_recall_cache(tiny_hybrid(), 0)
    model = tiny_hybrid()
    set_position_period(model, 16)
    with pytest.raises(
        DoflaError, match="layer 0 reads positions modulo 16; the recall cache reads the true"
    ):
        switch_on_recall_cache(model, 4)
    assert model.dofla_plan.layers[0].options.get("recall_cache") is None  # nothing changed
    gla = build_tiny_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8, seed=0)
    convert(gla, plan_for(gla, kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=4))
    with pytest.raises(DoflaError, match="layer 0 is a gla cell; the recall cache needs gated_delta"):
        switch_on_recall_cache(gla, 4)
