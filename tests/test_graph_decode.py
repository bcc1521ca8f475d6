"""Graph decoding (dofla.graph_decode): the step a CUDA graph replays, run on CPU with the cache's Python side
frozen as a graph freezes it, gives the logits of ordinary decoding; the cache continues afterwards; models a
graph cannot hold are refused with the reason. On a CUDA GPU the captured graph is compared with the eager
step."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.graph_decode import CapturedDecoder, generate_greedy
from dofla.models import build_tiny_model
from dofla.models.surgery import students
from dofla.models.tiny import TINY_VOCAB
from dofla.prefill import prefill

PLANS = {
    "linear": dict(cell="linear", feature_map="learnable_prf"),
    "gla": dict(cell="gla", feature_map="hedgehog"),
    "gated_delta": dict(
        cell="gated_delta", feature_map="projection", options={"short_conv": 4, "output_gate": True}
    ),
}


def converted(family: str, cell: str, dtype=torch.float32, device="cpu", kind="linear"):
    """A tiny model of ``family`` converted to ``cell`` (hybrid: window 4 + 2 sinks)."""
    model = build_tiny_model(family, seed=0)
    window = dict(window=4, sinks=2) if kind == "hybrid" else {}
    convert(model, plan_for(model, kind=kind, feature_dim=8, **window, **PLANS[cell]))
    return model.to(device=device, dtype=dtype).eval()


def eager_decode(model, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], DynamicCache]:
    """Ordinary decoding (transformers' cache and forward, one token a step): the logits of every step."""
    cache = DynamicCache(config=model.config)
    logits = [prefill(model, prompt, cache)]
    with torch.no_grad():
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1])
    return logits, cache


def frozen_decode(
    model, prompt: torch.Tensor, steps: int, graph: bool, eager_steps: int = 0, compiled=False, room=None
):
    """Decoding through a CapturedDecoder (after ``eager_steps`` ordinary steps): the logits of every step."""
    logits, cache = eager_decode(model, prompt, eager_steps)
    steps -= eager_steps
    position = prompt.shape[1] + eager_steps
    decoder = CapturedDecoder(
        model, cache, prompt.shape[0], position, graph=graph, compiled=compiled, steps=room
    )
    for _ in range(steps):
        logits.append(decoder.step(logits[-1].argmax(-1, keepdim=True)).clone())
    decoder.finish()
    return logits, cache


def recurrent_layers(cache) -> list:
    """The converted layers' cache layers of ``cache``."""
    from dofla.cache import RecurrentCacheLayer, self_attention_cache

    return [layer for layer in self_attention_cache(cache).layers if isinstance(layer, RecurrentCacheLayer)]


def partly_converted(family: str, converted_layer: int, dtype=torch.float32, device="cpu"):
    """A tiny 2-layer model of ``family`` with one layer converted (gated delta, window 4 + 2 sinks) and the
    other kept as softmax."""
    model = build_tiny_model(family, seed=0)
    plan = plan_for(
        model,
        kind="hybrid",
        feature_dim=8,
        window=4,
        sinks=2,
        layers=[converted_layer],
        **PLANS["gated_delta"],
    )
    convert(model, plan)
    return model.to(device=device, dtype=dtype).eval()


