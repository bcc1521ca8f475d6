"""Distillation losses: chunked log-space kernel losses against plain full-matrix references (value and
gradients), their agreement with the attention the student really computes, and the simple losses."""

from __future__ import annotations

import pytest
import torch

from dofla.distill import losses
from dofla.distill.losses import direct_loss, kernel_loss, output_mse_loss
from dofla.errors import DoflaError
from dofla.ops import HybridInputs, HybridOptions, LinearInputs, hybrid_attention, linear_attention

B, H, HKV, T, D, F_DIM = 2, 4, 2, 11, 8, 6
SCALING = D**-0.5


def inputs(seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, positive=False):
        tensor = torch.randn(*shape, generator=generator, dtype=dtype)
        return (tensor.exp() if positive else tensor).requires_grad_(True)

    return dict(
        query=draw(B, H, T, D),
        key=draw(B, HKV, T, D),
        q_features=draw(B, H, T, F_DIM, positive=True),
        k_features=draw(B, HKV, T, F_DIM, positive=True),
        k_log_scale=draw(B, HKV, T),
    )


def capped(scores, softcap):
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def student_weights(tensors, window=None, gamma=None, softcap=None):
    """Row-normalised student weights A (B, H, T, T), written out pair by pair as in ops.naive."""
    group = H // HKV
    q = tensors["q_features"]
    k = tensors["k_features"].repeat_interleave(group, 1)
    scale = tensors["k_log_scale"].repeat_interleave(group, 1)
    keys = tensors["key"].repeat_interleave(group, 1)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    causal = j <= i
    linear = (q @ k.transpose(-1, -2)) * torch.exp(scale)[:, :, None, :]  # (B, H, T, T)
    if window is None:
        weights = torch.where(causal, linear, 0.0)
    else:
        in_window = causal & (j > i - window)
        left = j <= i - window
        scores = capped(SCALING * tensors["query"] @ keys.transpose(-1, -2), softcap)
        window_max = scores.masked_fill(~in_window, float("-inf")).amax(-1, keepdim=True)
        old_max = scale[:, :, None, :].masked_fill(~left, float("-inf")).amax(-1, keepdim=True)
        old_max = torch.where(torch.isfinite(old_max), old_max, 0.0)
        g = gamma.view(1, H, 1, 1)
        weights = torch.where(in_window, g * torch.exp(scores - window_max), 0.0) + torch.where(
            left, (1 - g) * linear * torch.exp(-old_max), 0.0
        )
    return weights / weights.sum(-1, keepdim=True)


def teacher_probabilities(tensors, softcap=None):
    keys = tensors["key"].repeat_interleave(H // HKV, 1)
    scores = capped(SCALING * tensors["query"] @ keys.transpose(-1, -2), softcap)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)


def reference_loss(kind, tensors, window=None, gamma=None, softcap=None):
    teacher = teacher_probabilities(tensors, softcap)
    student = student_weights(tensors, window, gamma, softcap)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if kind == "softmax":
        rows = -(teacher * torch.where(causal, student.clamp_min(1e-300).log(), 0.0)).sum(-1)
    else:
        rows = ((teacher - student) ** 2).sum(-1)
    return rows.mean()


