"""Rotary positions modulo a period in the converted layers' memories (dofla.rotary, ``position_period``).

The reference is the model itself: a converted model without a window has no softmax anywhere, so with a
period its logits must equal the same model run at wrapped position ids (the teacher's own rotary at
p mod P); decoding token by token must equal the full forward with the period (every form and the fast
decoding step); a window keeps the true positions; below the period nothing changes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from dofla.convert import convert, plan_for, set_position_period
from dofla.errors import DoflaError
from dofla.loading import load_converted
from dofla.models import build_tiny_model
from dofla.models.surgery import students
from dofla.models.tiny import TINY_VOCAB
from dofla.rotary import period_turns, rotary_frequencies, rotate_by, turns_of, wrap_angles
from dofla.saving import save_converted

LINEAR = dict(kind="linear", feature_map="learnable_prf", feature_dim=8)
PLANS = {
    "linear": LINEAR,
    "gated_delta_conv": dict(
        kind="linear", cell="gated_delta", feature_map="projection", feature_dim=8, options={"short_conv": 3}
    ),
    "gla_hybrid": dict(kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=4, sinks=2),
    "gated_delta_hybrid": dict(
        kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=8, window=4, sinks=2
    ),
    "linear_beside_softmax": dict(LINEAR, layers=[0]),  # layer 1 kept as softmax: per-layer rotations
}


def tokens(length: int = 40, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) turned by ``angles`` (B, 1, T, r/2) float32, in x's dtype."""
    return rotate_by(x, *turns_of(angles, x.dtype))


