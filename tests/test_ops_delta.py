"""The gated delta rule op (``dofla.ops.delta``): the fast forms against the reference, forward and
gradients, padding, state handoff, and closed-form checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import (
    assert_matches_reference,
    by_keywords,
    first,
    random_key_mask,
    relative_error,
    split,
)

from dofla import ops
from dofla.errors import DoflaError
from dofla.ops import DeltaInputs, DeltaState

# the forms called with the inputs' tensors by keyword, as the cases below write them
gated_delta_rule = by_keywords(ops.gated_delta_rule, DeltaInputs)
chunked_gated_delta_rule = by_keywords(ops.chunked_gated_delta_rule, DeltaInputs)
recurrent_gated_delta_rule = by_keywords(ops.recurrent_gated_delta_rule, DeltaInputs)

DELTA_NAMES = ("q", "k", "v", "log_decay", "beta")


def make_delta_inputs(batch, heads, kv_heads, length, key_dim=4, value_dim=3, *, seed=0):
    """Leaf float64 tensors: unit-norm keys, log decays < 0 (down to about -5), beta in (0, 1)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    inputs = {
        "q": draw(batch, heads, length, key_dim) / key_dim**0.5,
        "k": F.normalize(draw(batch, kv_heads, length, key_dim), dim=-1),
        "v": draw(batch, kv_heads, length, value_dim),
        "log_decay": F.logsigmoid(2 + 2 * draw(batch, kv_heads, length)),
        "beta": torch.sigmoid(draw(batch, kv_heads, length)),
    }
    return {name: tensor.requires_grad_() for name, tensor in inputs.items()}


# (batch, heads, kv heads, tokens, chunk): T = 1, T < chunk, chunk not dividing T, GQA 6/2 and 4/1.
DELTA_CASES = [
    (1, 2, 2, 1, 8),
    (1, 3, 3, 5, 16),
    (2, 6, 2, 37, 8),
    (2, 4, 1, 32, 16),
]


@pytest.mark.parametrize("case", DELTA_CASES)
def test_chunked_delta_matches_naive_forward_and_gradients(case):
    batch, heads, kv_heads, length, chunk = case
    inputs = make_delta_inputs(batch, heads, kv_heads, length)
    assert_matches_reference(
        chunked_gated_delta_rule, gated_delta_rule, inputs, DELTA_NAMES, torch.float32, 1e-4,
        {"chunk_size": chunk},
    )  # fmt: skip


def test_chunked_delta_takes_strided_inputs_without_padding():
    """Inputs laid out (B, T, H, ...) and transposed, as a model's are, with chunks dividing the length
    (no padding copy, so the chunk views are taken of the caller's strided tensors): the naive form's output."""
    inputs = make_delta_inputs(1, 4, 2, 16)
    strided = {
        name: tensor.detach().movedim(2, 1).contiguous().movedim(1, 2) for name, tensor in inputs.items()
    }
    assert not strided["q"].is_contiguous()
    out = chunked_gated_delta_rule(**strided, chunk_size=4)
    assert relative_error(out, gated_delta_rule(**strided)) < 1e-5


@pytest.mark.parametrize("case", DELTA_CASES[1:])
def test_recurrent_delta_matches_naive_forward_and_gradients(case):
    batch, heads, kv_heads, length, _ = case
    inputs = make_delta_inputs(batch, heads, kv_heads, length)
    assert_matches_reference(
        recurrent_gated_delta_rule, gated_delta_rule, inputs, DELTA_NAMES, torch.float32, 1e-4
    )


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_delta_key_mask_matches_reference_and_padding_changes_nothing(form):
    inputs = make_delta_inputs(2, 4, 2, 23)
    key_mask = random_key_mask(2, 23)
    function = chunked_gated_delta_rule if form == "chunked" else recurrent_gated_delta_rule
    extra = {"chunk_size": 8} if form == "chunked" else {}
    assert_matches_reference(
        function, gated_delta_rule, inputs, DELTA_NAMES, torch.float32, 1e-4, extra, key_mask=key_mask
    )
    # Left padding: the real tokens' outputs are those of the unpadded sequence.
    tensors = {name: t.detach() for name, t in inputs.items()}
    padded = {
        name: torch.cat([torch.rand_like(t[:, :, :5]) * (-3 if name == "log_decay" else 1), t], dim=2)
        for name, t in tensors.items()
    }
    mask = torch.arange(28)[None, :] >= 5
    out = first(function(**padded, key_mask=mask.expand(2, 28), **extra))
    assert relative_error(out[:, :, 5:], gated_delta_rule(**tensors)) < 1e-12


def test_delta_prefill_then_decode_then_chunked_equals_one_pass():
    inputs = make_delta_inputs(2, 6, 2, 40, key_dim=5)
    expected = gated_delta_rule(**split(inputs, DELTA_NAMES, 0, 40))
    out, state = chunked_gated_delta_rule(
        **split(inputs, DELTA_NAMES, 0, 19), chunk_size=8, return_state=True
    )
    # The reference continues from a state too.
    continued = gated_delta_rule(**split(inputs, DELTA_NAMES, 19, 40), initial_state=state)
    assert relative_error(continued, expected[:, :, 19:]) < 1e-12
    pieces = [out]
    for t in range(19, 25):
        out, state = recurrent_gated_delta_rule(**split(inputs, DELTA_NAMES, t, t + 1), state=state)
        pieces.append(out)
    assert state.num_tokens == 25
    out, state = chunked_gated_delta_rule(
        **split(inputs, DELTA_NAMES, 25, 40), chunk_size=8, initial_state=state, return_state=True
    )
    pieces.append(out)
    assert state.num_tokens == 40 and state.kv.dtype == torch.float64
    assert relative_error(torch.cat(pieces, dim=2), expected) < 1e-12
    _, recurrent_state = recurrent_gated_delta_rule(**split(inputs, DELTA_NAMES, 0, 40))
    assert torch.allclose(state.kv, recurrent_state.kv, rtol=1e-10, atol=1e-12)


