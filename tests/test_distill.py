"""Teacher-forced layer-wise distillation and the training loop on tiny random models."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import training_config
from transformers import AutoModelForCausalLM, LlamaConfig

import dofla.distill.teacher_forcing as teacher_forcing
from dofla.convert import convert, plan_for
from dofla.distill.trainer import batch_indices, distill, learning_rate_factor
from dofla.errors import DoflaError
from dofla.models.surgery import students
from dofla.settings import DistillSettings

VOCAB, LENGTH = 97, 24


def tiny_converted(kind="linear", feature_map="learnable_prf", seed=0, layers=2):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    # a peakier teacher than random init, so there is something to learn
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    convert(model, plan_for(model, kind=kind, feature_map=feature_map, feature_dim=8, window=4))
    return model


def token_data(count=20, seed=0):
    return torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(seed))


def quick_config(**changes):
    settings = dict(tokens=4 * LENGTH * 12, batch_size=4, eval_every=4, checkpoint_every=4, progress=False)
    settings.update(changes)
    return training_config(**settings)


def test_gradients_stay_in_their_layer_and_teacher_is_untouched():
    model = tiny_converted()
    teacher_before = {
        name: p.detach().clone() for name, p in model.named_parameters() if "dofla_student" not in name
    }
    by_layer = teacher_forcing.freeze_teacher(model)
    batch = token_data(2)
    teacher_forcing.teacher_forced_step(model, batch, by_layer, "softmax", backward=True)
    grad_layer1 = [p.grad.clone() for p in by_layer[1].parameters()]
    assert all(g.abs().sum() > 0 for g in grad_layer1)
    # perturbing layer 0's student changes nothing for layer 1: its inputs are the teacher's
    for parameter in by_layer[0].parameters():
        parameter.grad = None
        with torch.no_grad():
            parameter.add_(torch.randn_like(parameter))
    for parameter in by_layer[1].parameters():
        parameter.grad = None
    teacher_forcing.teacher_forced_step(model, batch, by_layer, "softmax", backward=True)
    for grad, expected in zip((p.grad for p in by_layer[1].parameters()), grad_layer1, strict=True):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    # teacher weights: frozen, no gradients, unchanged after training
    distill(model, token_data(), token_data(8, seed=1), quick_config())
    for name, parameter in model.named_parameters():
        if "dofla_student" not in name:
            assert not parameter.requires_grad and parameter.grad is None
            torch.testing.assert_close(parameter, teacher_before[name], rtol=0, atol=0)


def test_layer_losses_match_single_layer_computation():
    """The all-layers-at-once step gives each layer the loss it has when computed alone from captured calls."""
    from dofla import dispatch
    from dofla.distill.losses import layer_loss

    model = tiny_converted()
    by_layer = teacher_forcing.freeze_teacher(model)
    batch = token_data(2)
    losses = teacher_forcing.teacher_forced_step(model, batch, by_layer, "l2", backward=False)
    calls = {}
    with (
        torch.no_grad(),
        dispatch.teacher_forced(),
        dispatch.observe(lambda c: calls.setdefault(c.layer_index, c)),
    ):
        model(input_ids=batch)
    for index, student in by_layer.items():
        assert losses[index] == pytest.approx(
            float(layer_loss("l2", student, calls[index]).detach()), rel=1e-6
        )


@pytest.mark.parametrize(
    "kind, feature_map, loss",
    [
        ("linear", "learnable_prf", "softmax"),
        ("linear", "hedgehog", "l2"),
        ("hybrid", "hedgehog", "output_mse"),
    ],
)
def test_training_lowers_held_out_loss_and_logs(tmp_path, kind, feature_map, loss):
    model = tiny_converted(kind, feature_map)
    config = quick_config(loss=loss, lr=3e-2, tokens=4 * LENGTH * 16)
    result = distill(model, token_data(), token_data(8, seed=1), config, tmp_path)
    evaluations = [record["val_loss"] for record in result.history if "val_loss" in record]
    assert result.steps == 16 and result.tokens == 16 * 4 * LENGTH
    assert evaluations[-1] < evaluations[0]
    assert result.best_val_loss == pytest.approx(min(evaluations))
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert records == json.loads(json.dumps(result.history))
    assert json.loads((tmp_path / "distill_config.json").read_text())["loss"] == loss


def test_direct_loss_trains_end_to_end():
    model = tiny_converted()
    config = quick_config(loss="direct", kl_weight=1.0, lr=3e-2, tokens=4 * LENGTH * 16)
    data = token_data(8)
    result = distill(model, data, data, config)  # fits its training data: the loss reaches the students
    evaluations = [record["val_loss"] for record in result.history if "val_loss" in record]
    assert all(math.isfinite(value) for value in evaluations) and evaluations[-1] < evaluations[0]


def test_same_seed_same_result_and_other_seed_differs():
    def train(seed):
        model = tiny_converted()
        distill(model, token_data(), token_data(8, seed=1), quick_config(seed=seed))
        return torch.cat([p.detach().flatten() for s in students(model).values() for p in s.parameters()])

    first, again, other = train(0), train(0), train(1)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)


def test_schedule_and_batches():
    config = DistillSettings(warmup_fraction=0.1, min_lr_fraction=0.1)
    factors = [learning_rate_factor(step, 100, config) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=1e-3) and all(
        a >= b for a, b in zip(factors[9:], factors[10:], strict=False)
    )
    # every pass over the data visits each sequence once, in a seeded order
    first_pass = [i for step in range(5) for i in batch_indices(step, 4, 20, seed=3)]
    assert sorted(first_pass) == list(range(20)) and first_pass != list(range(20))
    assert batch_indices(7, 4, 20, seed=3) == batch_indices(7, 4, 20, seed=3)


def test_early_stopping_keeps_the_best_students():
    model = tiny_converted()
    config = quick_config(lr=0.5, eval_every=1, patience=2, tokens=4 * LENGTH * 40)
    result = distill(model, token_data(), token_data(8, seed=1), config)
    evaluations = [record["val_loss"] for record in result.history if "val_loss" in record]
    if result.stopped_early:
        assert result.steps < 40
        assert evaluations[-1] > min(evaluations) and evaluations[-2] > min(evaluations)
    assert result.final_val_loss == pytest.approx(min(evaluations), rel=1e-5)


def test_non_finite_loss_skips_the_step_then_stops(tmp_path, monkeypatch):
    model = tiny_converted()
    original = teacher_forcing.layer_loss
    calls = {"count": 0}

    def sometimes_nan(*args, **kwargs):
        calls["count"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["count"] in (3, 4) else loss  # step 2 (2 layers per step)

    monkeypatch.setattr(teacher_forcing, "layer_loss", sometimes_nan)
    with pytest.warns(UserWarning, match="distillation stage, layer 0, step 2: loss nan"):
        result = distill(model, token_data(), token_data(8, seed=1), quick_config(), tmp_path)
    assert result.skipped_steps == 1 and result.steps == 12
    # the log stays valid JSON: the skipped step's loss is null, not a bare NaN
    log = [
        json.loads(line, parse_constant=pytest.fail)
        for line in (tmp_path / "log.jsonl").read_text().splitlines()
    ]
    assert [record["loss"] for record in log if record["step"] == 2 and "loss" in record] == [None]
    lrs = [record["lr_factor"] for record in result.history if "lr_factor" in record]
    assert lrs[2] == pytest.approx(learning_rate_factor(2, 12, quick_config().distill) * 0.5)

    monkeypatch.setattr(teacher_forcing, "layer_loss", lambda *a, **k: original(*a, **k) * float("inf"))
    with pytest.raises(DoflaError, match="3 steps in a row had a non-finite loss"):
        with pytest.warns(UserWarning):
            distill(tiny_converted(), token_data(), token_data(8, seed=1), quick_config(max_bad_steps=3))


def test_bad_inputs_are_refused():
    model = tiny_converted()
    with pytest.raises(DoflaError, match="token budget must be positive, got 0"):
        distill(model, token_data(), token_data(4), quick_config(tokens=0))
    with pytest.raises(DoflaError, match="training data has shape"):
        distill(model, token_data()[:0], token_data(4), quick_config())
    with pytest.raises(DoflaError, match="unknown loss 'kl'"):
        distill(model, token_data(), token_data(4), quick_config(loss="kl"))
    with pytest.raises(DoflaError, match="--resume: no checkpoint"):
        distill(model, token_data(), token_data(4), quick_config(), "/nonexistent/dofla-run", resume=True)


def test_lora_in_pieces_of_a_batch_takes_the_same_steps_as_one_forward():
    from dofla.distill.lora import train_lora

    data = token_data(8)
    weights = {}
    for per_forward in (4 * LENGTH, LENGTH, 3 * LENGTH):  # the batch of 4 whole, in 4 pieces, in 3 + 1
        model = tiny_converted()
        config = training_config(
            lora=dict(tokens=4 * LENGTH * 3, lr=1e-2, kl_weight=0.5, tokens_per_forward=per_forward)
        )
        merged, result = train_lora(model, data, config)
        weights[per_forward] = [parameter.detach().clone() for parameter in merged.parameters()]
        losses = [record["loss"] for record in result.history]
        if per_forward == 4 * LENGTH:
            whole_losses = losses
        else:
            torch.testing.assert_close(losses, whole_losses, rtol=1e-5, atol=1e-6)
            for piece, whole in zip(weights[per_forward], weights[4 * LENGTH], strict=True):
                torch.testing.assert_close(piece, whole, rtol=1e-3, atol=5e-5)  # Adam on rounding
    moved = [(a - b).abs().max() for a, b in zip(weights[LENGTH], tiny_converted().parameters(), strict=True)]
    assert max(moved) > 1e-3  # the steps changed the weights (so the comparison above is not vacuous)


def test_lora_trains_and_merged_logits_equal_peft_logits():
    from dofla.distill.lora import attention_projection_names, merge_lora, train_lora

    model = tiny_converted()
    assert attention_projection_names(model) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    data = token_data(8)
    with torch.no_grad():
        before = model(input_ids=data[:2]).logits
    config = training_config(lora=dict(tokens=4 * LENGTH * 10, lr=1e-2, kl_weight=0.5))
    peft_model, result = train_lora(model, data, config, merge=False)
    losses = [record["loss"] for record in result.history]
    assert result.steps == 10 and losses[-1] < losses[0]
    with torch.no_grad():
        adapted = peft_model(input_ids=data[:2]).logits
    merged = merge_lora(peft_model)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert merged.dofla_plan is not None and len(students(merged)) == 2
    with torch.no_grad():
        after = merged(input_ids=data[:2]).logits
    torch.testing.assert_close(after, adapted, rtol=1e-4, atol=1e-4)
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("train_students", [False, True])
def test_lora_trains_the_students_only_when_asked(train_students):
    from dofla.distill.lora import train_lora

    model = tiny_converted()
    before = {
        index: {name: p.detach().clone() for name, p in student.named_parameters()}
        for index, student in students(model).items()
    }
    fixed = {  # parameters a cell keeps fixed must stay fixed either way
        (index, name)
        for index, student in students(model).items()
        for name, p in student.named_parameters()
        if not p.requires_grad
    }
    config = training_config(lora=dict(tokens=4 * LENGTH * 3, lr=1e-2, train_students=train_students))
    merged, _ = train_lora(model, token_data(8), config)
    moved = {
        (index, name): (p - before[index][name]).abs().max().item()
        for index, student in students(merged).items()
        for name, p in student.named_parameters()
    }
    assert not any(p.requires_grad for p in merged.parameters())
    assert all(moved[key] == 0 for key in fixed)
    trainable_moved = [value for key, value in moved.items() if key not in fixed]
    if train_students:
        assert trainable_moved and max(trainable_moved) > 1e-4
    else:
        assert max(trainable_moved, default=0.0) == 0.0


def test_lora_train_students_without_student_parameters_is_one_sentence():
    from dofla.distill.lora import train_lora

    model = tiny_converted()
    for student in students(model).values():
        student.requires_grad_(False)
    config = training_config(lora=dict(tokens=4 * LENGTH, train_students=True))
    with pytest.raises(DoflaError, match="no trainable parameters"):
        train_lora(model, token_data(8), config)
