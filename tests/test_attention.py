"""LinearAttention: its forms agree (forward and gradients), GQA sharing, padding, cache continuation, errors."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_student_forms_agree

from dofla.attention import LinearAttention
from dofla.cache import RecurrentCacheLayer
from dofla.config import LayerPlan
from dofla.errors import DoflaError
from dofla.masks import key_mask_from_attention_mask

B, H, HKV, D = 2, 4, 2, 8


def make_student(kind="linear", feature_map="learnable_prf", share=True, dims=None, window=5, **options):
    feature_dim = max(dims) if dims else 6
    plan = LayerPlan(
        kind=kind,
        feature_map=feature_map,
        feature_dim=feature_dim,
        head_feature_dims=dims,
        share_kv_heads=share,
        window=window,
        options={"chunk_size": 4, **options},
    )
    torch.manual_seed(0)
    return LinearAttention(plan, layer_index=1, num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5)


def qkv(length=11, dtype=torch.float64, seed=1):
    generator = torch.Generator().manual_seed(seed)

    def draw(heads):
        return torch.randn(B, heads, length, D, generator=generator, dtype=dtype).requires_grad_()

    return draw(H), draw(HKV), draw(HKV)


CASES = [
    ("linear", "learnable_prf", True, None),
    ("linear", "hedgehog", False, None),
    ("linear", "learnable_prf", True, [3, 6]),
    ("hybrid", "learnable_prf", True, None),
    ("hybrid", "t2r", False, None),
]


@pytest.mark.parametrize("kind, feature_map, share, dims", CASES)
def test_forms_agree_forward_and_gradients(kind, feature_map, share, dims):
    student = make_student(kind, feature_map, share, dims).double()
    query, key, value = qkv()
    output, _ = assert_student_forms_agree(student, query, key, value)
    assert output.shape == (B, 11, H, D)


def test_feature_shapes_follow_head_sharing():
    query, key, _ = qkv(dtype=torch.float32)
    shared = make_student(share=True)
    q_features, k_features, k_log_scale = shared.features(query, key)
    assert q_features.shape == (B, H, 11, 6)
    assert k_features.shape == (B, HKV, 11, 6) and k_log_scale.shape == (B, HKV, 11)
    assert shared.feature_map.num_heads == HKV and shared.state_heads == HKV
    separate = make_student(share=False)
    _, k_features, _ = separate.features(query, key)
    assert k_features.shape == (B, H, 11, 6) and separate.feature_map.num_heads == H


def test_shared_map_equals_per_query_head_map_with_repeated_parameters():
    """Sharing is exactly 'each query head uses its group's map': copy the map to every query head."""
    shared, separate = make_student(share=True).double(), make_student(share=False).double()
    with torch.no_grad():
        separate.feature_map.z.copy_(shared.feature_map.z.repeat_interleave(H // HKV, dim=0))
        shared.feature_map.log_alpha.copy_(torch.randn_like(shared.feature_map.log_alpha))
        separate.feature_map.log_alpha.copy_(shared.feature_map.log_alpha.repeat_interleave(H // HKV, dim=0))
    query, key, value = qkv()
    torch.testing.assert_close(shared(query, key, value), separate(query, key, value), rtol=1e-10, atol=1e-12)


def test_chunked_prefill_then_recurrent_decode_equals_one_pass():
    for kind in ("linear", "hybrid"):
        student = make_student(kind).double()
        query, key, value = (tensor.detach() for tensor in qkv(length=13))
        full = student(query, key, value)
        layer = RecurrentCacheLayer()
        pieces = []
        # prefill (chunked), 2 decode steps (recurrent), a longer chunk continuing from the state (chunked)
        for start, stop in ((0, 5), (5, 6), (6, 7), (7, 13)):
            layer.update(key[:, :, start:stop], value[:, :, start:stop])
            student.pending_cache_layer = layer
            pieces.append(student(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]))
            assert student.pending_cache_layer is None  # taken once per call
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
        assert layer.get_seq_length() == 13 and layer.state.num_tokens == 13
        assert layer.get_mask_sizes(1) == (14, 0)


@pytest.mark.parametrize("kind", ["linear", "hybrid"])
def test_left_padding_is_ignored(kind):
    """A left-padded row gives the outputs of the same row without padding, on its real tokens."""
    student = make_student(kind).double()
    query, key, value = (tensor.detach() for tensor in qkv(length=9))
    pad = 3
    real = torch.ones(B, 9, dtype=torch.bool)
    real[0, :pad] = False
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    mask = (causal[None] & real[:, None, :])[:, None]  # (B, 1, T, T) as transformers builds it
    for form in ("naive", "chunked", "recurrent"):
        padded = student(query, key, value, mask, form=form)
        alone = student(query[:1, :, pad:], key[:1, :, pad:], value[:1, :, pad:], form=form)
        torch.testing.assert_close(padded[:1, pad:], alone, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(padded[1:], student(query[1:], key[1:], value[1:], form=form))


def test_key_mask_from_boolean_and_additive_masks():
    real = torch.tensor([[False, True, True], [True, True, True]])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    boolean = (causal[None] & real[:, None, :])[:, None]  # (B, 1, 3, 3)
    assert torch.equal(key_mask_from_attention_mask(boolean, 3), real)
    additive = torch.zeros(2, 1, 3, 3).masked_fill(~boolean, torch.finfo(torch.float32).min)
    assert torch.equal(key_mask_from_attention_mask(additive, 3), real)
    assert key_mask_from_attention_mask(boolean[1:], 3) is None  # no padding at all
    assert key_mask_from_attention_mask(None, 3) is None
    # decode step: one query over 4 cached + new columns; only the new key's column matters
    step = torch.tensor([[[[False, True, True, True]]]])
    assert key_mask_from_attention_mask(step, 1) is None


def test_window_factor_initialisation_and_parameter_groups():
    hybrid = make_student("hybrid", window_factor=0.25)
    torch.testing.assert_close(hybrid.window_factor(), torch.full((H,), 0.25))
    assert make_student("hybrid").window_factor()[0].item() == pytest.approx(0.1)
    groups = {group["name"]: group for group in hybrid.parameter_groups(0.01)}
    assert (
        groups["z"]["lr"] == 0.02 and groups["alpha"]["lr"] == 0.2 and groups["window_factor"]["lr"] == 0.01
    )
    assert len(hybrid.trainable_parameters()) == 3
    assert make_student("linear").window_factor() is None


def test_random_features_differ_by_layer_unless_seeded():
    plan = LayerPlan(kind="linear", feature_map="prf", feature_dim=4)
    first, second = (
        LinearAttention(plan, layer_index=i, num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=0.3)
        for i in (0, 1)
    )
    assert not torch.equal(first.feature_map.random_directions, second.feature_map.random_directions)
    seeded = LayerPlan(kind="linear", feature_map="prf", feature_dim=4, options={"seed": 7})
    first, second = (
        LinearAttention(seeded, layer_index=i, num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=0.3)
        for i in (0, 1)
    )
    assert torch.equal(first.feature_map.random_directions, second.feature_map.random_directions)


def test_bf16_inputs_give_finite_outputs_of_input_dtype():
    student = make_student("hybrid")
    query, key, value = (
        tensor.detach().to(torch.bfloat16) * 8 for tensor in qkv(length=40, dtype=torch.float32)
    )
    output = student(query, key, value)
    assert output.dtype == torch.bfloat16 and torch.isfinite(output).all()


def test_bad_inputs_are_refused():
    with pytest.raises(DoflaError, match="kind linear or hybrid"):
        LinearAttention(
            LayerPlan(kind="softmax"), layer_index=0, num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=1
        )
    with pytest.raises(DoflaError, match="feature dimension must be positive"):
        LinearAttention(
            LayerPlan(feature_dim=0), layer_index=0, num_heads=H, num_kv_heads=HKV, head_dim=D, scaling=1
        )
    with pytest.raises(DoflaError, match="window_factor"):
        make_student("hybrid", window_factor=1.5)
    student = make_student()
    query, key, value = qkv(dtype=torch.float32)
    with pytest.raises(DoflaError, match="keys for"):
        student(query, torch.cat([key, key], dim=2), torch.cat([value, value], dim=2))
    with pytest.raises(DoflaError, match="unknown attention form"):
        student(query, key, value, form="fast")
    with pytest.raises(DoflaError, match="query and"):
        student(query[:, :3], key, value)


def test_gamma_logit_is_exact():
    student = make_student("hybrid")
    assert student.window_factor_logit[0].item() == pytest.approx(math.log(0.1 / 0.9))