def test_delta_without_decay_and_full_beta_overwrites_orthonormal_keys():
    """a = 1, beta = 1, orthonormal keys: each write replaces what the key's slot held, exactly."""
    key_dim, length = 4, 11
    basis, _ = torch.linalg.qr(
        torch.randn(key_dim, key_dim, generator=torch.Generator().manual_seed(0)).double()
    )
    slot = torch.tensor([0, 2, 1, 2, 3, 0, 0, 1, 3, 2, 1])  # the key of token t is basis column slot[t]
    k = basis[:, slot].T.reshape(1, 1, length, key_dim)
    v = torch.randn(1, 1, length, 3, dtype=torch.float64)
    q = torch.randn(1, 2, length, key_dim, dtype=torch.float64)
    log_decay, beta = (
        torch.zeros(1, 1, length, dtype=torch.float64),
        torch.ones(1, 1, length, dtype=torch.float64),
    )
    expected = torch.zeros(1, 2, length, 3, dtype=torch.float64)
    for t in range(length):
        memory = torch.zeros(key_dim, 3, dtype=torch.float64)
        for s in set(slot[: t + 1].tolist()):
            last = max(i for i in range(t + 1) if slot[i] == s)
            memory += torch.outer(basis[:, s], v[0, 0, last])  # slot s holds its latest value only
        expected[0, :, t] = q[0, :, t] @ memory
    inputs = DeltaInputs(q, k, v, log_decay, beta)
    for out in (
        ops.gated_delta_rule(inputs),
        ops.chunked_gated_delta_rule(inputs, chunk_size=4),
        ops.recurrent_gated_delta_rule(inputs)[0],
    ):
        assert relative_error(out, expected) < 1e-12


def test_delta_long_sequence_is_finite_and_chunked_matches_recurrent():
    torch.manual_seed(0)
    length = 2048
    q = torch.randn(1, 2, length, 8)
    k = F.normalize(torch.randn(1, 1, length, 8), dim=-1)
    v = torch.randn(1, 1, length, 4)
    # Decays from none to very strong (exp(-30) per token): cumulative log decays reach -10^4 in a chunk.
    log_decay = -torch.cat(
        [torch.zeros(1, 1, 512), 30 * torch.rand(1, 1, 512), torch.rand(1, 1, 1024) * 0.05], -1
    )
    beta = torch.sigmoid(torch.randn(1, 1, length))
    inputs = DeltaInputs(q, k, v, log_decay, beta)
    chunked, chunked_state = ops.chunked_gated_delta_rule(inputs, chunk_size=64, return_state=True)
    recurrent, recurrent_state = ops.recurrent_gated_delta_rule(inputs)
    assert torch.isfinite(chunked).all() and torch.isfinite(chunked_state.kv).all()
    assert relative_error(chunked, recurrent) < 1e-4
    assert relative_error(chunked_state.kv, recurrent_state.kv) < 1e-4
    assert chunked.abs().max() < 20  # unit keys and beta < 1 keep the memory bounded


def test_delta_normalize_keys_flag_equals_normalising_first():
    inputs = {name: t.detach() for name, t in make_delta_inputs(1, 2, 1, 9).items()}
    raw = {**inputs, "k": inputs["k"] * torch.rand(1, 1, 9, 1, dtype=torch.float64) * 5}
    out = chunked_gated_delta_rule(**raw, normalize_keys=True, chunk_size=4)
    assert relative_error(out, gated_delta_rule(**inputs)) < 1e-12
    assert relative_error(recurrent_gated_delta_rule(**raw, normalize_keys=True)[0], out) < 1e-12


def test_delta_state_helpers_and_errors():
    inputs = {name: t.detach() for name, t in make_delta_inputs(3, 4, 2, 10).items()}
    _, state = chunked_gated_delta_rule(**split(inputs, DELTA_NAMES, 0, 8), chunk_size=4, return_state=True)
    assert state.nbytes() == 3 * 2 * 4 * 3 * 8 and state.kv.shape == (3, 2, 4, 3)
    order = torch.tensor([1, 1, 0])
    reordered = {name: t[order] for name, t in inputs.items()}
    out, _ = recurrent_gated_delta_rule(
        **split(reordered, DELTA_NAMES, 8, 10), state=state.index_select(order)
    )
    assert relative_error(out, gated_delta_rule(**reordered)[:, :, 8:]) < 1e-12
    assert torch.equal(state.repeat_interleave(2).kv[5], state.kv[2])
    assert torch.equal(DeltaState.empty(3, 2, 4, 3).kv, torch.zeros(3, 2, 4, 3))
    with pytest.raises(DoflaError, match="beta"):
        gated_delta_rule(**{**inputs, "beta": inputs["beta"][:, :1]})
    with pytest.raises(DoflaError, match="delta state"):
        recurrent_gated_delta_rule(**inputs, state=DeltaState.empty(3, 2, 5, 3))
    with pytest.raises(DoflaError, match="chunk_size"):
        chunked_gated_delta_rule(**inputs, chunk_size=0)
