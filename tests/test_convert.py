"""In-place conversion: students on the planned layers only, teacher weights by reference, bad plans refused
before any change, unconvert, teacher forcing, training gradients, per-query-head maps."""

from __future__ import annotations

import pytest
import torch
from test_generate import VOCAB, decode_logits, tiny_model
from transformers import DynamicCache

from dofla import dispatch
from dofla.attention import LinearAttention
from dofla.config import ConversionPlan, LayerPlan
from dofla.convert import convert, plan_for, unconvert
from dofla.errors import DoflaError
from dofla.models.surgery import architecture, students


def tokens(batch=2, length=12, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_convert_attaches_students_on_planned_layers_only():
    model = tiny_model("llama")
    teacher_parameters = {name: parameter for name, parameter in model.named_parameters()}
    plan = plan_for(model, kind="hybrid", feature_map="learnable_prf", feature_dim=6, layers=[1], window=3)
    assert convert(model, plan) is model and model.dofla_plan is plan
    facts = architecture(model)
    assert not hasattr(facts.attention_modules[0], "dofla_student")
    student = facts.attention_modules[1].dofla_student
    assert isinstance(student, LinearAttention) and students(model) == {1: student}
    assert student.kind == "hybrid" and student.window == 3 and student.feature_map.feature_dim == 6
    assert model.config._attn_implementation == "dofla_sdpa"
    # teacher weights are the same tensors (by reference); only the student's parameters are new
    named = dict(model.named_parameters())
    assert all(named[name] is parameter for name, parameter in teacher_parameters.items())
    new = sorted(set(named) - set(teacher_parameters))
    assert new == [
        "model.layers.1.self_attn.dofla_student.feature_map.log_alpha",
        "model.layers.1.self_attn.dofla_student.feature_map.z",
        "model.layers.1.self_attn.dofla_student.window_factor_logit",
    ]


def test_eager_teacher_keeps_eager_dispatcher():
    model = tiny_model("gemma2")
    model.set_attn_implementation("eager")  # Gemma-2's soft-capping needs it
    convert(model, plan_for(model, feature_dim=4))
    assert model.config._attn_implementation == "dofla_eager"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda plan: setattr(plan, "num_heads", 8), "heads is 8 in the plan but 4"),
        (lambda plan: setattr(plan, "num_kv_heads", 4), "key/value heads is 4 in the plan but 2"),
        (lambda plan: setattr(plan, "model_type", "qwen2"), "model type is qwen2"),
        (lambda plan: setattr(plan, "head_dim", 32), "head size is 32"),
        (lambda plan: plan.layers.append(LayerPlan()), "lists 3 layers"),
        (lambda plan: setattr(plan.layers[1], "feature_dim", 0), "feature dimension must be positive"),
        (lambda plan: setattr(plan.layers[0], "head_feature_dims", [2, 3, 4]), "3 head feature dimensions"),
        (lambda plan: setattr(plan.layers[1], "feature_map", "nope"), "unknown feature map 'nope'"),
        (lambda plan: setattr(plan.layers[1], "options", {"colour": 1}), "no option colour"),
    ],
)
def test_bad_plans_are_refused_before_any_change(change, message):
    model = tiny_model("llama")
    before = model(tokens()).logits
    plan = plan_for(model, feature_dim=4)
    change(plan)
    with pytest.raises(DoflaError, match=message):
        convert(model, plan)
    assert not any(name.endswith("dofla_student") for name, _ in model.named_modules())
    assert getattr(model, "dofla_plan", None) is None and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(tokens()).logits, before)


def test_plan_for_refuses_missing_layers_and_plans_are_refused_by_other_models():
    model = tiny_model("llama")
    with pytest.raises(DoflaError, match="layer 5 does not exist: the model has layers 0..1"):
        plan_for(model, layers=[0, 5])
    with pytest.raises(DoflaError, match="different model"):
        convert(tiny_model("gpt2"), plan_for(model))
    convert(model, plan_for(model))
    with pytest.raises(DoflaError, match="already converted"):
        convert(model, plan_for(model))


