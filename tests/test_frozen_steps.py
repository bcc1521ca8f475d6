"""Decoding steps under a frozen decoder (``dofla.graph_decode.CapturedDecoder``): every cell's one-token step
with its window held as a ring whose next slot is a tensor the step advances (the cache layer's
``frozen_slot``), as a CUDA graph replays it and a compiled whole step traces it. The reference is the full
forward: teacher-forced, token by token through the decoder after ordinary steps, a model's logits must
equal it. Compiling for real is tested in ``test_graph_decode``.
"""

from __future__ import annotations

import pytest
import torch
from test_position_period import decode_logits, tokens
from transformers import DynamicCache

from dofla.convert import convert, plan_for, set_position_period, set_sinks_at_edge
from dofla.graph_decode import CapturedDecoder
from dofla.models import build_tiny_model
from dofla.models.surgery import students
from dofla.ops.state import WindowState
from dofla.ops.window.step import ring_window

HYBRID = dict(kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=8, window=6, sinks=3)
GLA = dict(kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=6, sinks=3)
PLANS = {
    "hybrid": (HYBRID, dict()),
    "hybrid, period and edge sinks": (HYBRID, dict(period=8, edge=True)),
    "hybrid, no sinks, period": ({**HYBRID, "sinks": 0}, dict(period=8)),
    "linear": (dict(kind="linear", cell="gated_delta", feature_map="projection", feature_dim=8), dict()),
    "hybrid, head-wise features": (HYBRID, dict(head_dims=[8, 5])),
    "hybrid, output gate": ({**HYBRID, "options": {"output_gate": True}}, dict(period=8, edge=True)),
    "linear, short convolution and output gate": (
        dict(kind="linear", cell="gated_delta", feature_map="projection", feature_dim=8,
             options={"short_conv": 4, "output_gate": True}),
        dict(period=8),
    ),
    "hybrid, feature dimensions 8 / 12 by layer": (HYBRID, dict(layer_dims=[8, 12], period=8, edge=True)),
    "gla hybrid, period and edge sinks": (GLA, dict(period=8, edge=True)),
    "gla hybrid, no sinks": ({**GLA, "sinks": 0}, dict()),
    "linear hybrid (LoLCATs), period and edge sinks": ({**GLA, "cell": "linear"}, dict(period=8, edge=True)),
    "linear hybrid (LoLCATs), no sinks": ({**GLA, "cell": "linear", "sinks": 0}, dict()),
    "hybrid, adaptive mix": ({**HYBRID, "options": {"mix": "adaptive"}}, dict(period=8, edge=True)),
    "window cell, edge sinks": ({**GLA, "cell": "window"}, dict(edge=True)),
}  # fmt: skip


def converted(name: str, seed: int = 0):
    plan_settings, extra = PLANS[name]
    model = build_tiny_model("llama", seed=seed)
    plan = plan_for(model, **plan_settings)
    for layer, dim in zip(
        plan.layers, extra.get("layer_dims", ()), strict=False
    ):  # an allocation's dimensions
        layer.feature_dim = dim
    if "head_dims" in extra:
        for layer in plan.layers:
            layer.head_feature_dims = list(extra["head_dims"])
    convert(model, plan)
    if "period" in extra:
        set_position_period(model, extra["period"])
    if extra.get("edge"):
        set_sinks_at_edge(model, True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # gates, mix and convolution away from their starting values (zeros, identity)
        for student in students(model).values():
            for parameter in student.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def frozen_logits(model, ids: torch.Tensor, prefill: int, ordinary: int, mode=torch.no_grad):
    """Logits of a prefill of ``prefill`` tokens, ``ordinary`` ordinary one-token calls, then one token per
    step of a frozen decoder (the rest of ``ids``), and how many windows the decoder held as rings."""
    cache = DynamicCache(config=model.config)
    with mode():
        pieces = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for position in range(prefill, prefill + ordinary):
            pieces.append(
                model(ids[:, position : position + 1], past_key_values=cache, use_cache=True).logits
            )
        decoder = CapturedDecoder(model, cache, ids.shape[0], prefill + ordinary, graph=False)
        rings = sum(layer.frozen_slot is not None for layer in decoder.layers)
        for position in range(prefill + ordinary, ids.shape[1]):
            pieces.append(decoder.step(ids[:, position : position + 1])[:, None].clone())
        decoder.finish()
        pieces.append(model(ids[:, -1:], past_key_values=cache, use_cache=True).logits)  # the cache continues
    return torch.cat(pieces, dim=1), rings


@pytest.mark.parametrize("name", sorted(PLANS))
def test_decoding_through_the_frozen_step_equals_the_full_forward(name):
    model = converted(name)
    ids = tokens(30)
    with torch.no_grad():
        full = model(torch.cat([ids, ids[:, -1:]], dim=1)).logits
    window = PLANS[name][0].get("window", 0) if PLANS[name][0]["kind"] == "hybrid" else 0
    # a prefill shorter than the window, ordinary steps until every window slot holds a key, then frozen
    logits, rings = frozen_logits(model, ids, prefill=4, ordinary=window + 1)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    assert rings == (len(students(model)) if window else 0)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_full_window_is_held_as_a_ring_from_the_first_step_after_the_prefill(mode):
    """One ordinary step puts the prefill's full window in the ring layout; the decoder holds it, in
    inference mode too."""
    model = converted("hybrid, period and edge sinks")
    ids = tokens(30)
    with torch.no_grad():
        full = model(torch.cat([ids, ids[:, -1:]], dim=1)).logits
    logits, rings = frozen_logits(model, ids, prefill=20, ordinary=1, mode=mode)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    assert rings == len(students(model))


def test_with_autograd_the_step_gives_the_full_forwards_logits_and_gradients_flow():
    model = converted("hybrid")
    ids = tokens(20, batch=1)
    with torch.no_grad():
        full = model(ids).logits
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :12], past_key_values=cache, use_cache=True)
    logits = model(ids[:, 12:13], past_key_values=cache, use_cache=True).logits
    logits.sum().backward()
    torch.testing.assert_close(logits, full[:, 12:13], rtol=1e-4, atol=1e-4)
    assert students(model)[0].feature_map.weight.grad is not None