def prompt_of(batch: int = 2, length: int = 11, device="cpu") -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(3)).to(
        device
    )


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
@pytest.mark.parametrize("cell", PLANS)
def test_the_frozen_step_gives_ordinary_decodings_logits_and_the_cache_continues(family, cell, kind):
    model = converted(family, cell, kind=kind)
    prompt = prompt_of()
    expected, expected_cache = eager_decode(model, prompt, steps=6)
    got, cache = frozen_decode(model, prompt, steps=6, graph=False)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    # after finish() the cache is an ordinary one again: counts and states as ordinary decoding left them
    from dofla.cache import self_attention_cache

    for layer, reference in zip(
        self_attention_cache(cache).layers, self_attention_cache(expected_cache).layers, strict=True
    ):
        assert layer.num_tokens == reference.num_tokens == prompt.shape[1] + 6
        states = (layer.state.general_layout(), reference.state.general_layout())  # ordinary steps: a ring
        for actual, wanted in zip(*(state.tensors() for state in states), strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)
    token = expected[-1].argmax(-1, keepdim=True)
    with torch.no_grad():
        after = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        reference = model(input_ids=token, past_key_values=expected_cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_the_frozen_step_wraps_positions_across_a_period_as_ordinary_decoding_does(kind):
    """A position period crossed while decoding (the prompt's 11 tokens, period 13, 6 steps): the positions
    the step advances on the device are wrapped as ordinary decoding wraps them (at the rotary embedding
    without a window, in each layer with one)."""
    from dofla.convert import set_position_period

    model = converted("llama", "gated_delta", kind=kind)
    set_position_period(model, 13)
    prompt = prompt_of()
    expected, _ = eager_decode(model, prompt, steps=6)
    got, _ = frozen_decode(model, prompt, steps=6, graph=False)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    set_position_period(model, None)
    unwrapped, _ = eager_decode(model, prompt, steps=6)
    assert (unwrapped[-1] - expected[-1]).abs().max() > 1e-4  # the period was crossed and mattered


@pytest.mark.parametrize("eager_steps", [0, 2])
@pytest.mark.parametrize("converted_layer", [0, 1])
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2", "qwen3"])
def test_kept_softmax_layers_decode_under_the_frozen_step_and_continue(family, converted_layer, eager_steps):
    from dofla.cache import GrowingKVLayer, self_attention_cache

    model = partly_converted(family, converted_layer)
    prompt = prompt_of()
    expected, expected_cache = eager_decode(model, prompt, steps=6)
    logits, cache = eager_decode(model, prompt, eager_steps)
    decoder = CapturedDecoder(model, cache, 2, prompt.shape[1] + eager_steps, graph=False, steps=9)
    for _ in range(6 - eager_steps):
        logits.append(decoder.step(logits[-1].argmax(-1, keepdim=True)).clone())
    decoder.finish()
    for step, (actual, reference) in enumerate(zip(logits, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    kept = self_attention_cache(cache).layers[1 - converted_layer]
    reference = self_attention_cache(expected_cache).layers[1 - converted_layer]
    assert isinstance(kept, GrowingKVLayer) and kept.count is None  # released: an ordinary layer again
    torch.testing.assert_close(kept.keys, reference.keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept.values, reference.values, rtol=1e-5, atol=1e-6)
    assert getattr(model_attention(model, 1 - converted_layer), "dofla_softmax_override", None) is None
    token = expected[-1].argmax(-1, keepdim=True)
    with torch.no_grad():
        after = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        wanted = model(input_ids=token, past_key_values=expected_cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(after, wanted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partly", [False, True])
def test_a_prompt_prefilled_in_inference_mode_decodes_under_the_frozen_step(partly):
    model = partly_converted("llama", 0) if partly else converted("llama", "gated_delta", kind="hybrid")
    prompt = prompt_of()
    expected, _ = eager_decode(model, prompt, steps=3)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = [prefill(model, prompt, cache).clone()]
    decoder = CapturedDecoder(model, cache, 2, prompt.shape[1], graph=False, steps=3)
    for _ in range(3):
        logits.append(decoder.step(logits[-1].argmax(-1, keepdim=True)).clone())
    decoder.finish()
    for actual, reference in zip(logits, expected, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5)


def model_attention(model, index: int):
    from dofla.models.surgery import architecture

    return architecture(model).attention_modules[index]


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_the_frozen_step_in_bfloat16_follows_ordinary_decoding(kind):
    model = converted("llama", "gated_delta", dtype=torch.bfloat16, kind=kind)
    prompt = prompt_of()
    expected, _ = eager_decode(model, prompt, steps=4)
    got, _ = frozen_decode(model, prompt, steps=4, graph=False)
    for actual, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(actual.float(), reference.float(), rtol=0, atol=0)


@pytest.mark.parametrize("cell", PLANS)
def test_a_window_decoded_by_its_ring_step_first_continues_under_the_decoder(cell):
    """Ordinary steps leave a window's state in its ring layout, full: the decoder holds it as that ring, its
    next slot a tensor the step advances."""
    model = converted("llama", cell, kind="hybrid")
    prompt = prompt_of()
    expected, _ = eager_decode(model, prompt, steps=6)
    got, cache = frozen_decode(model, prompt, steps=6, graph=False, eager_steps=2)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert not any(layer.frozen for layer in recurrent_layers(cache))  # finish() released them


@pytest.mark.parametrize("partly", [False, True])
def test_generate_greedy_continues_the_prompt_as_greedy_decoding_does(partly):
    model = partly_converted("qwen2", 0) if partly else converted("qwen2", "gated_delta")
    prompt = prompt_of(batch=3, length=7)
    logits, _ = eager_decode(model, prompt, steps=4)
    expected = torch.cat([prompt, *(step.argmax(-1, keepdim=True) for step in logits)], dim=1)
    assert torch.equal(generate_greedy(model, prompt, 5, graph=False), expected)


COMPILED_CASES = {
    # every option of a hybrid layer's step: window and sinks seen from the edge, a position period crossed
    "gated_delta hybrid, period, edge": ("llama", "gated_delta", "hybrid", 13),
    "gla hybrid": ("llama", "gla", "hybrid", None),
    "linear, absolute positions": ("gpt2", "linear", "linear", None),
}


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_the_compiled_whole_step_gives_ordinary_decodings_logits(case):
    """CapturedDecoder(compiled=True): the whole step compiled for real (one program, the windows' rings
    held with their slot on the device) decodes as ordinary decoding does, and the cache continues after
    it."""
    from dofla.convert import set_position_period, set_sinks_at_edge

    family, cell, kind, period = COMPILED_CASES[case]
    model = converted(family, cell, kind=kind)
    if period:
        set_position_period(model, period)
    if kind == "hybrid" and family == "llama":
        set_sinks_at_edge(model, True)
    prompt = prompt_of()
    expected, expected_cache = eager_decode(model, prompt, steps=6)
    # one ordinary step first, as generate_greedy takes: the windows are rings the whole step holds as such
    got, cache = eager_decode(model, prompt, steps=1)
    decoder = CapturedDecoder(model, cache, prompt.shape[0], prompt.shape[1] + 1, graph=False, compiled=True)
    rings = [layer.frozen_slot is not None for layer in decoder.layers]
    assert all(rings) == (kind == "hybrid") and any(rings) == (kind == "hybrid")
    torch._dynamo.reset()  # programs other tests compiled from the same code do not count
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            got.append(decoder.step(got[-1].argmax(-1, keepdim=True)).clone())
    decoder.finish()
    assert not [warning for warning in caught if "dofla" in str(warning.message)]  # compiled, not eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # one program, no breaks
    assert all(layer.frozen_slot is None for layer in decoder.layers)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    token = expected[-1].argmax(-1, keepdim=True)
    with torch.no_grad():
        after = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        reference = model(input_ids=token, past_key_values=expected_cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(after, reference, rtol=1e-4, atol=1e-4)


def test_the_compiled_whole_step_holds_kept_softmax_layers_and_windows_in_their_general_form():
    """Straight after a prefill (no ordinary step) the windows are in their general form: the whole step
    compiles that form, beside a layer kept as softmax."""
    model = partly_converted("llama", 0)
    prompt = prompt_of()
    expected, _ = eager_decode(model, prompt, steps=5)
    got, _ = frozen_decode(model, prompt, steps=5, graph=False, compiled=True, room=8)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("cell", ["gla", "gated_delta", "linear"])
def test_compiled_greedy_generation_waits_for_full_rings_after_a_short_prompt(cell, monkeypatch):
    """A prompt shorter than the window: ordinary steps until every ring hides no slot, then the frozen step
    holds them all as rings (their slots advanced on the device); the tokens are ordinary greedy decoding's.
    The program runs eagerly here (compiled for real above)."""
    import dofla.graph_decode as graph_decode

    monkeypatch.setattr(graph_decode, "compiled_method", lambda method, what: method)
    built = []
    real_init = CapturedDecoder.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append((args[3], sum(layer.frozen_slot is not None for layer in self.layers)))

    monkeypatch.setattr(CapturedDecoder, "__init__", init)
    model = converted("llama", cell, kind="hybrid")
    if cell == "linear":  # the linear cell over Hedgehog features (a non-negative map)
        model = build_tiny_model("llama", seed=0)
        plan = plan_for(
            model, kind="hybrid", feature_dim=8, window=4, sinks=2, cell="linear", feature_map="hedgehog"
        )
        convert(model, plan)
        model.eval()
    prompt = prompt_of(length=3)
    expected, _ = eager_decode(model, prompt, steps=13)
    tokens = generate_greedy(model, prompt, 14, compiled=True)
    wanted = torch.cat([prompt, *(logits.argmax(-1, keepdim=True) for logits in expected)], dim=1)
    assert torch.equal(tokens, wanted)
    layers = len(students(model))
    assert len(built) == 1 and built[0][1] == layers  # every window held as a ring
    assert 4 + 2 <= built[0][0] <= 3 + 1 + 4 + 2  # after the window's and sinks' fill, within a window more


def test_a_whole_step_that_cannot_compile_warns_once_and_decodes_eagerly(monkeypatch):
    import dofla.ops.compiled as compiled_ops

    def failing_compile(function, **options):
        def run(*args, **kwargs):
            from torch._inductor.exc import InvalidCxxCompiler

            raise InvalidCxxCompiler()  # what inductor raises on a machine without a C++ compiler

        return run

    monkeypatch.setattr(compiled_ops.torch, "compile", failing_compile)
    monkeypatch.setattr(compiled_ops, "_FAILED", set())
    model = converted("llama", "gated_delta", kind="hybrid")
    prompt = prompt_of()
    expected, _ = eager_decode(model, prompt, steps=4)
    with pytest.warns(UserWarning, match="compiling the whole decoding step failed") as caught:
        got, _ = frozen_decode(model, prompt, steps=4, graph=False, compiled=True)
        again, _ = frozen_decode(model, prompt, steps=4, graph=False, compiled=True)  # not tried again
    assert sum("whole decoding step" in str(warning.message) for warning in caught) == 1
    for actual, reference in zip([*got, *again], [*expected, *expected], strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(DoflaError, match="not both"):
        CapturedDecoder(model, DynamicCache(config=model.config), 2, 11, graph=True, compiled=True)


def test_models_a_graph_cannot_hold_are_refused_with_the_reason():
    model = converted("llama", "gated_delta", kind="hybrid")
    cache = DynamicCache(config=model.config)
    prefill(model, prompt_of(length=3), cache)  # shorter than the window: its state still grows
    decoder = CapturedDecoder(model, cache, 2, 3, graph=False)
    with pytest.raises(DoflaError, match="a window still filling"):
        decoder.step(torch.zeros(2, 1, dtype=torch.long))
    partly = partly_converted("llama", converted_layer=0)
    cache = DynamicCache(config=partly.config)
    prefill(partly, prompt_of(), cache)
    with pytest.raises(DoflaError, match="give the number of steps"):
        CapturedDecoder(partly, cache, 2, 11, graph=False)
    decoder = CapturedDecoder(partly, cache, 2, 11, graph=False, steps=1)
    decoder.step(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(DoflaError, match="built for 1 steps"):
        decoder.step(torch.zeros(2, 1, dtype=torch.long))
    decoder.finish()
    cache = DynamicCache(config=partly.config)
    prefill(partly, prompt_of(), cache)
    plain = DynamicLayer()  # the kept layer's keys in transformers' own layer, not a converted prefill's
    plain.update(cache.layers[1].keys, cache.layers[1].values)
    cache.layers[1] = plain
    with pytest.raises(DoflaError, match="layer 1, kept as softmax, holds DynamicLayer"):
        CapturedDecoder(partly, cache, 2, 11, graph=False, steps=2)
    for family in ("gemma2", "mistral"):  # gemma2's layer 0 and every mistral layer: a sliding window
        sliding = partly_converted(family, converted_layer=1)
        with pytest.raises(DoflaError, match="layer 0, kept as softmax, keeps its keys in a DynamicSliding"):
            CapturedDecoder(sliding, DynamicCache(config=sliding.config), 2, 11, graph=False, steps=2)
    linear = converted("llama", "linear")
    with pytest.raises(DoflaError, match="prefill the prompt"):
        CapturedDecoder(linear, DynamicCache(config=linear.config), 2, 11, graph=False)
    if not torch.cuda.is_available():
        cache = DynamicCache(config=linear.config)
        prefill(linear, prompt_of(), cache)
        with pytest.raises(DoflaError, match="CUDA device"):
            CapturedDecoder(linear, cache, 2, 11, graph=True)
        assert not any(layer.frozen for layer in recurrent_layers(cache))  # nothing left switched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_captured_graph_with_kept_softmax_layers_replays_the_eager_step_on_gpu(dtype):
    model = partly_converted("llama", 1, dtype=dtype, device="cuda")
    prompt = prompt_of(device="cuda")
    results = []
    for graph in (False, True):
        logits, cache = eager_decode(model, prompt, 0)
        decoder = CapturedDecoder(model, cache, 2, prompt.shape[1], graph=graph, steps=8)
        for _ in range(8):
            logits.append(decoder.step(logits[-1].argmax(-1, keepdim=True)).clone())
        decoder.finish()
        results.append(logits)
    for step, (actual, reference) in enumerate(zip(results[1], results[0], strict=True)):
        torch.testing.assert_close(
            actual.float(), reference.float(), rtol=1e-3, atol=1e-3, msg=f"step {step}"
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["linear", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cell", PLANS)
def test_the_captured_graph_replays_the_eager_step_on_gpu(cell, dtype, kind):
    model = converted("llama", cell, dtype=dtype, device="cuda", kind=kind)
    prompt = prompt_of(device="cuda")
    expected, _ = frozen_decode(model, prompt, steps=8, graph=False)
    got, _ = frozen_decode(model, prompt, steps=8, graph=True)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(
            actual.float(), reference.float(), rtol=1e-3, atol=1e-3, msg=f"step {step}"
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_the_captured_graph_wraps_a_position_period_as_the_eager_step_on_gpu(kind):
    """The period crossed inside the graph (prompt 11, period 13, 8 steps): the positions wrapped on the
    device at every replay (at the rotary embedding, or in each layer with a window)."""
    from dofla.convert import set_position_period

    model = converted("llama", "gated_delta", device="cuda", kind=kind)
    set_position_period(model, 13)
    prompt = prompt_of(device="cuda")
    expected, _ = frozen_decode(model, prompt, steps=8, graph=False)
    got, _ = frozen_decode(model, prompt, steps=8, graph=True)
    for step, (actual, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(actual, reference, rtol=1e-3, atol=1e-3, msg=f"step {step}")


def test_measure_generation_decodes_through_the_decoder_when_asked():
    from dofla.evaluation.speed import measure_generation

    model = converted("llama", "gated_delta")
    plain = measure_generation(model, context_lengths=[9], batch_size=2, new_tokens=3)[0]
    assert "capture_seconds" not in plain
    rows = measure_generation(model, context_lengths=[9], batch_size=2, new_tokens=3, graph=True)
    assert rows[0]["capture_seconds"] >= 0.0
    assert rows[0]["cache_bytes_after_decode"] == plain["cache_bytes_after_decode"] > 0


def test_generate_greedy_streams_like_transformers_generate_and_stops_at_the_end_token():
    from transformers import TextStreamer

    from dofla.models import build_tiny_tokenizer

    model, tokenizer = converted("llama", "gated_delta"), build_tiny_tokenizer()
    prompt = tokenizer("The cat sat", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    printed = []
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    streamer.on_finalized_text = lambda text, stream_end=False: printed.append(text)
    got = generate_greedy(model, prompt, 6, graph=False, prefill_chunk=2, on_tokens=streamer.put)
    streamer.end()
    assert torch.equal(got, expected)
    assert "".join(printed) == tokenizer.decode(expected[0], skip_special_tokens=True)
    first = int(expected[0, prompt.shape[1]])
    stopped = generate_greedy(model, prompt, 6, graph=False, eos_token_id=first)
    assert torch.equal(stopped, expected[:, : prompt.shape[1] + 1])