def test_plan_survives_json_round_trip_and_converts(tmp_path):
    model = tiny_model("qwen2")
    plan = plan_for(model, kind="linear", feature_map="t2r", feature_dim=5, share_kv_heads=False)
    plan.layers[0] = LayerPlan(
        kind="linear", feature_map="learnable_prf", feature_dim=6, head_feature_dims=[6, 2]
    )
    plan.save(tmp_path / "plan.json")
    loaded = ConversionPlan.load(tmp_path / "plan.json")
    convert(model, loaded)
    first, second = students(model)[0], students(model)[1]
    assert first.feature_map.head_feature_dims == [6, 2] and first.state_heads == 2
    assert second.state_heads == 4 and not second.share_kv_heads  # one map and state per query head
    torch.testing.assert_close(
        decode_logits(model, tokens(), 7), model(tokens()).logits, rtol=1e-4, atol=1e-4
    )


def test_unconvert_and_teacher_forcing_give_the_teacher_back():
    model = tiny_model("gpt_neox")
    teacher = model(tokens()).logits
    convert(model, plan_for(model, feature_dim=4))
    assert (model(tokens()).logits - teacher).abs().max() > 1e-3
    with dispatch.teacher_forced():
        torch.testing.assert_close(model(tokens()).logits, teacher, rtol=1e-5, atol=1e-5)
        cache = DynamicCache(config=model.config)  # teacher-forced decoding keeps ordinary softmax caches
        model(tokens()[:, :8], past_key_values=cache)
        step = model(tokens()[:, 8:9], past_key_values=cache).logits
        torch.testing.assert_close(step, teacher[:, 8:9], rtol=1e-5, atol=1e-5)
    unconvert(model)
    assert not students(model) and model.dofla_plan is None
    torch.testing.assert_close(model(tokens()).logits, teacher, rtol=1e-5, atol=1e-5)
    convert(model, plan_for(model, feature_dim=4))  # and it can be converted again


def test_training_reaches_the_student_parameters():
    model = tiny_model("qwen3")
    convert(model, plan_for(model, kind="hybrid", feature_map="hedgehog", feature_dim=4, window=3))
    batch = tokens()
    loss = model(batch, labels=batch).loss
    loss.backward()
    for student in students(model).values():
        assert all(
            parameter.grad is not None and parameter.grad.abs().sum() > 0
            for parameter in student.trainable_parameters()
        )


def test_attention_error_observer_sees_converted_layers():
    from dofla.evaluation.attention_error import attention_errors

    model = tiny_model("llama")
    convert(model, plan_for(model, feature_dim=8, layers=[1]))
    errors = attention_errors(model, [tokens()])
    assert list(errors) == [1] and 0 < errors[1]["relative_error"] < 10


def test_gemma2_soft_capping_reaches_the_hybrid_students_window():
    # A hybrid layer whose window covers the whole sequence has no linear part: it is the teacher's own
    # (soft-capped) softmax. With a small cap the capping changes the attention a lot, so leaving it out
    # of the student would show.
    model = tiny_model("gemma2")
    model.set_attn_implementation("eager")  # Gemma-2's soft-capping needs it
    model.config.sliding_window = 16  # longer than the sequence: the teacher's sliding layers see it all
    ids = tokens(length=12)
    with torch.no_grad():
        for layer in model.model.layers:  # logits of order 1, where the cap bends them
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.attn_logit_softcapping = 0.3
        teacher = model(ids).logits
    convert(model, plan_for(model, kind="hybrid", feature_dim=4, window=12))
    assert {student.softcap for student in students(model).values()} == {0.3}
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, teacher, atol=1e-4, rtol=1e-4)
        for student in students(model).values():
            student.softcap = None
        uncapped = model(ids).logits
    assert (uncapped - teacher).abs().max() > 1e-2
