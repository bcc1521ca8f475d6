"""Student cells: the registry, and the gated linear attention cell's forms, semantics and decoding."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_student_forms_agree

from dofla.cache import RecurrentCacheLayer
from dofla.cell_inputs import AttendInputs
from dofla.cells import CELLS, GatedDeltaAttention, GatedLinearAttention, build_student
from dofla.config import LayerPlan
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.loading import load_converted
from dofla.models import build_tiny_model
from dofla.models.surgery import is_converted
from dofla.saving import save_converted

B, H, HKV, D = 2, 4, 2, 8
SHAPE = dict(layer_index=1, num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5)


def make_cell(
    cell="gla", kind="linear", feature_map="learnable_prf", share=True, window=5, sinks=0, **options
):
    plan = LayerPlan(
        kind=kind,
        sinks=sinks,
        cell=cell,
        feature_map=feature_map,
        feature_dim=6,
        share_kv_heads=share,
        window=window,
        options={"chunk_size": 4, **options},
    )
    torch.manual_seed(0)
    student = build_student(plan, **SHAPE).double()
    with torch.no_grad():  # a data-dependent decay that really varies, and short memories
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
        if isinstance(student, GatedLinearAttention | GatedDeltaAttention):
            student.decay.bias.fill_(1.0)
    return student


def qkv(length=11, seed=1):
    generator = torch.Generator().manual_seed(seed)

    def draw(heads):
        return torch.randn(B, heads, length, D, generator=generator, dtype=torch.float64).requires_grad_()

    return draw(H), draw(HKV), draw(HKV)


def test_unknown_cell_lists_the_known_ones_where_students_are_built():
    assert {"linear", "gla"} <= set(CELLS)
    with pytest.raises(DoflaError, match="unknown cell 'nope'; choose one of: .*gla.*linear"):
        build_student(LayerPlan(cell="nope"), **SHAPE)
    model = build_tiny_model("llama")
    plan = plan_for(model, cell="nope")  # a plan is plain data: the name is checked when a student is built
    with pytest.raises(DoflaError, match="unknown cell 'nope'"):
        convert(model, plan)
    assert not is_converted(model)


ADAPTIVE = {"mix": "adaptive"}
FORM_CASES = [  # cell, kind, feature map, share_kv_heads, cell options
    ("gla", "linear", "hedgehog", True, {}),
    ("gla", "hybrid", "learnable_prf", False, {}),
    ("gated_delta", "linear", "projection", True, {}),
    ("gated_delta", "hybrid", "hedgehog", True, {}),
    ("gated_delta", "hybrid", "learnable_prf", False, {}),
    ("gated_delta", "hybrid", "projection", True, ADAPTIVE),
    ("gated_delta", "hybrid", "learnable_prf", False, ADAPTIVE),
    ("gated_delta", "linear", "projection", True, {"short_conv": 4}),
    ("gated_delta", "hybrid", "learnable_prf", False, {"short_conv": 3}),
    ("gated_delta", "linear", "projection", True, {"short_conv": 4, "output_gate": True}),
    ("gated_delta", "hybrid", "learnable_prf", False, {"output_gate": True}),
]


@pytest.mark.parametrize("cell, kind, feature_map, share, options", FORM_CASES)
def test_cell_forms_agree_forward_and_gradients(cell, kind, feature_map, share, options):
    student = make_cell(cell, kind, feature_map, share, sinks=2 if kind == "hybrid" else 0, **options)
    query, key, value = qkv()
    _, reference_gradients = assert_student_forms_agree(student, query, key, value)
    assert all(gradient.abs().sum() > 0 for gradient in reference_gradients[3:])  # every parameter learns


def test_gla_is_normalised_linear_attention_with_decay():
    """Brute force: out_i = sum_j a_ij v_j / sum_j a_ij with a_ij = phi(q_i).phi(k_j) prod_{t=j+1..i} alpha_t."""
    student = make_cell("gla", "linear", "hedgehog", share=True)
    query, key, value = (tensor.detach() for tensor in qkv(length=9))
    q_features, k_features, _ = student.features(query, key)  # (B, H, T, F), (B, HKV, T, F)
    log_alpha = student.log_decay(value, None)  # (B, HKV, T)
    group = H // HKV
    expected = torch.zeros(B, 9, H, D, dtype=torch.float64)
    for head in range(H):
        kv_head = head // group
        for i in range(9):
            weights = torch.stack(
                [
                    (q_features[:, head, i] * k_features[:, kv_head, j]).sum(-1)
                    * torch.exp(log_alpha[:, kv_head, j + 1 : i + 1].sum(-1))
                    for j in range(i + 1)
                ],
                dim=-1,
            )  # (B, i + 1)
            expected[:, i, head] = (weights[..., None] * value[:, kv_head, : i + 1]).sum(1) / (
                weights.sum(-1, keepdim=True) + 1e-6
            )
    torch.testing.assert_close(student(query, key, value, form="naive"), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    "cell, kind, feature_map, options",
    [
        ("gla", "linear", "learnable_prf", {}),
        ("gla", "hybrid", "learnable_prf", {}),
        ("gated_delta", "hybrid", "projection", {}),
        ("gated_delta", "hybrid", "projection", ADAPTIVE),
        ("gated_delta", "linear", "projection", {"short_conv": 4}),
        ("gated_delta", "hybrid", "projection", {"short_conv": 3}),
        ("gated_delta", "linear", "projection", {"short_conv": 4, "output_gate": True}),
        ("gated_delta", "hybrid", "projection", {"output_gate": True}),
        ("window", "hybrid", "hedgehog", {}),
    ],
)
def test_prefill_then_decode_equals_one_pass(cell, kind, feature_map, options):
    student = make_cell(cell, kind, feature_map, sinks=2 if kind == "hybrid" else 0, **options)
    query, key, value = (tensor.detach() for tensor in qkv(length=13))
    full = student(query, key, value)
    layer, pieces = RecurrentCacheLayer(), []
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 13)):  # chunked, 2 recurrent steps, chunked again
        layer.update(key[:, :, start:stop], value[:, :, start:stop])
        student.pending_cache_layer = layer
        pieces.append(student(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
    assert layer.state.num_tokens == 13 and layer.nbytes() > 0
    reordered = layer.state.index_select(torch.tensor([1, 0]))
    for got, expected in zip(reordered.tensors(), layer.state.tensors(), strict=True):
        torch.testing.assert_close(got[0], expected[1])


def test_gla_initial_memories_span_the_configured_range():
    student = build_student(LayerPlan(cell="gla", options={"decay_memory": [16, 256]}), **SHAPE)
    memories = 1 / (1 - torch.sigmoid(student.decay.bias))
    torch.testing.assert_close(memories, torch.tensor([16.0, 256.0]), rtol=1e-4, atol=0)
    with pytest.raises(DoflaError, match="decay_memory"):
        build_student(LayerPlan(cell="gla", options={"decay_memory": [0.5, 4]}), **SHAPE)


def test_gla_model_saves_reloads_and_generates(tmp_path):
    model = build_tiny_model("llama", seed=0)
    convert(
        model, plan_for(model, kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=4)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "decay" in name:
                parameter.add_(0.2 * torch.randn_like(parameter))
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = model(tokens).logits
    save_converted(model, tmp_path / "out", extra_metadata={"teacher": "tiny"})
    loaded, _, plan = load_converted(tmp_path / "out")
    assert {layer.cell for layer in plan.layers} == {"gla"}
    torch.testing.assert_close(loaded(tokens).logits, expected, rtol=0, atol=0)
    generated = loaded.generate(tokens[:1, :6], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 11)


def test_window_cell_is_softmax_over_window_and_sinks_with_no_parameters():
    student = make_cell("window", "hybrid", window=3, sinks=1)
    assert list(student.parameters()) == []
    query, key, value = (tensor.detach() for tensor in qkv(length=8))
    scores = torch.einsum("bhtd,bhsd->bhts", query, key.repeat_interleave(H // HKV, dim=1)) * D**-0.5
    position = torch.arange(8)
    visible = (position[None, :] <= position[:, None]) & (
        (position[None, :] > position[:, None] - 3) | (position[None, :] < 1)
    )
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    expected = (weights @ value.repeat_interleave(H // HKV, dim=1)).transpose(1, 2)
    for form in ("naive", "chunked", "recurrent"):
        torch.testing.assert_close(student(query, key, value, form=form), expected, rtol=1e-9, atol=1e-10)
    with pytest.raises(DoflaError, match="window cell needs a window"):
        build_student(LayerPlan(kind="linear", cell="window"), **SHAPE)


def test_delta_cell_with_small_beta_starts_near_the_window():
    """gamma = 1 - tiny: the hybrid delta cell is (almost) the window softmax, whatever its memory holds."""
    near = make_cell("gated_delta", "hybrid", "projection", window_factor=1 - 1e-9, sinks=1)
    window = make_cell("window", "hybrid", window=5, sinks=1)
    query, key, value = (tensor.detach() for tensor in qkv(length=10))
    torch.testing.assert_close(near(query, key, value), window(query, key, value), rtol=1e-6, atol=1e-7)


def test_adaptive_mix_is_the_memory_as_one_more_softmax_key():
    """mix "adaptive" with lse weight 1 and value weight 0: gamma_t = sigmoid(l_h + lse_t), i.e. a softmax over
    the window's keys and one more key of logit -l_h whose value is the memory's read-out (brute force)."""
    window = 3
    student = make_cell("gated_delta", "hybrid", "projection", window=window, **ADAPTIVE)
    query, key, value = (tensor.detach() for tensor in qkv(length=9))
    with torch.no_grad():
        student.mix_value_weight.zero_()
        student.mix_lse_weight.fill_(1.0)
        logits = student.window_factor_logit.clone()
        student.window_factor_logit.fill_(-60.0)  # gamma ~ 1e-26 with lse weight 0: the memory alone
        student.mix_lse_weight.zero_()
        memory = student(query, key, value, form="naive")  # (B, T, H, D)
        student.window_factor_logit.copy_(logits)
        student.mix_lse_weight.fill_(1.0)
    scores = torch.einsum("bhtd,bhsd->bhts", query, key.repeat_interleave(H // HKV, dim=1)) * D**-0.5
    position = torch.arange(9)
    visible = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))  # (B, H, T, S)
    memory_logit = (-logits).view(1, H, 1, 1).expand(B, H, 9, 1).to(scores.dtype)
    weights = torch.softmax(torch.cat([scores, memory_logit], dim=-1), dim=-1)
    values = value.repeat_interleave(H // HKV, dim=1)  # (B, H, S, D)
    expected = weights[..., :-1] @ values + weights[..., -1:] * memory.transpose(1, 2)
    for form in ("naive", "chunked", "recurrent"):
        got = student(query, key, value, form=form)
        torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-9, atol=1e-10)


def test_adaptive_mix_starts_as_the_fixed_mix_and_is_refused_without_a_window():
    fixed = make_cell("gated_delta", "hybrid", "projection", sinks=1)
    adaptive = make_cell("gated_delta", "hybrid", "projection", sinks=1, **ADAPTIVE)
    adaptive.load_state_dict(fixed.state_dict(), strict=False)  # the mix's own weights stay 0
    with torch.no_grad():
        adaptive.mix_lse_weight.zero_()
        adaptive.mix_value_weight.zero_()
    query, key, value = (tensor.detach() for tensor in qkv(length=10))
    torch.testing.assert_close(adaptive(query, key, value), fixed(query, key, value), rtol=1e-12, atol=1e-13)
    fresh = build_student(LayerPlan(kind="hybrid", cell="gated_delta", options=ADAPTIVE), **SHAPE)
    assert not fresh.mix_lse_weight.any() and not fresh.mix_value_weight.any()
    groups = {group["name"]: group for group in fresh.parameter_groups(1e-3)}
    assert groups["mix"]["params"] == [fresh.mix_lse_weight, fresh.mix_value_weight]
    assert groups["mix"]["lr"] == 1e-3
    faster = build_student(
        LayerPlan(kind="hybrid", cell="gated_delta", options={**ADAPTIVE, "mix_lr": 10}), **SHAPE
    )
    assert {group["name"]: group["lr"] for group in faster.parameter_groups(1e-3)}["mix"] == pytest.approx(
        1e-2
    )
    trained = [id(parameter) for group in faster.parameter_groups(1e-3) for parameter in group["params"]]
    assert sorted(trained) == sorted(id(parameter) for parameter in faster.trainable_parameters())
    with pytest.raises(DoflaError, match="mix_lr must be positive"):
        build_student(
            LayerPlan(kind="hybrid", cell="gated_delta", options={**ADAPTIVE, "mix_lr": 0}), **SHAPE
        )
    with pytest.raises(DoflaError, match="mix 'adaptive' .* needs kind hybrid"):
        build_student(LayerPlan(cell="gated_delta", feature_map="projection", options=ADAPTIVE), **SHAPE)
    with pytest.raises(DoflaError, match="unknown mix 'soft'.*fixed, adaptive"):
        build_student(LayerPlan(kind="hybrid", cell="gated_delta", options={"mix": "soft"}), **SHAPE)


def test_sinks_need_a_window_and_unknown_options_are_named():
    with pytest.raises(DoflaError, match="sink tokens belong to the sliding window"):
        LayerPlan(kind="linear", sinks=4).validate(0, H, HKV)
    with pytest.raises(DoflaError, match="beta must lie strictly between 0 and 1"):
        build_student(LayerPlan(cell="gated_delta", feature_map="projection", options={"beta": 1.5}), **SHAPE)


@pytest.mark.parametrize("cell, feature_map", [("linear", "hedgehog"), ("gated_delta", "projection")])
def test_the_naive_form_refuses_to_continue_a_state(cell, feature_map):
    student = make_cell(cell, "hybrid", feature_map)
    query, key, value = (tensor.detach() for tensor in qkv(length=6))
    layer = RecurrentCacheLayer()
    layer.update(key, value)
    student.pending_cache_layer = layer
    student(query, key, value)  # fills the state
    layer.update(key, value)
    student.pending_cache_layer = layer
    with pytest.raises(DoflaError, match="naive form cannot continue from a cache state"):
        student(query, key, value, form="naive")


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_short_conv_starts_as_the_identity_and_mixes_only_earlier_tokens(kind):
    """The gated delta cell's short convolution: at its initial (identity) weights the cell gives exactly
    what it gives without one; trained weights make an output depend on the W - 1 tokens before it only
    through the memory's inputs, never on later tokens; a left-padded row equals the row alone."""
    sinks = 2 if kind == "hybrid" else 0
    plain = make_cell("gated_delta", kind, "projection", sinks=sinks)
    convolved = make_cell("gated_delta", kind, "projection", sinks=sinks, short_conv=3)
    with torch.no_grad():
        convolved.conv_weight.zero_()[-1] = 1.0
    convolved.load_state_dict({**plain.state_dict(), "conv_weight": convolved.conv_weight}, strict=True)
    query, key, value = (tensor.detach() for tensor in qkv(length=9))
    for form in ("naive", "chunked", "recurrent"):
        torch.testing.assert_close(
            convolved(query, key, value, form=form), plain(query, key, value, form=form), rtol=0, atol=0
        )
    with torch.no_grad():
        convolved.conv_weight.add_(0.5 * torch.randn_like(convolved.conv_weight))
    changed = value.clone()
    changed[:, :, 6] += 1.0
    before, after = convolved(query, key, value), convolved(query, key, changed)
    torch.testing.assert_close(after[:, :6], before[:, :6], rtol=0, atol=0)  # causal
    assert (after[:, 6:] - before[:, 6:]).abs().amax() > 1e-3
    pad = 3
    real = torch.ones(B, 9, dtype=torch.bool)
    real[0, :pad] = False
    mask = (torch.ones(9, 9, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]  # (B, 1, T, T)
    for form in ("naive", "chunked", "recurrent"):
        padded = convolved(query, key, value, mask, form=form)
        alone = convolved(query[:1, :, pad:], key[:1, :, pad:], value[:1, :, pad:], form=form)
        torch.testing.assert_close(padded[:1, pad:], alone, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_output_gate_starts_at_one_and_then_scales_each_tokens_read_out_by_its_own_value(kind):
    """The gated delta cell's output gate: at its initial (zero) weights the cell gives exactly what it gives
    without one; trained, the read-out of token t is the plain cell's memory read-out times
    2 sigmoid(v_t W / sqrt(Dv) + b), brute force per query head and token."""
    sinks = 2 if kind == "hybrid" else 0
    plain = make_cell("gated_delta", kind, "projection", sinks=sinks)
    gated = make_cell("gated_delta", kind, "projection", sinks=sinks, output_gate=True)
    with torch.no_grad():  # the initial gate (make_cell perturbs every parameter)
        gated.output_gate_weight.zero_()
        gated.output_gate_bias.zero_()
    gated.load_state_dict(
        {**plain.state_dict(), **{k: v for k, v in gated.state_dict().items() if "output_gate" in k}}
    )
    query, key, value = (tensor.detach() for tensor in qkv(length=9))
    for form in ("naive", "chunked", "recurrent"):
        torch.testing.assert_close(
            gated(query, key, value, form=form), plain(query, key, value, form=form), rtol=0, atol=0
        )
    with torch.no_grad():
        gated.output_gate_weight.normal_()
        gated.output_gate_bias.normal_()
    q_features, k_features, _ = plain.features(query, key)
    values = plain.state_heads_view(value)
    inputs = AttendInputs(query, key, q_features, k_features, values, None, None, plain.scaling)
    memory = plain.parts("naive", inputs)
    expected = memory["memory"].clone()  # (B, H, T, Dv)
    group = H // plain.state_heads
    for head in range(H):
        kv_head, g = divmod(head, group)
        for t in range(9):
            logits = values[:, kv_head, t] @ gated.output_gate_weight[kv_head, g] / D**0.5
            expected[:, head, t] *= 2 * torch.sigmoid(logits + gated.output_gate_bias[head])
    got = gated.parts("naive", inputs)
    torch.testing.assert_close(got["memory"], expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(DoflaError, match="output_gate"):
        make_cell("gated_delta", kind, "projection", sinks=sinks, output_gate="yes")


@pytest.mark.parametrize("block", [7, 256])
def test_the_short_convolutions_blocked_and_autograd_paths_equal_the_plain_sum(block, monkeypatch):
    """causal_depthwise_conv: without autograd (block by block, into strided slices of a batch of 2) and with
    it (in place over all tokens) bit for bit the same, equal to the literal sum, and its gradients those
    of the literal sum."""
    from dofla.ops.delta import short_conv as delta

    monkeypatch.setattr(delta, "CONV_BLOCK", block)
    generator = torch.Generator().manual_seed(0)
    width, length = 8, 600
    inputs = torch.randn(2, width - 1 + length, 5, dtype=torch.float64, generator=generator)
    weight = torch.randn(width, 5, dtype=torch.float64, generator=generator)
    reference = sum(weight[i] * inputs[:, i : i + length] for i in range(width))
    with torch.no_grad():
        blocked = delta.causal_depthwise_conv(inputs, weight, length)
    leaves = inputs.clone().requires_grad_(), weight.clone().requires_grad_()
    tracked = delta.causal_depthwise_conv(*leaves, length)
    assert torch.equal(blocked, tracked.detach())
    torch.testing.assert_close(blocked, reference, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
    got = torch.autograd.grad(tracked, leaves, upstream)
    reference_leaves = inputs.clone().requires_grad_(), weight.clone().requires_grad_()
    literal = sum(reference_leaves[1][i] * reference_leaves[0][:, i : i + length] for i in range(width))
    expected = torch.autograd.grad(literal, reference_leaves, upstream)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_short_convolutions_state_after_a_prefill_holds_only_its_last_tokens():
    """The tail a prefill leaves in the cache is W - 1 tokens in its own storage, not a view keeping the
    prefill's whole input buffer alive."""
    student = make_cell("gated_delta", "linear", "projection", short_conv=4)
    query, key, value = (tensor.detach() for tensor in qkv(length=13))
    layer = RecurrentCacheLayer()
    layer.update(key, value)
    student.pending_cache_layer = layer
    with torch.no_grad():
        student(query, key, value)
    tail = layer.state.tail
    assert tail.shape[1] == 3 and tail.untyped_storage().nbytes() == tail.numel() * tail.element_size()


@pytest.mark.parametrize("width", [1, -2, 2.5, True])
def test_short_conv_refuses_a_width_that_is_not_a_whole_number_of_at_least_two(width):
    with pytest.raises(DoflaError, match="short_conv"):
        make_cell("gated_delta", "linear", "projection", short_conv=width)


@pytest.mark.parametrize("options", [{}, {"short_conv": 4}])
def test_projection_keys_wider_than_the_head_all_learn_in_the_delta_cell(options):
    """With more features than the head has coordinates, the projection map starts as the teacher's q and k
    in its first D features, and every feature of every head gets a gradient (columns beyond D that started
    at 0 would stay 0: a feature that is 0 in every key and query gets none in the delta rule)."""
    plan = LayerPlan(
        kind="linear", cell="gated_delta", feature_map="projection", feature_dim=2 * D, options=options
    )
    torch.manual_seed(0)
    student = build_student(plan, **SHAPE).double()
    query, key, value = qkv()
    features, _ = student.feature_map(key, is_query=False)
    torch.testing.assert_close(features[..., :D], key, rtol=0, atol=0)
    assert features[..., D:].abs().amin() > 0
    student(query, key, value).square().sum().backward()
    gradient = student.feature_map.weight.grad  # (Hm, D, F)
    assert (gradient.abs().sum(dim=1) > 0).all()


def test_gated_delta_model_with_short_conv_saves_reloads_and_generates_as_one_pass(tmp_path):
    """A converted model whose gated delta layers have a trained short convolution: reloads bit for bit,
    and greedy generation (prefill, then one-token decoding steps) gives the tokens one full pass ranks first."""
    model = build_tiny_model("llama", seed=0)
    convert(
        model,
        plan_for(
            model,
            kind="linear",
            cell="gated_delta",
            feature_map="projection",
            feature_dim=8,
            options={"short_conv": 4, "output_gate": True},
        ),
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "conv_weight" in name or "output_gate" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))  # no pad token (0)
    expected = model(tokens).logits
    save_converted(model, tmp_path / "out", extra_metadata={"teacher": "tiny"})
    loaded, _, plan = load_converted(tmp_path / "out")
    assert {layer.options["short_conv"] for layer in plan.layers} == {4}
    torch.testing.assert_close(loaded(tokens).logits, expected, rtol=0, atol=0)
    generated = loaded.generate(tokens[:1, :6], max_new_tokens=5, do_sample=False)
    logits = loaded(generated[:, :-1]).logits[0, 5:]
    assert torch.equal(generated[0, 6:], logits.argmax(-1))