@pytest.mark.parametrize("kind", ["softmax", "l2"])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize(
    "query_chunk, recompute, softcap", [(3, False, None), (3, True, None), (64, False, None), (3, False, 0.8)]
)
def test_chunked_kernel_loss_matches_full_matrix_reference(
    kind, hybrid, query_chunk, recompute, softcap, monkeypatch
):
    if recompute:  # chunks recomputed in the backward pass (activation checkpointing), as for long T
        monkeypatch.setattr(losses, "CHECKPOINT_ELEMENTS", 0)
    tensors = inputs()
    gamma = torch.sigmoid(torch.randn(H, dtype=torch.float64)).requires_grad_(True)
    window = 4 if hybrid else None
    options = dict(window=window, window_factor=gamma if hybrid else None, softcap=softcap)
    loss = kernel_loss(kind, **tensors, scaling=SCALING, query_chunk=query_chunk, **options)
    expected = reference_loss(kind, tensors, window, gamma if hybrid else None, softcap)
    if softcap is not None:  # the cap changes the loss: the test would notice it being ignored
        assert (loss - reference_loss(kind, tensors, window, gamma if hybrid else None)).abs() > 1e-3
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    leaves = [*tensors.values(), gamma] if hybrid else list(tensors.values())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, leaves, allow_unused=True)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("hybrid", [False, True])
def test_compared_kernel_is_the_one_the_attention_uses(hybrid):
    """A @ v of the loss's student weights equals the naive attention output (up to eps)."""
    tensors = inputs(seed=1)
    values = torch.randn(B, HKV, T, 5, dtype=torch.float64)
    gamma = torch.full((H,), 0.3, dtype=torch.float64)
    weights = student_weights(tensors, 4 if hybrid else None, gamma if hybrid else None)
    features = (tensors["q_features"], tensors["k_features"], values)
    if hybrid:
        out = hybrid_attention(
            HybridInputs(tensors["query"], tensors["key"], *features, gamma, tensors["k_log_scale"]),
            HybridOptions(scaling=SCALING, window=4, eps=1e-12),
        )
    else:
        out = linear_attention(LinearInputs(*features, tensors["k_log_scale"]), eps=1e-12)
    torch.testing.assert_close(
        weights @ values.repeat_interleave(H // HKV, 1), out.detach(), rtol=1e-8, atol=1e-9
    )


def test_exact_student_gives_zero_l2_and_teacher_entropy():
    """A hybrid whose window covers the whole sequence with gamma -> 1 is the teacher itself."""
    tensors = inputs(seed=2)
    gamma = torch.full((H,), 1 - 1e-12, dtype=torch.float64)
    options = dict(scaling=SCALING, window=T, window_factor=gamma)
    l2 = kernel_loss("l2", **tensors, **options)
    cross_entropy = kernel_loss("softmax", **tensors, **options)
    teacher = teacher_probabilities(tensors)
    entropy = -(teacher * teacher.clamp_min(1e-300).log()).sum(-1).mean()
    assert float(l2.detach()) < 1e-20
    torch.testing.assert_close(cross_entropy, entropy, rtol=1e-9, atol=1e-9)
    # and a worse student has a larger cross-entropy than the teacher's entropy
    assert float(kernel_loss("softmax", **tensors, scaling=SCALING).detach()) > float(entropy.detach()) + 1e-3


def test_padded_keys_and_rows_are_left_out():
    """Left padding: the loss equals the loss of the unpadded sequences, with finite gradients."""
    tensors = inputs(seed=3)
    pad = 3
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[1, :pad] = False
    loss = kernel_loss("softmax", **tensors, scaling=SCALING, key_mask=key_mask, query_chunk=4)
    grads = torch.autograd.grad(loss, list(tensors.values()))
    assert all(torch.isfinite(grad).all() for grad in grads)
    # reference: each sequence alone, rows averaged over all real rows
    first = kernel_loss("softmax", **{n: t[:1] for n, t in tensors.items()}, scaling=SCALING)
    second = kernel_loss("softmax", **{n: t[1:, :, pad:] for n, t in tensors.items()}, scaling=SCALING)
    expected = (first * T + second * (T - pad)) / (2 * T - pad)
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)


def test_long_sequence_fits_in_chunks(monkeypatch):
    """T = 2048 in float32: the chunked loss runs forward and backward, chunks recomputed in the backward."""
    monkeypatch.setattr(losses, "CHECKPOINT_ELEMENTS", 0)
    length, heads = 2048, 1
    query = torch.randn(1, heads, length, 16, requires_grad=True)
    key = torch.randn(1, heads, length, 16)
    q_features = torch.rand(1, heads, length, 8) + 0.1
    k_features = torch.rand(1, heads, length, 8, requires_grad=True)
    loss = kernel_loss("softmax", query, key, q_features, k_features, None, scaling=0.25, query_chunk=256)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(k_features.grad).all()


def test_kernel_loss_rejects_unknown_and_non_kernel_kinds():
    with pytest.raises(
        DoflaError,
        match="unknown loss 'kl'; choose one of: direct, l2, output_mse, projected_mse, softmax, split_mse",
    ):
        kernel_loss("kl", **inputs(), scaling=SCALING)
    with pytest.raises(DoflaError, match="'output_mse' is not a kernel loss; kernel losses are softmax, l2"):
        kernel_loss("output_mse", **inputs(), scaling=SCALING)


