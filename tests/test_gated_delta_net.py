"""The gated_delta_net cell (Qwen3.5's gated delta net layer): its ops' four forms against each other and
against transformers' own functions, the cell against transformers' ``Qwen3_5GatedDeltaNet``, its start
from the teacher, decoding, saving."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
)

from dofla.cells import GatedDeltaNet, cell_class
from dofla.cells.gated_delta_net import DEFAULT_GATE_SCALE, DEFAULT_OUTPUT_SCALE
from dofla.config import LayerPlan
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.loading import load_converted
from dofla.models import build_tiny_model
from dofla.models.surgery import students
from dofla.ops.gated_delta_net import (
    GatedDeltaNetInputs,
    GatedDeltaNetShape,
    chunked_gated_delta_net,
    gated_delta_net,
    recurrent_gated_delta_net,
)
from dofla.saving import save_converted

B, T, W = 2, 11, 4


def op_inputs(shape: GatedDeltaNetShape, length: int = T, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64)

    mixed = draw(B, length, shape.channels).requires_grad_()
    conv_weight = draw(shape.channels, W).requires_grad_()
    log_decay = (
        -torch.rand(B, length, shape.num_v_heads, generator=generator, dtype=torch.float64)
    ).requires_grad_()
    beta = torch.rand(B, length, shape.num_v_heads, generator=generator, dtype=torch.float64).requires_grad_()
    return mixed, conv_weight, log_decay, beta


SHAPES = [GatedDeltaNetShape(2, 4, 2, 3), GatedDeltaNetShape(2, 4, 4, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_the_ops_forms_agree_forward_and_gradients(shape, masked):
    inputs = op_inputs(shape)
    key_mask = None
    if masked:  # left padding in the first row
        key_mask = torch.ones(B, T, dtype=torch.bool)
        key_mask[0, :3] = False
    forms = {
        "naive": lambda: gated_delta_net(GatedDeltaNetInputs(*inputs, key_mask), shape),
        "chunked": lambda: chunked_gated_delta_net(
            GatedDeltaNetInputs(*inputs, key_mask), shape, chunk_size=4
        )[0],
        "recurrent": lambda: recurrent_gated_delta_net(GatedDeltaNetInputs(*inputs, key_mask), shape)[0],
    }
    results = {}
    for name, form in forms.items():
        output = form()
        weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
        results[name] = (output.detach(), torch.autograd.grad((output * weights).sum(), inputs))
    reference, reference_gradients = results["naive"]
    assert reference.shape == (B, T, shape.num_v_heads, shape.head_v_dim)
    for name in ("chunked", "recurrent"):
        output, gradients = results[name]
        torch.testing.assert_close(output, reference, rtol=1e-9, atol=1e-10)
        for got, expected in zip(gradients, reference_gradients, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)
    assert all(gradient.abs().sum() > 0 for gradient in reference_gradients)


@pytest.mark.parametrize("split", [1, 3, 7])
def test_a_state_continues_across_forms_as_one_pass(split):
    shape = SHAPES[1]
    mixed, conv_weight, log_decay, beta = (tensor.detach() for tensor in op_inputs(shape))
    whole, whole_state = chunked_gated_delta_net(
        GatedDeltaNetInputs(mixed, conv_weight, log_decay, beta), shape, chunk_size=4
    )

    def piece(part: slice) -> GatedDeltaNetInputs:
        return GatedDeltaNetInputs(mixed[:, part], conv_weight, log_decay[:, part], beta[:, part])

    first, state = chunked_gated_delta_net(piece(slice(0, split)), shape)
    second, state = recurrent_gated_delta_net(piece(slice(split, T)), shape, state=state)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.memory.kv, whole_state.memory.kv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.conv, whole_state.conv)
    assert state.num_tokens == T and state.conv.shape == (B, W - 1, shape.channels)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_op_is_transformers_convolution_and_gated_delta_rule(shape):
    mixed, conv_weight, log_decay, beta = (tensor.detach().float() for tensor in op_inputs(shape))
    ours = gated_delta_net(GatedDeltaNetInputs(mixed, conv_weight, log_decay, beta), shape)
    convolved = causal_conv1d_fn(mixed.transpose(1, 2), conv_weight, None, activation="silu").transpose(1, 2)
    width = shape.num_k_heads * shape.head_k_dim
    query, key, value = convolved.split([width, width, shape.num_v_heads * shape.head_v_dim], -1)
    theirs, _ = torch_chunk_gated_delta_rule(
        query.unflatten(-1, (shape.num_k_heads, -1)),
        key.unflatten(-1, (shape.num_k_heads, -1)),
        value.unflatten(-1, (shape.num_v_heads, -1)),
        g=log_decay,
        beta=beta,
        chunk_size=4,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the cell


def converted_tiny(family="llama", seed=0, **overrides):
    model = build_tiny_model(family, seed=seed, **overrides)
    convert(model, plan_for(model, kind="linear", cell="gated_delta_net", feature_dim=16))
    return model


def disturbed(cell: GatedDeltaNet, scale: float = 0.3) -> GatedDeltaNet:
    """The cell with every parameter moved at random, so that gates and taps really vary."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in cell.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return cell


