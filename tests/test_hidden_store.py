"""Teacher hidden states stored on disk: layer-wise steps and distillation from them equal the full teacher
forward, layers below the start are never run, and mismatched or half-written stores are refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import training_config

from dofla import dispatch
from dofla.convert import convert, plan_for
from dofla.distill import hidden_store
from dofla.distill.hidden_store import MANIFEST_FILE, TeacherStates, shard_name, write_teacher_states
from dofla.distill.teacher_forcing import freeze_teacher, teacher_forced_step, teacher_forced_step_from_states
from dofla.distill.trainer import distill
from dofla.errors import DoflaError
from dofla.models import TINY_FAMILIES, build_tiny_model, get_adapter
from dofla.models.surgery import students

LENGTH = 12


def three_layer_converted(family: str = "llama", seed: int = 0):
    """A tiny 3-layer model of ``family``, every layer converted, with peakier attention than random init."""
    if family == "gpt2":
        overrides = dict(n_layer=3)
    else:
        overrides = dict(num_hidden_layers=3)
    if family == "gemma3":
        overrides["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    model = build_tiny_model(family, seed=seed, **overrides)
    with torch.no_grad():  # peakier attention than random init, so the layers' losses differ
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "c_attn.weight", "query_key_value.weight")):
                parameter.mul_(4.0)
    convert(model, plan_for(model, feature_dim=8, convert_windowed=True))  # the windowed layers too
    return model


def token_data(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (count, LENGTH), generator=torch.Generator().manual_seed(seed))


def student_gradients(by_layer) -> list[torch.Tensor]:
    return [
        parameter.grad.clone() for index in sorted(by_layer) for parameter in by_layer[index].parameters()
    ]


def clear_gradients(model) -> None:
    for parameter in model.parameters():
        parameter.grad = None


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_layer_losses_from_stored_states_equal_the_full_teacher_forward(family, tmp_path):
    model = three_layer_converted(family)
    sequences = token_data(5)
    write_teacher_states(model, sequences, tmp_path, [1], batch_size=2)
    store = TeacherStates(tmp_path)
    by_layer = freeze_teacher(model, [1, 2])
    indices = [4, 0, 3]  # rows from three different shards
    batch = sequences[indices]
    layers = get_adapter(model).decoder_layer_list(model)
    first_layer = layers[0]
    layer_zero_calls, attention_layers = [], []
    first_layer.register_forward_pre_hook(lambda module, args: layer_zero_calls.append(1))

    full = teacher_forced_step(model, batch, by_layer, "softmax", backward=True)
    full_gradients = student_gradients(by_layer)
    assert len(layer_zero_calls) == 1  # the counter sees the full forward's layer 0
    clear_gradients(model)
    with dispatch.observe(lambda call: attention_layers.append(call.layer_index)):
        stored = teacher_forced_step_from_states(
            model,
            batch,
            store.check(model, sequences, 1),
            store.read(indices, 1),
            by_layer,
            "softmax",
            backward=True,
        )
    assert len(layer_zero_calls) == 1, "layer 0 ran although the forward started from stored states"
    assert attention_layers == [1, 2]
    assert layers[0] is first_layer  # the pass-through is gone again

    assert stored.keys() == full.keys() == {1, 2}
    for layer in full:
        assert stored[layer] == pytest.approx(full[layer], rel=1e-6, abs=1e-7)
    for got, expected in zip(student_gradients(by_layer), full_gradients, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # the stored state matters: starting layer 1 from the embeddings (boundary 0) gives other losses
    write_teacher_states(model, sequences, tmp_path / "embeddings", [0], batch_size=5)
    embeddings = TeacherStates(tmp_path / "embeddings").read(indices, 0)
    wrong = teacher_forced_step_from_states(model, batch, 1, embeddings, by_layer, "softmax", backward=False)
    assert abs(wrong[1] - full[1]) > 1e-3


def quick_config(**changes):
    settings = dict(tokens=4 * LENGTH * 5, batch_size=4, eval_every=2, eval_batches=2, progress=False)
    settings.update(changes)
    return training_config(**settings)


def test_distill_from_stored_states_gives_the_same_students(tmp_path):
    train, heldout = token_data(10), token_data(8, seed=1)
    reference = three_layer_converted()
    expected = distill(reference, train, heldout, quick_config(), layers=[1, 2])
    model = three_layer_converted()
    write_teacher_states(model, train, tmp_path / "train", [1], batch_size=3)
    write_teacher_states(model, heldout, tmp_path / "heldout", [0, 1], batch_size=4)
    train_store = TeacherStates(tmp_path / "train")
    assert torch.equal(train_store.token_ids(), train)
    result = distill(
        model,
        train_store.token_ids(),
        heldout,
        quick_config(),
        layers=[1, 2],
        teacher_states=tmp_path / "train",
        heldout_teacher_states=TeacherStates(tmp_path / "heldout"),
    )
    assert result.steps == expected.steps == 5
    assert result.final_val_loss == pytest.approx(expected.final_val_loss, rel=1e-5)
    assert result.val_layer_losses.keys() == {1, 2}
    trained, untouched = students(model), students(reference)
    for index in (0, 1, 2):
        for got, want in zip(trained[index].parameters(), untouched[index].parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    first = [p.detach().clone() for p in three_layer_converted().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(first, model.parameters(), strict=True)), (
        "nothing trained"
    )


def test_mismatched_stores_are_refused(tmp_path):
    train, heldout = token_data(6), token_data(4, seed=1)
    model = three_layer_converted()
    write_teacher_states(model, train, tmp_path / "train", [1], batch_size=4)
    config = quick_config(tokens=4 * LENGTH)
    with pytest.raises(DoflaError, match="other token ids"):
        distill(model, train, heldout, config, layers=[1], heldout_teacher_states=tmp_path / "train")
    with pytest.raises(DoflaError, match="other token ids"):
        distill(model, token_data(6, seed=2), heldout, config, layers=[1], teacher_states=tmp_path / "train")
    with pytest.raises(DoflaError, match="another teacher"):
        distill(
            three_layer_converted(seed=1),
            train,
            heldout,
            config,
            layers=[1],
            teacher_states=tmp_path / "train",
        )
    with pytest.raises(DoflaError, match="first trained layer is 0"):
        distill(model, train, heldout, config, layers=[0, 1], teacher_states=tmp_path / "train")
    with pytest.raises(DoflaError, match="direct loss"):
        distill(
            model, train, heldout, quick_config(loss="direct"), layers=[1], teacher_states=tmp_path / "train"
        )
    with pytest.raises(DoflaError, match="another teacher, data, boundaries"):
        write_teacher_states(model, train, tmp_path / "train", [2], batch_size=4)
    with pytest.raises(DoflaError, match="come before the stored start layer"):
        by_layer = freeze_teacher(model, [0, 1])
        states = TeacherStates(tmp_path / "train").read([0], 1)
        teacher_forced_step_from_states(model, train[:1], 1, states, by_layer, "softmax", backward=False)


def test_interrupted_or_damaged_writes_are_detected_and_resumed(tmp_path, monkeypatch):
    model = three_layer_converted()
    sequences = token_data(7)
    write_teacher_states(model, sequences, tmp_path / "reference", [1, 2], batch_size=2)
    expected = TeacherStates(tmp_path / "reference").read(list(range(7)), 2)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))

    # killed after two of four shards: the manifest says incomplete, the rerun computes only the rest
    saved = []  # the token ids, then the shards
    real_save = hidden_store.save_safetensors_atomic

    def save_then_die(tensors, path, metadata=None):
        if len(saved) == 3:
            raise KeyboardInterrupt
        saved.append(path)
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(hidden_store, "save_safetensors_atomic", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        write_teacher_states(model, sequences, tmp_path, [1, 2], batch_size=2)
    monkeypatch.undo()
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"
    with pytest.raises(DoflaError, match="incomplete"):
        TeacherStates(tmp_path)
    forwards.clear()
    write_teacher_states(model, sequences, tmp_path, [1, 2], batch_size=2)
    assert len(forwards) == 2
    torch.testing.assert_close(TeacherStates(tmp_path).read(list(range(7)), 2), expected, rtol=0, atol=0)

    # a lost manifest: refused, then restored without recomputing any shard
    (tmp_path / MANIFEST_FILE).unlink()
    with pytest.raises(DoflaError, match="no manifest.json"):
        TeacherStates(tmp_path)
    forwards.clear()
    write_teacher_states(model, sequences, tmp_path, [1, 2], batch_size=2)
    assert forwards == []

    # a lost shard and a truncated one: refused, then exactly those two are recomputed
    (tmp_path / shard_name(1)).unlink()
    with pytest.raises(DoflaError, match=f"{shard_name(1)} is missing"):
        TeacherStates(tmp_path)
    damaged = tmp_path / shard_name(3)
    damaged.write_bytes(damaged.read_bytes()[:40])
    forwards.clear()
    write_teacher_states(model, sequences, tmp_path, [1, 2], batch_size=2)
    assert len(forwards) == 2
    store = TeacherStates(tmp_path)
    torch.testing.assert_close(store.read(list(range(7)), 2), expected, rtol=0, atol=0)
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["complete"] and manifest["boundaries"] == [1, 2] and len(manifest["shards"]) == 4
    with pytest.raises(DoflaError, match="not 0"):
        store.read([0], 0)


def test_teacher_states_command_writes_train_and_heldout_stores(tmp_path):
    from dofla.cli import main
    from dofla.loading import load_converted
    from dofla.models import load_teacher, save_tiny_model_folder
    from dofla.saving import save_converted

    folder = save_tiny_model_folder("llama", tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"Line {i} of some text about rivers and hills." for i in range(40)))
    arguments = ["--debug", "teacher-states", str(folder), "--data", str(text), "--boundaries", "1"]
    arguments += [
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--max-heldout",
        "3",
        "--out",
        str(tmp_path / "states"),
    ]
    assert main([*arguments, "--no-progress"]) == 0
    assert main([*arguments, "--no-progress"]) == 0  # a finished store is kept
    train, heldout = (
        TeacherStates(tmp_path / "states" / "train"),
        TeacherStates(tmp_path / "states" / "heldout"),
    )
    assert heldout.num_sequences == 3 and train.num_sequences > 10 and train.boundaries == [1]
    # the teacher loaded from the folder and converted is the teacher the store was written by
    teacher = load_teacher(str(folder)).model
    convert(teacher, plan_for(teacher, feature_dim=4))
    save_converted(teacher, tmp_path / "converted")
    model, _, _ = load_converted(tmp_path / "converted")
    assert train.check(model, train.token_ids(), 1) == 1
    assert (
        main([*arguments[1:3], "--data", str(text), "--boundaries", "1,x", "--out", str(tmp_path / "x")]) == 1
    )