def test_output_mse_and_direct_losses():
    student = torch.randn(2, 5, 3, 4)
    teacher = torch.randn(2, 5, 3, 4)
    torch.testing.assert_close(output_mse_loss(student, teacher), ((student - teacher) ** 2).mean())
    mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    masked = ((student - teacher) ** 2)[mask].mean()
    torch.testing.assert_close(output_mse_loss(student, teacher, mask), masked)

    logits = torch.randn(2, 6, 10)
    labels = torch.randint(0, 10, (2, 6))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 10), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(direct_loss(logits, labels), expected)
    # KL to itself is 0; to another distribution it adds weight * KL
    torch.testing.assert_close(direct_loss(logits, labels, logits, kl_weight=1.0), expected)
    other = torch.randn(2, 6, 10)
    p = torch.log_softmax(other[:, :-1], -1)
    q = torch.log_softmax(logits[:, :-1], -1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    torch.testing.assert_close(direct_loss(logits, labels, other, kl_weight=0.5), expected + 0.5 * kl)


def _hybrid_delta_call(length=12, window=3, sinks=2, mix="fixed", seed=0):
    """A hybrid gated_delta layer (4 query, 2 key/value heads, head size 8) and a teacher-forced call of
    random q, k, v whose output is the teacher's causal softmax."""
    from dofla.cells import build_student
    from dofla.config import LayerPlan
    from dofla.dispatch import AttentionCall

    plan = LayerPlan(
        kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=6, window=window,
        sinks=sinks, options={"mix": mix},
    )  # fmt: skip
    torch.manual_seed(seed)
    student = build_student(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = student.double()
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(seed + 1)
    query, key, value = (
        torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2)
    )
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=True, scale=8**-0.5
    ).transpose(1, 2)  # (B, T, H, D)
    call = AttentionCall(
        module=None, layer_index=0, query=query, key=key, value=value, attention_mask=None,
        scaling=8**-0.5, output=output,
    )  # fmt: skip
    return student, call


@pytest.mark.parametrize("mix", ["fixed", "adaptive"])
def test_split_mse_is_the_output_error_plus_its_mix_and_memory_halves_brute_force(mix):
    """The teacher's output splits into its window-and-sinks part and the rest by its own attention mass on
    the window; the loss adds the student's mix error and memory error against that split."""
    window, sinks, length = 3, 2, 12
    student, call = _hybrid_delta_call(length, window, sinks, mix)
    scores = (call.query @ call.key.repeat_interleave(2, 1).transpose(-1, -2)) * call.scaling
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    probabilities = torch.softmax(scores.masked_fill(j > i, float("-inf")), dim=-1)  # (B, H, T, T)
    near = (j <= i) & ((j > i - window) | (j < sinks))
    share = (probabilities * near).sum(-1)  # (B, H, T)
    far = (
        (probabilities * ~near) @ call.value.repeat_interleave(2, 1) / (1 - share).clamp_min(1e-30)[..., None]
    )
    parts = student.window_memory_parts(call.query, call.key, call.value, scaling=call.scaling)
    window_out, memory, gamma = (parts[name].detach() for name in ("window", "memory", "gamma"))
    share, far = share.transpose(1, 2)[..., None], far.transpose(1, 2)  # (B, T, H, 1), (B, T, H, D)
    torch.testing.assert_close(share * window_out + (1 - share) * far, call.output)  # the split is exact
    output = student(call.query, call.key, call.value, scaling=call.scaling)
    torch.testing.assert_close(output, gamma * window_out + (1 - gamma) * memory)
    expected = (
        (output - call.output).pow(2).mean()
        + ((gamma - share) * (window_out - memory)).pow(2).mean()
        + ((1 - share) * (memory - far)).pow(2).mean()
    )
    loss = losses.layer_loss("split_mse", student, call, query_chunk=5)
    torch.testing.assert_close(loss, expected.float(), rtol=1e-5, atol=1e-9)  # output_mse sums in float32
    loss.backward()
    trained = {name for name, parameter in student.named_parameters() if parameter.grad is not None}
    assert {"window_factor_logit", "decay.bias", "write.bias", "feature_map.weight"} <= trained
    if mix == "adaptive":
        assert {"mix_lse_weight", "mix_value_weight"} <= trained


