"""The attention dispatcher: teacher output unchanged, students take over, observers see every call."""

import torch
from helpers import small_llama

from dofla import dispatch


class _ZeroStudent(torch.nn.Module):
    """Returns zeros: an obviously different attention, to see that the student is used."""

    def forward(self, query, key, value, attention_mask=None, *, scaling):
        return torch.zeros_like(query).transpose(1, 2)


def test_install_keeps_teacher_logits_and_is_idempotent():
    model = small_llama()
    tokens = torch.randint(0, 64, (2, 9))
    before = model(tokens).logits
    assert dispatch.install(model) == "dofla_sdpa"
    assert dispatch.install(model) == "dofla_sdpa"
    assert dispatch.is_installed(model)
    torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=1e-6)


def test_eager_teacher_stays_eager():
    model = small_llama()
    model.set_attn_implementation("eager")
    tokens = torch.randint(0, 64, (1, 7))
    before = model(tokens).logits
    assert dispatch.install(model) == "dofla_eager"
    torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=1e-6)


def test_observer_sees_every_layer_with_shapes():
    model = small_llama()
    dispatch.install(model)
    calls = []
    with dispatch.observe(calls.append):
        model(torch.randint(0, 64, (2, 5)))
    assert [call.layer_index for call in calls] == [0, 1]
    call = calls[0]
    assert call.query.shape == (2, 4, 5, 8)
    assert call.key.shape == call.value.shape == (2, 2, 5, 8)
    assert call.output.shape == (2, 5, 4, 8)
    assert abs(call.scaling - 8**-0.5) < 1e-12
    # Observers are removed when the block ends.
    model(torch.randint(0, 64, (2, 5)))
    assert len(calls) == 2


def test_student_replaces_teacher_except_when_teacher_forced():
    model = small_llama()
    tokens = torch.randint(0, 64, (1, 6))
    teacher_logits = model(tokens).logits
    dispatch.install(model)
    model.model.layers[1].self_attn.dofla_student = _ZeroStudent()
    student_logits = model(tokens).logits
    assert not torch.allclose(student_logits, teacher_logits, atol=1e-4)
    with dispatch.teacher_forced():
        forced = model(tokens).logits
    torch.testing.assert_close(forced, teacher_logits, rtol=0, atol=1e-6)


def test_softmax_override_replaces_the_teachers_softmax_only():
    model = small_llama()
    dispatch.install(model)
    seen = []

    def only_itself(module, query, key, value, attention_mask, *, teacher_kind, **kwargs):
        seen.append(teacher_kind)  # each token sees itself alone: the teacher's softmax under an eye mask
        mask = torch.eye(query.shape[2], key.shape[2], dtype=torch.bool).view(1, 1, query.shape[2], -1)
        return dispatch.teacher_attention(
            module, query, key, value, mask, teacher_kind=teacher_kind, **kwargs
        )

    attention = model.model.layers[0].self_attn
    setattr(attention, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE, only_itself)
    calls = []
    with dispatch.observe(calls.append):
        model(torch.randint(0, 64, (2, 5)))
    assert seen == ["sdpa"]
    # softmax over one key returns that key's value: (B, Hkv, T, D) repeated per query head, as (B, T, H, D)
    expected = calls[0].value.repeat_interleave(2, dim=1).transpose(1, 2)
    torch.testing.assert_close(calls[0].output, expected)
    # a student replaces the softmax, and the override is not called
    attention.dofla_student = _ZeroStudent()
    model(torch.randint(0, 64, (2, 5)))
    assert seen == ["sdpa"]
