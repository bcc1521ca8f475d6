"""Teachers taken as they come: the teacher's own sliding-window layers keep their bounded cache by default,
and only the layers whose cache grows are converted; reports, baselines and ``dofla info`` say which."""

from __future__ import annotations

import pytest
import torch

from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.evaluation.window_baseline import baseline_layers, baseline_notes
from dofla.models import build_tiny_model, get_adapter
from dofla.models.surgery import students
from dofla.report import plan_table


def gemma3(layers: int = 4):
    """A tiny Gemma 3 teacher: sliding, full, sliding, full (window 8)."""
    kinds = ["sliding_attention", "full_attention"] * (layers // 2)
    return build_tiny_model("gemma3", num_hidden_layers=layers, layer_types=kinds)


def test_only_the_layers_whose_cache_grows_are_converted_by_default():
    model = gemma3()
    plan = plan_for(model, feature_dim=8)
    assert plan.converted_layers == [1, 3]
    assert plan.kept_windowed_layers == [0, 2]
    assert plan.metadata["teacher_window"] == 8
    reasons = plan.layer_reasons()
    assert reasons[0] == "kept: the teacher's own sliding window of 8 tokens, a bounded cache"
    assert reasons[1] == "converted (full attention)"
    assert [row["attention"] for row in plan_table(plan)] == reasons


def test_convert_windowed_converts_every_layer_and_says_so():
    plan = plan_for(gemma3(), feature_dim=8, convert_windowed=True)
    assert plan.converted_layers == [0, 1, 2, 3]
    assert plan.kept_windowed_layers == []
    assert plan.layer_reasons()[0] == "converted (the teacher's own sliding window of 8 tokens)"


def test_explicit_layers_are_honoured_whatever_their_kind():
    assert plan_for(gemma3(), feature_dim=8, layers=[0, 3]).converted_layers == [0, 3]


def test_families_without_windows_convert_every_layer():
    for family in ("llama", "qwen2", "gpt2"):
        assert plan_for(build_tiny_model(family), feature_dim=8).converted_layers == [0, 1]


def test_a_teacher_whose_every_layer_is_windowed_gets_one_sentence():
    model = build_tiny_model("mistral")  # sliding_window 8 on every layer
    with pytest.raises(DoflaError, match="nothing to convert.*--convert-windowed"):
        plan_for(model, feature_dim=8)
    assert plan_for(model, feature_dim=8, convert_windowed=True).converted_layers == [0, 1]


def test_the_window_baseline_restricts_only_the_converted_layers_and_keeps_the_teachers_windows():
    model = gemma3()
    convert(model, plan_for(model, feature_dim=8))
    assert sorted(students(model)) == [1, 3]
    assert baseline_layers(model) == [1, 3]
    (note, *_) = baseline_notes(model, 64)
    assert "layers [0, 2] keep the teacher's own sliding window" in note
    assert "full softmax" not in note


def test_a_kept_window_layer_still_attends_to_its_own_window_only():
    """A kept layer is the teacher's own: a token changed beyond its window leaves its output unchanged."""
    model = gemma3(layers=2)
    convert(model, plan_for(model, feature_dim=8))
    captured = {}
    layer = get_adapter(model).decoder_layers(model)[0]

    def keep(module, args, output):
        captured["out"] = output if isinstance(output, torch.Tensor) else output[0]  # (B, T, E)

    handle = layer.register_forward_hook(keep)
    tokens = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 2] = (changed[0, 2] + 1) % 125 + 3
    with torch.no_grad():
        model(tokens)
        first = captured["out"].clone()
        model(changed)
    handle.remove()
    # position 19 sees positions 12..19 (window 8): the change at position 2 is outside it
    torch.testing.assert_close(captured["out"][0, 19], first[0, 19])
    assert not torch.allclose(captured["out"][0, 9], first[0, 9])  # inside its window: changed


def test_info_says_which_layers_are_converted_by_default():
    from dofla.commands.info import conversion_text

    assert conversion_text(get_adapter(gemma3())).startswith("layers 1, 3 (full attention); 0, 2 keep")
    assert conversion_text(get_adapter(build_tiny_model("llama"))) == "every layer (full attention)"
    assert conversion_text(get_adapter(build_tiny_model("mistral"))).startswith("none: every layer")


def test_state_bytes_count_the_kept_window_layers_at_their_own_window():
    """The equal-bytes baselines' accounting: a kept sliding-window layer holds its last 8 keys, not every
    key; heavy hitters, which run plain softmax layers only, are left out (with a note) where the layers
    they would restrict keep the teacher's own window."""
    from dofla.evaluation.cache_baselines import (
        baseline_bytes,
        cache_baselines_at,
        equal_bytes_tokens,
        kv_bytes_per_token,
    )

    model = gemma3()  # sliding, full, sliding, full; window 8
    per_token = kv_bytes_per_token(model)
    # layers 1 and 3 restricted to 16 keys; 0 and 2 keep their own 8 at 64 tokens (not 64)
    assert baseline_bytes(model, 16, 64, [1, 3]) == (2 * 16 + 2 * 8) * per_token
    assert equal_bytes_tokens(model, (2 * 16 + 2 * 8) * per_token, 64, [1, 3]) == 16
    assert baseline_bytes(build_tiny_model("llama"), 16, 64, [1]) == (16 + 64) * per_token
    notes = set()
    assert [b.name for b in cache_baselines_at(model, 16, 64, 4, notes, [1, 3])] == [
        "streaming",
        "heavy-hitter",
    ]
    assert [b.name for b in cache_baselines_at(model, 16, 64, 4, notes, None)] == ["streaming"]
    assert any("layers [0, 2] keep the teacher's own sliding window" in note for note in notes)