def test_the_cell_forms_agree_forward_and_gradients():
    cell = disturbed(students(converted_tiny())[0].double())
    hidden = torch.randn(B, T, cell.hidden_size, dtype=torch.float64, requires_grad=True)
    query = torch.zeros(B, cell.num_heads, T, cell.head_dim, dtype=torch.float64)
    key = value = torch.zeros(B, cell.num_kv_heads, T, cell.head_dim, dtype=torch.float64)
    results = {}
    for form in ("naive", "chunked", "recurrent"):
        cell.pending_hidden_states = hidden
        output = cell(query, key, value, form=form)  # (B, T, H, D)
        weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
        inputs = [hidden, *cell.parameters()]
        results[form] = (output.detach(), torch.autograd.grad((output * weights).sum(), inputs))
    reference, reference_gradients = results["naive"]
    assert reference.shape == (B, T, cell.num_heads, cell.head_dim)
    for form in ("chunked", "recurrent"):
        output, gradients = results[form]
        torch.testing.assert_close(output, reference, rtol=1e-9, atol=1e-10)
        for got, expected in zip(gradients, reference_gradients, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)
    assert all(gradient.abs().sum() > 0 for gradient in reference_gradients)  # every parameter learns


def test_the_cell_is_transformers_qwen3_5_gated_delta_net():
    model = converted_tiny()
    attention = model.model.layers[0].self_attn
    cell = disturbed(attention.dofla_student)
    config = Qwen3_5TextConfig(
        hidden_size=cell.hidden_size,
        linear_num_key_heads=cell.num_heads,
        linear_num_value_heads=cell.num_heads,
        linear_key_head_dim=cell.head_dim,
        linear_value_head_dim=cell.head_dim,
        linear_conv_kernel_dim=W,
        rms_norm_eps=model.config.rms_norm_eps,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = Qwen3_5GatedDeltaNet(config, 0).eval()
    missing, unexpected = theirs.load_state_dict(cell.state_dict(), strict=False)
    assert missing == ["out_proj.weight"] and unexpected == []
    theirs.out_proj.weight.data.copy_(attention.o_proj.weight)
    hidden = torch.randn(B, T, cell.hidden_size)
    cell.pending_hidden_states = hidden
    shape_only = torch.zeros(B, cell.num_heads, T, cell.head_dim)
    ours = attention.o_proj(cell(shape_only, shape_only, shape_only).flatten(2))
    with torch.no_grad():
        torch.testing.assert_close(ours, theirs(hidden), rtol=1e-5, atol=1e-6)


def test_the_cell_starts_from_the_teachers_projections_and_configured_memories():
    model = build_tiny_model("llama")
    attention = model.model.layers[1].self_attn
    convert(model, plan_for(model, kind="linear", cell="gated_delta_net", options={"decay_memory": (4, 64)}))
    cell = attention.dofla_student
    heads, kv_heads, size = cell.num_heads, cell.num_kv_heads, cell.head_dim
    query, key, value = cell.in_proj_qkv.weight.split(heads * size)
    torch.testing.assert_close(query, attention.q_proj.weight)
    for head in range(heads):  # each query head reads its key/value group's key and value
        group = head // (heads // kv_heads)
        teacher_rows = slice(group * size, (group + 1) * size)
        rows = slice(head * size, (head + 1) * size)
        torch.testing.assert_close(key[rows], attention.k_proj.weight[teacher_rows])
        torch.testing.assert_close(value[rows], attention.v_proj.weight[teacher_rows])
        gate = DEFAULT_GATE_SCALE
        torch.testing.assert_close(cell.in_proj_z.weight[rows], gate * attention.v_proj.weight[teacher_rows])
    torch.testing.assert_close(
        cell.norm.weight, torch.full_like(cell.norm.weight, DEFAULT_OUTPUT_SCALE / DEFAULT_GATE_SCALE)
    )
    decay = torch.exp(-cell.A_log.exp() * torch.nn.functional.softplus(cell.dt_bias))  # a zero `a` projection
    torch.testing.assert_close(1 / (1 - decay[[0, -1]]), torch.tensor([4.0, 64.0]), rtol=1e-4, atol=0)
    assert cell.in_proj_a.weight.abs().sum() == 0 and cell.in_proj_b.weight.abs().sum() == 0  # beta 1/2
    taps = cell.conv1d.weight[:, 0]
    assert (taps[:, :-1] == 0).all() and (taps[:, -1] == taps[0, -1]).all() and taps[0, -1] > 0


def test_prefill_then_decode_equals_one_pass_and_a_saved_model_reloads(tmp_path):
    model = converted_tiny("qwen2")
    for cell in students(model).values():
        disturbed(cell, 0.1)
    ids = torch.randint(3, 100, (B, 13))
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        out = model(ids[:, :8], use_cache=True)
        pieces = [out.logits]
        for t in range(8, 13):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-4, atol=1e-5)
    save_converted(model, tmp_path / "student")
    reloaded, _, _ = load_converted(tmp_path / "student")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, use_cache=False).logits, whole)
        generated = reloaded.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (B, 9)