def test_a_ring_made_from_a_full_window_hides_no_slot():
    keys = torch.randn(1, 2, 4, 8)
    state = WindowState(
        keys=keys,
        values=torch.randn(1, 2, 4, 8),
        key_present=torch.ones(1, 2, 4, dtype=torch.bool),
        sink_keys=torch.randn(1, 2, 2, 8),
        sink_values=torch.randn(1, 2, 2, 8),
        sink_count=torch.full((1, 2), 2),
        window=4,
        num_tokens=10,
    )
    assert ring_window(state, 10).hidden_until == 10
    state.key_present[0, 1, 2] = False
    assert ring_window(state, 10).hidden_until == 14


def test_the_generate_command_with_compile_prints_the_eager_continuation(tmp_path, capsys, monkeypatch):
    """Greedy through the whole step (compiled for real: one program), after ordinary steps while a short
    prompt's window fills: the same text as eager decoding. Sampling does not compile."""
    import dofla.graph_decode as graph_decode
    from dofla.cli import main
    from dofla.models import build_tiny_tokenizer
    from dofla.saving import save_converted

    wholes = []
    real_compiled_method = graph_decode.compiled_method
    monkeypatch.setattr(
        graph_decode, "compiled_method", lambda *a: wholes.append(a) or real_compiled_method(*a)
    )
    model = converted("hybrid, period and edge sinks")
    save_converted(model, tmp_path / "out", tokenizer=build_tiny_tokenizer())
    for prompt in ("The cat sat on the mat and the dog", "The cat"):
        arguments = ["generate", str(tmp_path / "out"), "--prompt", prompt, "--max-new-tokens", "12"]
        assert main(arguments) == 0
        eager = capsys.readouterr().out
        assert not wholes
        assert main([*arguments, "--compile"]) == 0
        assert capsys.readouterr().out == eager
        assert len(wholes) == 1, prompt
        wholes.clear()
    assert main([*arguments, "--compile", "--sample"]) == 1
    assert "--compile decodes greedily" in capsys.readouterr().err


def test_the_generate_command_refuses_compile_on_a_gpu_in_one_sentence(monkeypatch, tmp_path, capsys):
    from dofla.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: the default device
    assert main(["generate", str(tmp_path / "not-loaded"), "--prompt", "Hi", "--compile"]) == 1
    assert "on a GPU use --graph" in capsys.readouterr().err


def test_a_model_converted_in_inference_mode_decodes_as_its_full_forward():
    """Parameters made in inference mode keep no version counter: what is derived from them is rebuilt."""
    with torch.inference_mode():
        model = converted("gla hybrid, period and edge sinks")
        ids = tokens(30)
        full = model(ids).logits
    assert students(model)[0].decay.weight.is_inference()
    logits = decode_logits(model, ids, prefill=20, mode=torch.inference_mode)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
