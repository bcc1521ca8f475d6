"""Decoding through the recurrent cache: prefill + token-by-token equals one full forward on every family,
generate() (greedy, sampling, beams), padding, constant cache memory, and the `dofla generate` command."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dofla.cache import GrowingKVLayer, RecurrentCacheLayer, held_bytes, recurrent_cache_bytes
from dofla.config import LayerPlan
from dofla.convert import convert, plan_for, unconvert
from dofla.errors import DoflaError
from dofla.models import TINY_FAMILIES, build_tiny_model
from dofla.models.tiny import TINY_VOCAB

VOCAB = TINY_VOCAB
FAMILIES = list(TINY_FAMILIES)


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random 2-layer model of ``family`` (4 heads, 2 key/value heads where the family has GQA)."""
    return build_tiny_model(family, seed=seed)


def mixed_plan(model):
    """Layer 0 linear, layer 1 left as softmax."""
    plan = plan_for(model, kind="linear", feature_map="learnable_prf", feature_dim=8, layers=[0])
    assert [layer.kind for layer in plan.layers] == ["linear", "softmax"]
    return plan


def every_layer(**arguments):
    """A uniform plan over every layer, the teacher's own sliding-window layers too (mistral's, gemma's)."""
    return lambda model: plan_for(model, feature_dim=8, convert_windowed=True, **arguments)


PLANS = {
    "linear": every_layer(kind="linear", feature_map="learnable_prf"),
    "hybrid": every_layer(kind="hybrid", feature_map="hedgehog", window=4),
    "mixed": mixed_plan,
    "gla": every_layer(kind="linear", cell="gla", feature_map="hedgehog"),
    "gla_hybrid": every_layer(kind="hybrid", cell="gla", feature_map="learnable_prf", window=4, sinks=2),
    "gated_delta": every_layer(
        kind="hybrid", cell="gated_delta", feature_map="projection", window=4, sinks=2
    ),
}


def decode_logits(model, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens then one token at a time through one cache: (B, T, V)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        pieces = [model(tokens[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for position in range(prefill, tokens.shape[1]):
            step = tokens[:, position : position + 1]
            pieces.append(model(step, past_key_values=cache, use_cache=True).logits)
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("plan_name", sorted(PLANS))
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_equals_full_forward(family, plan_name):
    model = tiny_model(family)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        teacher = model(tokens).logits
    convert(model, PLANS[plan_name](model))
    with torch.no_grad():
        full = model(tokens).logits
    assert (full - teacher).abs().max() > 1e-3  # the students really run
    torch.testing.assert_close(decode_logits(model, tokens, prefill=11), full, rtol=1e-4, atol=1e-4)


def test_cache_memory_is_constant_for_linear_layers_and_bounded_for_hybrid():
    model = tiny_model("llama")
    plan = plan_for(model, kind="linear", feature_dim=8)
    plan.layers[1] = LayerPlan(kind="hybrid", feature_map="learnable_prf", feature_dim=8, window=4)
    convert(model, plan)
    cache = DynamicCache(config=model.config)
    sizes = []
    with torch.no_grad():
        logits = model(torch.randint(0, VOCAB, (1, 6)), past_key_values=cache, use_cache=True).logits
        for _ in range(30):
            next_token = logits[:, -1:].argmax(-1)
            logits = model(next_token, past_key_values=cache, use_cache=True).logits
            sizes.append(
                (recurrent_cache_bytes(cache), cache.layers[0].state.nbytes(), cache.layers[1].state.nbytes())
            )
    assert all(isinstance(layer, RecurrentCacheLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 36
    assert len({size[1] for size in sizes}) == 1  # linear layer: the same bytes after 1 or 30 new tokens
    assert len({size[2] for size in sizes}) == 1  # hybrid layer: window already full after the prefill
    assert all(layer.keys.numel() == 0 for layer in cache.layers)
    linear_state = cache.layers[0].state
    assert linear_state.kv.shape == (1, 2, 8, 16)  # (B, Hkv, F, Dv): per key/value head
    assert cache.layers[1].state.general_layout().keys.shape[2] == 4  # only the window's keys


def test_held_bytes_counts_each_storage_whole_and_once():
    tensor = torch.zeros(4, 100)
    assert held_bytes(tensor[:, :0]) == 1600  # a zero-length slice keeps its whole storage alive
    assert held_bytes(tensor, tensor[1:2], [tensor.t()], {"a": tensor}) == 1600
    assert held_bytes(tensor, torch.zeros(3)) == 1612


@pytest.mark.parametrize("plan_name", ["linear", "hybrid", "gated_delta", "mixed"])
def test_the_cache_holds_only_the_state_after_a_prefill_and_after_generate(plan_name):
    model = tiny_model("llama")
    convert(model, PLANS[plan_name](model))
    prompt = torch.randint(1, VOCAB, (1, 200), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        generated = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
    for held in (cache, generated.past_key_values):
        state = recurrent_cache_bytes(held)
        kept = sum(layer.nbytes() for layer in held.layers if isinstance(layer, GrowingKVLayer))
        assert state > 0 and held_bytes(held) == state + kept


def test_mixed_plan_keeps_softmax_cache_for_softmax_layers():
    model = tiny_model("llama")
    convert(model, mixed_plan(model))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 9)), past_key_values=cache, use_cache=True)
    assert isinstance(cache.layers[0], RecurrentCacheLayer)
    assert isinstance(cache.layers[1], GrowingKVLayer) and cache.layers[1].keys.shape[2] == 9
    unconvert(model)  # the teacher again: its cache layers are transformers' own
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 9)), past_key_values=cache, use_cache=True)
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, DynamicLayer]