@pytest.mark.parametrize("projection", ["o_proj", "c_proj"])
def test_projected_mse_is_the_output_error_after_the_output_projection_brute_force(projection):
    """Llama's nn.Linear and GPT-2's transposed Conv1D: the mean square of W (student - teacher) per hidden
    element, the bias gone; padded positions left out; the gradient reaches the student."""
    from dataclasses import replace

    from transformers.pytorch_utils import Conv1D

    student, call = _hybrid_delta_call()
    hidden = 5
    module = torch.nn.Module()
    if projection == "o_proj":
        module.o_proj = torch.nn.Linear(4 * 8, hidden).double()
        weight = module.o_proj.weight  # (hidden, H * Dv)
    else:
        module.c_proj = Conv1D(hidden, 4 * 8).double()
        weight = module.c_proj.weight.T  # Conv1D keeps (H * Dv, hidden)
    torch.nn.init.normal_(getattr(module, projection).bias)
    module.requires_grad_(False)  # the teacher, frozen as in training
    call = replace(call, module=module)
    output = student(call.query, call.key, call.value, scaling=call.scaling)  # (B, T, H, Dv)
    error = (output - call.output).flatten(2) @ weight.T  # (B, T, hidden)
    loss = losses.layer_loss("projected_mse", student, call)
    torch.testing.assert_close(loss, error.pow(2).mean().float(), rtol=1e-6, atol=1e-12)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1, :4] = False
    masked = losses.projected_mse_layer_loss(student, call, key_mask=key_mask)
    torch.testing.assert_close(masked, error[key_mask].pow(2).mean().float(), rtol=1e-6, atol=1e-12)
    loss.backward()
    assert student.feature_map.weight.grad is not None


def test_projected_mse_names_what_it_needs_where_the_module_has_no_output_projection():
    from dataclasses import replace

    student, call = _hybrid_delta_call()
    with pytest.raises(DoflaError, match="has none of the output projections o_proj, c_proj, dense"):
        losses.layer_loss("projected_mse", student, replace(call, module=torch.nn.Module()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_log_sum_exp_of_the_fused_kernel_equals_the_chunked_form(dtype, monkeypatch):
    query, key = torch.randn(2, 4, 19, 8, dtype=dtype), torch.randn(2, 2, 19, 8, dtype=dtype)
    fused = losses.causal_log_sum_exp(query, key, scaling=0.4)
    monkeypatch.setattr(losses, "takes_fused_lse", lambda *tensors: False)
    chunked = losses.causal_log_sum_exp(query, key, scaling=0.4, query_chunk=5)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, chunked, **tolerance)


def test_causal_log_sum_exp_in_chunks_with_absent_keys():
    query, key = torch.randn(2, 4, 9, 5, dtype=torch.float64), torch.randn(2, 2, 9, 5, dtype=torch.float64)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[1, :3] = False
    scores = 0.7 * (query @ key.repeat_interleave(2, 1).transpose(-1, -2))
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    hidden = (j > i) | ~key_mask[:, None, None, :]
    expected = torch.logsumexp(scores.masked_fill(hidden, float("-inf")), dim=-1)
    got = losses.causal_log_sum_exp(query, key, scaling=0.7, key_mask=key_mask, query_chunk=4)
    torch.testing.assert_close(got, expected)
    assert torch.isneginf(got[1, :, :3]).all() and torch.isfinite(got[0]).all()


def test_split_mse_is_refused_for_layers_without_window_and_memory_halves():
    from dofla.cells import build_student
    from dofla.config import LayerPlan

    _, call = _hybrid_delta_call()
    shape = dict(layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    for plan in (
        LayerPlan(kind="hybrid", cell="gla", feature_dim=6, window=3),
        LayerPlan(kind="linear", cell="gated_delta", feature_map="projection", feature_dim=6),
    ):
        student = build_student(plan, **shape).double()
        with pytest.raises(DoflaError, match="split_mse loss trains the window and the memory"):
            losses.layer_loss("split_mse", student, call)


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_loss_in_pieces_equals_the_loss_of_whole_logits(kl_weight, rows):
    """direct_loss_in_pieces (the head run a few positions at a time, each piece checkpointed) against
    direct_loss on the whole (B, T, V) logits: loss and gradients, with ignored labels and soft-capping."""
    generator = torch.Generator().manual_seed(0)
    head_weight = torch.randn(11, 6, generator=generator)

    def head(states):  # (R, E) -> (R, V), soft-capped like Gemma 2's output
        return 3.0 * torch.tanh(states @ head_weight.T / 3.0)

    hidden = torch.randn(2, 7, 6, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(2, 7, 6, generator=generator)
    labels = torch.randint(0, 11, (2, 7), generator=generator)
    labels[0, 3] = -100
    options = dict(kl_weight=kl_weight, temperature=2.0)
    whole = losses.direct_loss(head(hidden), labels, head(teacher_hidden), **options)
    (whole_gradient,) = torch.autograd.grad(whole, hidden)
    pieces = losses.direct_loss_in_pieces(
        head, hidden, labels, teacher_hidden, rows_per_piece=rows, **options
    )
    (pieces_gradient,) = torch.autograd.grad(pieces, hidden)
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pieces_gradient, whole_gradient, rtol=1e-5, atol=1e-6)