def converted(family: str, plan: dict, period: int | None = None, seed: int = 0):
    model = build_tiny_model(family, seed=seed)
    convert(model, plan_for(model, **plan))
    if period is not None:
        set_position_period(model, period)
    return model


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3"])
def test_rotating_back_equals_the_teachers_rotary_at_the_wrapped_positions(family):
    """rotate(rotary(q, p), wrap_angles(p)) == rotary(q, p mod P) with the family's own rotary module
    (GPT-NeoX rotates only part of each head)."""
    from importlib import import_module

    model = build_tiny_model(family)
    frequencies = rotary_frequencies(model)
    embedding = next(m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor))
    module = import_module(type(model).__module__)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    query = torch.randn(2, 3, 50, head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(50)[None].expand(2, 50)

    def rotary(x, position_ids):
        cos, sin = embedding(x, position_ids)
        rotated = module.apply_rotary_pos_emb(x, x, cos, sin)[0]
        return rotated

    if family == "gpt_neox":  # its rotary covers the first rotary_ndims dimensions only
        dims = cos_dims = embedding(query, positions)[0].shape[-1]
        assert cos_dims < head_dim

        def rotary(x, position_ids):  # noqa: F811
            cos, sin = embedding(x, position_ids)
            turned = module.apply_rotary_pos_emb(x[..., :dims], x[..., :dims], cos, sin)[0]
            return torch.cat([turned, x[..., dims:]], dim=-1)

    wrapped = rotate(rotary(query, positions), wrap_angles(positions, 16, frequencies))
    torch.testing.assert_close(wrapped, rotary(query, positions % 16), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch_positions", [1, 3])
@pytest.mark.parametrize("dim", [8, 12])  # 12: two dimensions past the rotary planes stay unchanged
def test_one_tokens_turn_as_a_matrix_equals_the_rotation(batch_positions, dim):
    """A decoding step turns its token by one product with a matrix (``Turns.matrix``): the same as
    ``rotate_by``'s slices and products, forward and gradients, for one position per batch or per row."""
    frequencies = torch.tensor([1.0, 0.3, 0.05, 0.01, 0.002][: min(5, dim // 2 - 1)])
    positions = torch.tensor([[37], [5], [100]])[:batch_positions]
    turns = period_turns(positions, 1, 16, frequencies, torch.float32, dim)
    assert turns is not None and turns.matrix.shape == ((dim, dim) if batch_positions == 1 else (3, dim, dim))
    x = torch.randn(3, 4, 1, dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    slow = rotate_by(x, turns.cos, turns.sin)
    fast = turns(x)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast, rotate(x, wrap_angles(positions, 16, frequencies)))
    weights = torch.randn(fast.shape, generator=torch.Generator().manual_seed(2))
    (slow_grad,) = torch.autograd.grad((slow * weights).sum(), x)
    (fast_grad,) = torch.autograd.grad((fast * weights).sum(), x)
    torch.testing.assert_close(fast_grad, slow_grad, rtol=1e-6, atol=1e-6)
    several = torch.randn(3, 4, 2, dim)  # more than one token: the rotation, not the matrix
    two = period_turns(torch.tensor([[30, 31]]), 2, 16, frequencies, torch.float32, dim)
    assert two.matrix is None
    torch.testing.assert_close(two(several), rotate_by(several, two.cos, two.sin))


def test_period_turns_are_kept_per_positions_tensor_and_none_below_the_period():
    frequencies = torch.tensor([1.0, 0.1])
    positions = torch.arange(30)[None]
    first = period_turns(positions, 1, 16, frequencies, torch.float32, 4)
    assert period_turns(positions, 1, 16, frequencies, torch.float32, 4) is first  # the next layer's call
    positions += 1  # changed in place: computed again
    assert period_turns(positions, 1, 16, frequencies, torch.float32, 4) is not first
    assert period_turns(torch.arange(16)[None], 16, 16, frequencies, torch.float32, 4) is None


@pytest.mark.parametrize("plan_name", ["linear", "gated_delta_conv"])
def test_a_model_without_a_window_equals_itself_at_wrapped_positions(plan_name):
    model = converted("llama", PLANS[plan_name])
    ids = tokens()
    with torch.no_grad():
        true_positions = model(ids).logits
        wrapped_positions = model(ids, position_ids=(torch.arange(40) % 16)[None].expand(2, 40)).logits
        set_position_period(model, 16)
        with_period = model(ids).logits
    assert (true_positions - wrapped_positions).abs().max() > 1e-3  # the positions matter here
    torch.testing.assert_close(with_period, wrapped_positions, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_period[:, :16], true_positions[:, :16], rtol=1e-5, atol=1e-5)


def decode_logits(model, ids: torch.Tensor, prefill: int, mode=torch.no_grad) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens then one token per call, under ``mode`` (no autograd)."""
    cache = DynamicCache(config=model.config)
    with mode():
        pieces = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for position in range(prefill, ids.shape[1]):
            pieces.append(
                model(ids[:, position : position + 1], past_key_values=cache, use_cache=True).logits
            )
    return torch.cat(pieces, dim=1)


def record_decode_steps(model) -> list:
    """What every converted layer's one-token step returns from now on (None: the general form ran)."""
    steps = []
    for student in students(model).values():

        def recorded(*args, _step=student.decode_step, **kwargs):
            steps.append(_step(*args, **kwargs))
            return steps[-1]

        student.decode_step = recorded
    return steps


@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_decoding_with_a_period_equals_the_full_forward(plan_name):
    """Prefill then token by token (the chunked, recurrent and fast decoding forms) equals one forward, with
    the period crossed in the prefill and again while decoding."""
    model = converted("llama", PLANS[plan_name], period=12)
    ids = tokens(40)
    with torch.no_grad():
        full = model(ids).logits
    steps = record_decode_steps(model)
    torch.testing.assert_close(decode_logits(model, ids, prefill=17), full, rtol=1e-4, atol=1e-4)
    assert len(steps) == (40 - 17) * len(students(model))
    assert None not in steps  # every layer, windows too, took its one-token step
    set_position_period(model, None)
    with torch.no_grad():
        assert (model(ids).logits - full).abs().max() > 1e-4  # the period changed the memories' inputs


def test_below_the_period_nothing_changes_and_a_window_keeps_true_positions():
    ids = tokens(40)
    plain = converted("llama", PLANS["gated_delta_hybrid"])
    long_period = converted("llama", PLANS["gated_delta_hybrid"], period=64)
    with torch.no_grad():
        torch.testing.assert_close(long_period(ids).logits, plain(ids).logits, rtol=0, atol=0)
    # the window alone (the memory's share at zero) does not see the period
    for model in (plain, long_period):
        for student in students(model).values():
            student.window_factor_logit.data.fill_(30.0)  # the window's share 1 - 1e-13
    set_position_period(long_period, 8)
    with torch.no_grad():
        torch.testing.assert_close(long_period(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_window_only_layer_has_no_memory_to_wrap():
    model = converted("llama", dict(kind="hybrid", cell="window", window=4, sinks=2, layers=[0]), period=12)
    assert students(model)[0].position_period is None and model.dofla_plan.position_period == 12


def test_the_period_is_saved_with_the_model(tmp_path):
    model = converted("llama", PLANS["linear"], period=16)
    ids = tokens()
    with torch.no_grad():
        expected = model(ids).logits
    save_converted(model, tmp_path / "out")
    loaded, _, plan = load_converted(tmp_path / "out")
    assert plan.position_period == 16
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_models_a_period_cannot_serve_are_refused():
    with pytest.raises(DoflaError, match="no rotary position embeddings"):
        set_position_period(converted("gpt2", LINEAR), 16)
    with pytest.raises(DoflaError, match="2 rotary embeddings"):
        set_position_period(converted("gemma3", LINEAR), 16)
    with pytest.raises(DoflaError, match="positive number of tokens"):
        set_position_period(converted("llama", LINEAR), 0)
    with pytest.raises(DoflaError, match="converted model"):
        set_position_period(build_tiny_model("llama"), 16)


def test_without_any_softmax_the_positions_are_wrapped_once_and_unconvert_removes_it():
    """Every layer converted without a window: the rotary embedding's positions are wrapped (no per-layer
    rotation); with a layer kept as softmax the layers rotate their memories' inputs and that layer keeps
    its true positions; unconvert gives the teacher back its own positions."""
    ids = tokens()
    teacher = build_tiny_model("llama")
    with torch.no_grad():
        expected = teacher(ids).logits
    whole = converted("llama", PLANS["linear"], period=16)
    assert all(student.position_period is None for student in students(whole).values())
    mixed = converted("llama", PLANS["linear_beside_softmax"], period=16)
    assert [student.position_period for student in students(mixed).values()] == [16]
    with torch.no_grad():
        wrapped = mixed(ids, position_ids=(torch.arange(40) % 16)[None].expand(2, 40)).logits
        assert (mixed(ids).logits - wrapped).abs().max() > 1e-3  # the softmax layer's positions are true
    from dofla import dispatch
    from dofla.convert import unconvert

    with torch.no_grad(), dispatch.teacher_forced():  # the layers run the teacher's softmax, at its positions
        torch.testing.assert_close(whole(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed(ids).logits, expected, rtol=1e-5, atol=1e-5)
    unconvert(whole)
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, expected, rtol=1e-5, atol=1e-5)