def random_kv(generator, batch=2, tokens=1):
    return [torch.randn(batch, 2, tokens, 4, generator=generator) for _ in range(2)]


def test_growing_kv_layer_equals_dynamic_layer_through_growth_and_cache_operations(monkeypatch):
    monkeypatch.setattr(GrowingKVLayer, "SPARE", 2)  # grow often
    generator = torch.Generator().manual_seed(0)
    growing, dynamic = GrowingKVLayer(), DynamicLayer()

    def both(*operation):
        name, *arguments = operation
        for layer in (growing, dynamic):
            getattr(layer, name)(*arguments)

    def update(tokens, batch=2):
        keys, values = random_kv(generator, batch, tokens)
        got, expected = growing.update(keys, values), dynamic.update(keys, values)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        assert growing.get_seq_length() == dynamic.get_seq_length()
        assert growing.get_mask_sizes(1) == dynamic.get_mask_sizes(1)

    update(5)
    buffer = growing.buffers[0]
    update(1)
    update(1)
    assert growing.buffers[0] is buffer  # written into its spare room, not copied
    for _ in range(20):  # past the room: grows by a quarter, keeps what it held
        update(1)
    assert growing.buffers[0].shape[2] > growing.get_seq_length() == 27
    assert growing.nbytes() == 2 * growing.buffers[0].numel() * 4  # the spare room counts
    both("crop", -3)
    update(2)
    both("reorder_cache", torch.tensor([1, 0]))
    update(1)
    both("batch_repeat_interleave", 2)
    update(1, batch=4)
    both("batch_select_indices", torch.tensor([0, 3]))
    update(3)
    both("reset")
    update(4)


def test_growing_kv_layer_under_autograd_concatenates():
    generator = torch.Generator().manual_seed(1)
    layer = GrowingKVLayer()
    first = [tensor.requires_grad_() for tensor in random_kv(generator, tokens=3)]
    keys, _ = layer.update(*first)
    second = [tensor.requires_grad_() for tensor in random_kv(generator)]
    keys, values = layer.update(*second)
    (keys.sum() + values.square().sum()).backward()  # no tensor autograd kept was changed in place
    assert layer.buffers is None and torch.equal(first[0].grad, torch.ones_like(first[0]))


def test_a_kept_layer_prefilled_in_inference_mode_decodes_outside_it():
    model = tiny_model("llama")
    convert(model, mixed_plan(model))
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(tokens[:, :8], past_key_values=cache)
    assert cache.layers[1].buffers[0].is_inference()
    with torch.no_grad():
        last = model(tokens[:, 8:], past_key_values=cache).logits
        full = model(tokens).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-4, atol=1e-4)