def test_the_cell_refuses_a_window_projections_it_cannot_copy_and_a_call_without_hidden_states():
    with pytest.raises(DoflaError, match="has no window: use kind linear"):
        cell_class("gated_delta_net")(
            LayerPlan(kind="hybrid", cell="gated_delta_net"),
            hidden_size=8,
            layer_index=0,
            num_heads=2,
            num_kv_heads=2,
            head_dim=4,
            scaling=0.5,
        )
    gpt2 = build_tiny_model("gpt2")
    with pytest.raises(DoflaError, match="GPT2Attention has no such separate projections"):
        convert(gpt2, plan_for(gpt2, kind="linear", cell="gated_delta_net"))
    cell = students(converted_tiny())[0]
    query = torch.zeros(1, cell.num_heads, 3, cell.head_dim)
    with pytest.raises(DoflaError, match="reads the hidden states entering its attention module"):
        cell(query, query[:, :2], query[:, :2])


def test_the_projections_copied_from_the_teacher_train_at_their_own_multiple_of_the_rate():
    default = students(converted_tiny())[0]
    rates = {group["name"]: group["lr"] for group in default.parameter_groups(1e-2)}
    assert rates == {"projections": pytest.approx(1e-2), "gates": pytest.approx(1e-2)}  # default 1
    model = build_tiny_model("llama")
    convert(model, plan_for(model, kind="linear", cell="gated_delta_net", options={"projection_lr": 0.1}))
    rates = {group["name"]: group["lr"] for group in students(model)[0].parameter_groups(1e-2)}
    assert rates == {"projections": pytest.approx(1e-3), "gates": pytest.approx(1e-2)}
    fresh = build_tiny_model("llama")
    with pytest.raises(DoflaError, match="projection_lr must be positive, got 0.0"):
        convert(fresh, plan_for(fresh, kind="linear", cell="gated_delta_net", options={"projection_lr": 0}))
