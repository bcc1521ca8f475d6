"""Capture of q/k/v and teacher attention outputs: shapes, exact reproduction, model left unchanged."""

import pytest
import torch

from dofla.errors import DoflaError
from dofla.models import TINY_FAMILIES, build_tiny_model, capture_attention, get_adapter

SEQ_LEN = 12  # longer than the tiny sliding window (8), so windowed layers differ from full ones


def reference_attention(query, key, value, *, scaling, window=None, softcap=None):
    """Plain causal softmax attention: query (B, H, T, D), key/value (B, Hkv, T, D) -> (B, T, H, D)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # (B, H, T, D)
    value = value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling  # (B, H, T, T)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(query.shape[2])
    distance = positions[:, None] - positions[None, :]  # (T, T) query minus key position
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)  # (B, T, H, D)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_capture_shapes_and_reproduces_teacher_output(family):
    model = build_tiny_model(family)
    adapter = get_adapter(model)
    batches = [
        torch.randint(3, 128, (2, SEQ_LEN), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    before = model(input_ids=batches[0]).logits
    implementation = model.config._attn_implementation

    results = list(capture_attention(model, batches))

    assert len(results) == 2
    assert model.config._attn_implementation == implementation
    torch.testing.assert_close(model(input_ids=batches[0]).logits, before, rtol=0, atol=0)
    H, Hkv, D = adapter.num_heads, adapter.num_kv_heads, adapter.head_dim
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    for captured in results:
        assert sorted(captured) == list(range(adapter.num_layers))
        for layer, tensors in captured.items():
            assert tensors["query"].shape == (2, H, SEQ_LEN, D)
            assert tensors["key"].shape == (2, Hkv, SEQ_LEN, D)
            assert tensors["value"].shape == (2, Hkv, SEQ_LEN, D)
            assert tensors["output"].shape == (2, SEQ_LEN, H, D)
            assert not tensors["query"].requires_grad
            window = adapter.sliding_window if adapter.layer_kinds[layer] == "sliding" else None
            expected = reference_attention(
                tensors["query"],
                tensors["key"],
                tensors["value"],
                scaling=adapter.attention_scaling(layer, model),
                window=window,
                softcap=softcap,
            )
            torch.testing.assert_close(tensors["output"], expected, rtol=1e-4, atol=1e-5)


def test_sliding_window_layers_really_are_windowed():
    """The windowed reference must differ from the full one on a sliding layer (else the check above is vacuous)."""
    model = build_tiny_model("mistral")
    adapter = get_adapter(model)
    (captured,) = capture_attention(model, [torch.randint(3, 128, (1, SEQ_LEN))], layers=[0])
    tensors = captured[0]
    full = reference_attention(
        tensors["query"], tensors["key"], tensors["value"], scaling=adapter.attention_scaling(0, model)
    )
    assert (full - tensors["output"]).abs().max() > 1e-3


def test_capture_selects_layers_fields_and_dtype():
    model = build_tiny_model("llama")
    (captured,) = capture_attention(
        model, [torch.randint(3, 128, (1, 6))], layers=[1], fields=("key",), dtype=torch.float64
    )
    assert list(captured) == [1]
    assert list(captured[1]) == ["key"]
    assert captured[1]["key"].dtype == torch.float64


def test_capture_is_streamed_and_keeps_callers_grad_mode():
    model = build_tiny_model("qwen2")
    seen = []

    def batches():
        for index in range(3):
            seen.append(index)
            yield torch.randint(3, 128, (1, 6))

    stream = capture_attention(model, batches())
    next(stream)
    assert seen == [0]  # one batch at a time
    assert torch.is_grad_enabled()  # the no_grad block does not leak into the caller between batches
    assert len(list(stream)) == 2


def test_capture_rejects_unknown_field():
    model = build_tiny_model("gpt2")
    with pytest.raises(DoflaError, match="unknown capture field"):
        next(capture_attention(model, [torch.zeros(1, 4, dtype=torch.long)], fields=("queries",)))