def test_kept_softmax_layer_decodes_through_many_growths(monkeypatch):
    monkeypatch.setattr(GrowingKVLayer, "SPARE", 1)
    model = tiny_model("qwen2")
    convert(model, mixed_plan(model))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens).logits
    torch.testing.assert_close(decode_logits(model, tokens, prefill=3), full, rtol=1e-4, atol=1e-4)


def test_generate_greedy_equals_argmax_of_full_forwards():
    model = tiny_model("qwen3")
    convert(model, PLANS["hybrid"](model))
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected = prompt
        for _ in range(8):
            next_token = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected)


def test_generate_sampling_is_reproducible_and_in_vocabulary():
    model = tiny_model("gpt2")
    convert(model, PLANS["linear"](model))
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        with torch.no_grad():
            runs.append(
                model.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=6,
                    do_sample=True,
                    top_p=0.9,
                    temperature=1.5,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            )
    assert runs[0].shape == (2, 11) and torch.equal(runs[0], runs[1])
    assert int(runs[0].max()) < VOCAB


def test_left_padded_batch_equals_unpadded_rows():
    """Batched prefill with left padding and decoding: each row's logits match that row decoded alone."""
    model = tiny_model("llama")
    convert(model, PLANS["hybrid"](model))
    generator = torch.Generator().manual_seed(4)
    short, long_ = (
        torch.randint(1, VOCAB, (1, 6), generator=generator),
        torch.randint(1, VOCAB, (1, 9), generator=generator),
    )
    steps = torch.randint(1, VOCAB, (2, 3), generator=generator)
    pad = long_.shape[1] - short.shape[1]
    tokens = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long_])  # (2, 9)
    mask = torch.ones_like(tokens)
    mask[0, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        batched = [
            model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
        ]
        for index in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            positions = positions[:, -1:] + 1
            batched.append(
                model(
                    steps[:, index : index + 1],
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                ).logits[:, -1]
            )
        for row, prompt in enumerate((short, long_)):
            alone = decode_logits(
                model, torch.cat([prompt, steps[row : row + 1]], 1), prefill=prompt.shape[1]
            )
            torch.testing.assert_close(
                torch.stack([logits[row] for logits in batched]),
                alone[0, prompt.shape[1] - 1 :],
                rtol=1e-4,
                atol=1e-4,
            )


def test_beam_reordering_moves_states_with_their_rows():
    model = tiny_model("llama")
    convert(model, PLANS["hybrid"](model))
    tokens = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(5))
    order = torch.tensor([2, 0, 2])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens[:, :9], past_key_values=cache)
        cache.reorder_cache(order)
        reordered = model(tokens[order, 9:], past_key_values=cache).logits
    expected = decode_logits(model, tokens[order], prefill=9)[:, -1:]
    torch.testing.assert_close(reordered, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        beams = model.generate(
            tokens[:1, :4],
            attention_mask=torch.ones(1, 4, dtype=torch.long),
            max_new_tokens=4,
            num_beams=2,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert beams.shape == (1, 8)


def test_cache_refuses_crop_and_prefilled_softmax_cache():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    tokens = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        model(tokens, past_key_values=cache)  # softmax keys from before the conversion
    convert(model, PLANS["linear"](model))
    with pytest.raises(DoflaError, match="already holds 5 softmax keys"):
        model(tokens[:, :1], past_key_values=cache)
    fresh = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens, past_key_values=fresh)
    fresh.crop(0)  # nothing to remove is fine
    with pytest.raises(DoflaError, match="cannot be cropped"):
        fresh.crop(-1)


def test_static_cache_is_refused():
    model = tiny_model("llama")
    convert(model, PLANS["linear"](model))
    prompt = torch.randint(1, VOCAB, (1, 4))
    with pytest.raises(DoflaError, match="static caches are not supported"):
        model.generate(prompt, max_new_tokens=2, cache_implementation="static", pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batched_left_padded_generate_equals_each_prompt_alone(family):
    model = tiny_model(family)
    convert(model, PLANS["hybrid"](model))
    generator = torch.Generator().manual_seed(0)
    short, long_ = (torch.randint(3, VOCAB, (1, length), generator=generator) for length in (5, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long_])  # left padding
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, **options)
        alone = [
            model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
            for prompt in (short, long_)
        ]
    assert torch.equal(together[0, 4:], alone[0][0]) and torch.equal(together[1], alone[1][0])
