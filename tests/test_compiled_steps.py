"""Decoding steps through one compiled kernel (``dofla.ops.compiled``, ``set_compiled_steps``).

The reference is the cells' eager decoding (itself tested against the full forward): token by token with
the compiled steps on, a model's logits must equal its full forward, with the compiled step taken once the
window is in its steady state (and the eager step before it). Most tests run the step function eagerly (it
is written plainly, and compiling costs seconds); one compiles it for real (inductor's C++ backend).
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from test_edge_sinks import assert_left_padded_batch_generates_each_prompt_alone
from test_position_period import decode_logits, tokens

import dofla.attention as attention_module
import dofla.cells.delta as delta_cells
from dofla.convert import convert, plan_for, set_compiled_steps, set_position_period, set_sinks_at_edge
from dofla.errors import DoflaError
from dofla.models import build_tiny_model
from dofla.models.surgery import students
from dofla.ops import compiled as compiled_ops
from dofla.ops.delta.step import gated_delta_window_step
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


@pytest.fixture
def eager_kernel(monkeypatch):
    """The compiled steps run as their plain (eager) function; returns the list of calls."""
    calls = []

    def run(function, *args, **kwargs):
        if not torch.compiler.is_compiling():  # traced into a compiled whole step: not a call of its own
            calls.append(function.__name__)
        return function(*args, **kwargs)

    for module in (delta_cells, attention_module):
        monkeypatch.setattr(module, "run_compiled", run)
    return calls


@pytest.mark.parametrize("name", sorted(PLANS))
def test_decoding_through_the_step_function_equals_the_full_forward(name, eager_kernel):
    model = converted(name)
    ids = tokens(30)
    with torch.no_grad():
        full = model(ids).logits
    set_compiled_steps(model, True)
    torch.testing.assert_close(decode_logits(model, ids, prefill=4), full, rtol=1e-4, atol=1e-4)
    # after a prefill shorter than the window, W more tokens take the eager step (until every window slot
    # holds a present key); then every step is compiled
    window = PLANS[name][0].get("window", 0)
    assert len(eager_kernel) == (30 - 4 - window) * len(students(model))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_full_window_takes_the_compiled_step_from_the_second_token_after_the_prefill(eager_kernel, mode):
    """The first step puts the prefill's window in the ring layout (eagerly); the others are compiled, in
    inference mode too."""
    model = converted("hybrid, period and edge sinks")
    set_compiled_steps(model, True)
    ids = tokens(30)
    with torch.no_grad():
        full = model(ids).logits
    logits = decode_logits(model, ids, prefill=20, mode=mode)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    assert len(eager_kernel) == 9 * len(students(model))


def test_a_left_padded_batch_decodes_as_each_prompt_alone(eager_kernel):
    """Padded slots keep the window out of its steady state until they are overwritten."""
    model = converted("hybrid, period and edge sinks")
    set_compiled_steps(model, True)
    assert_left_padded_batch_generates_each_prompt_alone(model, new_tokens=14)
    assert eager_kernel  # the steady state was reached


def test_with_autograd_the_eager_step_runs_and_gradients_flow(eager_kernel):
    model = converted("hybrid")
    set_compiled_steps(model, True)
    ids = tokens(20, batch=1)
    with torch.no_grad():
        full = model(ids).logits
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :12], past_key_values=cache, use_cache=True)
    logits = model(ids[:, 12:13], past_key_values=cache, use_cache=True).logits
    logits.sum().backward()
    assert not eager_kernel
    torch.testing.assert_close(logits, full[:, 12:13], rtol=1e-4, atol=1e-4)
    assert students(model)[0].feature_map.weight.grad is not None


def test_a_failing_compiler_warns_once_and_decoding_goes_on_eagerly(monkeypatch):
    def broken(*args, **kwargs):
        from torch._inductor.exc import InvalidCxxCompiler

        raise InvalidCxxCompiler()  # what inductor raises on a machine without a C++ compiler

    monkeypatch.setattr(compiled_ops, "_COMPILED", {})
    monkeypatch.setattr(compiled_ops, "_FAILED", set())
    monkeypatch.setattr(compiled_ops.torch, "compile", lambda function, **kwargs: broken)
    model = converted("hybrid")
    set_compiled_steps(model, True)
    ids = tokens(20)
    with torch.no_grad():
        full = model(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = decode_logits(model, ids, prefill=12)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    assert sum("compiling the decoding step failed" in str(warning.message) for warning in caught) == 1


def test_an_error_of_the_inputs_is_not_swallowed(monkeypatch):
    monkeypatch.setattr(compiled_ops, "_COMPILED", {})
    monkeypatch.setattr(compiled_ops, "_FAILED", set())

    def wrong(*args, **kwargs):
        raise ValueError("bad shapes")

    monkeypatch.setattr(compiled_ops.torch, "compile", lambda function, **kwargs: wrong)
    with pytest.raises(ValueError, match="bad shapes"):
        compiled_ops.run_compiled(gated_delta_window_step)


def test_set_compiled_steps_needs_a_converted_model():
    with pytest.raises(DoflaError, match="convert it first"):
        set_compiled_steps(build_tiny_model("llama", seed=0), True)


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


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="needs a C++ compiler"
)
@pytest.mark.parametrize(
    "name, compiled_steps",  # a hybrid's first step puts the prefill's window in the ring layout (eagerly)
    [("hybrid, period and edge sinks", 9), ("gla hybrid, period and edge sinks", 9),
     ("linear, short convolution and output gate", 10),
     ("hybrid, feature dimensions 8 / 12 by layer", 9),  # one kernel per shape
     ("linear hybrid (LoLCATs), period and edge sinks", 9)],
)  # fmt: skip
def test_the_compiled_kernel_decodes_as_the_full_forward(monkeypatch, name, compiled_steps):
    """torch.compile for real: the generated kernels, with the rings written in place."""
    monkeypatch.setattr(compiled_ops, "_COMPILED", {})
    monkeypatch.setattr(compiled_ops, "_FAILED", set())
    ran = []
    original = compiled_ops.compiled
    monkeypatch.setattr(compiled_ops, "compiled", lambda function: ran.append(1) or original(function))
    model = converted(name)
    set_compiled_steps(model, True)
    ids = tokens(30)
    with torch.no_grad():
        full = model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to the eager step would warn
        torch.testing.assert_close(decode_logits(model, ids, prefill=20), full, rtol=1e-4, atol=1e-4)
    assert len(ran) == compiled_steps * len(students(model))
    assert not compiled_ops._FAILED


def test_the_generate_command_with_compile_prints_the_eager_continuation(
    tmp_path, capsys, eager_kernel, monkeypatch
):
    """Greedy: the whole step compiled (for real: one program), after ordinary steps while a short prompt's
    window fills; sampling: each layer's compiled step (run eagerly here). The same text as eager decoding."""
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
        for sampling in ([], ["--sample", "--seed", "3"]):
            assert main([*arguments, *sampling]) == 0
            eager = capsys.readouterr().out
            assert not eager_kernel and not wholes
            assert main([*arguments, *sampling, "--compile"]) == 0
            assert capsys.readouterr().out == eager
            whole = not sampling  # greedy: ordinary steps until the window is full, then the whole step
            assert len(wholes) == int(whole) and bool(eager_kernel) != whole, (prompt, sampling)
            wholes.clear()
            eager_kernel.clear()


def test_the_generate_command_refuses_compile_on_a_gpu_in_one_sentence(monkeypatch, tmp_path, capsys):
    from dofla.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: the default device
    assert main(["generate", str(tmp_path / "not-loaded"), "--prompt", "Hi", "--compile"]) == 1
    assert "on a GPU use --graph" in capsys.readouterr().err


@pytest.mark.parametrize("compiled_steps", [False, True])
def test_a_model_converted_in_inference_mode_decodes_as_its_full_forward(compiled_steps, eager_kernel):
    """Parameters made in inference mode keep no version counter: what is derived from them is rebuilt."""
    with torch.inference_mode():
        model = converted("gla hybrid, period and edge sinks")
        set_compiled_steps(model, compiled_steps)
        ids = tokens(30)
        full = model(ids).logits
    assert students(model)[0].decay.weight.is_inference()
    logits = decode_logits(model, ids, prefill=20, mode=torch.inference_mode)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    assert len(eager_kernel) == (9 * len(students(model)) if compiled_steps else 0)
