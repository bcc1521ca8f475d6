"""The no-training window baseline against a brute-force banded softmax, with padding and a cache."""

import pytest
import torch
from helpers import small_llama
from transformers import DynamicCache

from dofla import dispatch
from dofla.errors import DoflaError
from dofla.evaluation import window_baseline
from dofla.evaluation.window_baseline import banded_window_attention, restrict_to_window, window_restricted
from dofla.planning.window_costs import window_costs


class _BandedSoftmax(torch.nn.Module):
    """Reference: softmax over keys j with i - window < j <= i or j < sinks, built position by position."""

    def __init__(self, window, sinks):
        super().__init__()
        self.window, self.sinks = window, sinks

    def forward(self, query, key, value, attention_mask=None, *, scaling):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        length = query.shape[2]
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for i in range(length):
            for j in range(i + 1):
                allowed[i, j] = (j > i - self.window) or (j < self.sinks)
        scores = (query @ key.transpose(-1, -2)) * scaling  # (B, H, T, T)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return (weights @ value).transpose(1, 2)  # (B, T, H, D)


def _brute_force_logits(tokens, window, sinks):
    reference = small_llama()
    dispatch.install(reference)
    for layer in reference.model.layers:
        layer.self_attn.dofla_student = _BandedSoftmax(window, sinks)
    return reference(tokens).logits


@pytest.mark.parametrize(("attention", "band_block"), [("sdpa", 256), ("sdpa", 4), ("eager", 4)])
@pytest.mark.parametrize(("window", "sinks"), [(3, 0), (4, 2), (1, 1)])
def test_window_matches_a_brute_force_banded_softmax(attention, band_block, window, sinks, monkeypatch):
    # band_block 4 < 11 tokens: plain SDPA calls take the banded form; 256: the masked teacher SDPA
    monkeypatch.setattr(window_baseline, "BAND_BLOCK", band_block)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    model = small_llama()
    model.set_attn_implementation(attention)
    teacher_logits = model(tokens).logits
    with window_restricted(model, window, sinks):
        restricted = model(tokens).logits
    torch.testing.assert_close(restricted, _brute_force_logits(tokens, window, sinks), rtol=1e-4, atol=1e-5)
    # the first `window` positions see everything they would anyway; later ones differ
    torch.testing.assert_close(restricted[:, :window], teacher_logits[:, :window], rtol=1e-4, atol=1e-5)
    assert (restricted[:, -1] - teacher_logits[:, -1]).abs().max() > 1e-3
    # leaving the block restores the teacher
    torch.testing.assert_close(model(tokens).logits, teacher_logits, rtol=0, atol=1e-6)


def test_a_window_as_long_as_the_sequence_is_the_teacher():
    tokens = torch.randint(0, 64, (2, 9))
    model = small_llama()
    teacher_logits = model(tokens).logits
    with window_restricted(model, 9, sinks=4):
        torch.testing.assert_close(model(tokens).logits, teacher_logits, rtol=1e-5, atol=1e-6)


def test_left_padded_batch_sees_the_same_window_and_sinks_as_each_sequence_alone():
    model = small_llama()
    long, short = torch.randint(3, 64, (12,)), torch.randint(3, 64, (7,))
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0], batch[1, 5:] = long, short
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    with window_restricted(model, 3, sinks=2):
        together = model(batch, attention_mask=mask).logits
        alone = [model(ids[None]).logits[0] for ids in (long, short)]
    torch.testing.assert_close(together[0], alone[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(together[1, 5:], alone[1], rtol=1e-4, atol=1e-5)


def test_decoding_with_a_cache_equals_full_forwards():
    model = small_llama()
    tokens = torch.randint(0, 64, (2, 10))
    with window_restricted(model, 4, sinks=1):
        full = model(tokens).logits  # (B, T, V)
        cache = DynamicCache(config=model.config)
        steps = [model(tokens[:, :6], past_key_values=cache, use_cache=True).logits]
        steps.append(model(tokens[:, 6:8], past_key_values=cache, use_cache=True).logits)
        for index in (8, 9):
            steps.append(model(tokens[:, index : index + 1], past_key_values=cache, use_cache=True).logits)
        generated = model.generate(tokens, max_new_tokens=3, do_sample=False, pad_token_id=0)
        greedy = tokens
        for _ in range(3):
            greedy = torch.cat([greedy, model(greedy).logits[:, -1:].argmax(-1)], dim=1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    assert torch.equal(generated, greedy)


@pytest.mark.parametrize(
    ("window", "sinks", "block", "length", "groups"),
    [
        (5, 0, 8, 37, 2),
        (5, 3, 8, 37, 2),
        (1, 2, 4, 37, 2),
        (40, 1, 16, 37, 2),  # one block longer than the sequence
        (3, 10, 8, 37, 2),  # sinks past the first block
        (8, 4, 8, 32, 3),  # no padding; three query heads per key/value head (SmolLM2's 9 / 3)
        (2, 40, 4, 11, 1),  # more sinks than tokens: the full causal softmax
    ],
)
def test_banded_form_equals_the_masked_softmax_forward_and_gradients(window, sinks, block, length, groups):
    generator = torch.Generator().manual_seed(window + sinks)
    query = torch.randn(
        2, 2 * groups, length, 8, generator=generator, dtype=torch.float64, requires_grad=True
    )
    key = torch.randn(2, 2, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, 2, length, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, length, 2 * groups, 6, generator=generator, dtype=torch.float64)

    def reference(query, key, value):  # the masked SDPA the teacher runs without the banded form
        mask = restrict_to_window(torch.ones(length, length, dtype=torch.bool).tril(), window, sinks)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=0.3
        )
        return output.transpose(1, 2)

    _assert_same_forward_and_gradients(
        lambda q, k, v: banded_window_attention(q, k, v, window, sinks, 0.3, block=block),
        reference,
        (query, key, value),
        upstream,
    )


def _assert_same_forward_and_gradients(fast, reference, inputs, upstream):
    """``fast`` and ``reference`` give the same output and input gradients (float64, tight tolerances)."""
    results = []
    for function in (fast, reference):
        output = function(*inputs)
        results.append((output, torch.autograd.grad((output * upstream).sum(), inputs)))
    (output, gradients), (expected, expected_gradients) = results
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-12)
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected_gradient, rtol=1e-10, atol=1e-12)


def test_banded_form_of_a_long_float32_sequence_equals_the_masked_teacher_softmax():
    # the evaluation's case: float32, SmolLM2's head layout, far more tokens than one block
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 9, 300, 16, generator=generator)
    key, value = torch.randn(2, 1, 3, 300, 16, generator=generator)
    banded = banded_window_attention(query, key, value, 64, 4, 0.25)
    mask = restrict_to_window(torch.ones(300, 300, dtype=torch.bool).tril(), 64, 4)
    masked = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask, scale=0.25
    )
    torch.testing.assert_close(banded, masked.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_restriction_of_a_mask_by_hand():
    visible = torch.ones(4, 4, dtype=torch.bool).tril()  # causal
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(restrict_to_window(visible, 2, sinks=1), expected)
    # left padding: the first real key is the sink, padded keys stay hidden, an empty row stays empty
    padded = visible & torch.tensor([False, True, True, True])
    expected = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(restrict_to_window(padded, 1, sinks=1), expected)


def test_bad_window_settings_are_refused():
    model = small_llama()
    with pytest.raises(DoflaError, match="at least 1 token"):
        with window_restricted(model, 0):
            pass
    with pytest.raises(DoflaError, match="cannot be negative"):
        with window_restricted(model, 4, sinks=-1):
            pass
    with window_restricted(model, 4):
        with pytest.raises(DoflaError, match="already inside"):
            with window_restricted(model, 8):
                pass


def test_a_subset_of_layers_is_restricted_against_a_brute_force_reference():
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    model = small_llama()
    reference = small_llama()
    dispatch.install(reference)
    last = len(reference.model.layers) - 1
    reference.model.layers[last].self_attn.dofla_student = _BandedSoftmax(3, 1)  # only the last layer
    with window_restricted(model, 3, sinks=1, layers=[last]):
        restricted = model(tokens).logits
    torch.testing.assert_close(restricted, reference(tokens).logits, rtol=1e-4, atol=1e-5)
    assert (restricted - _brute_force_logits(tokens, 3, 1)).abs().max() > 1e-3  # not every layer
    with window_restricted(model, 3, sinks=1, layers=[]):
        torch.testing.assert_close(model(tokens).logits, small_llama()(tokens).logits, rtol=0, atol=1e-6)
    with pytest.raises(DoflaError, match="not attention layers"):
        with window_restricted(model, 3, layers=[len(model.model.layers)]):
            pass


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_window_costs_equal_full_forwards_with_one_layer_cut(family):
    """Each layer's cost (forward from the hidden states entering it, head in row chunks) equals the KL
    of a full forward with only that layer restricted, by plain full-vocabulary log-softmaxes."""
    from dofla.models.tiny import build_tiny_model

    model = build_tiny_model(family, seed=1).eval()  # 2 layers
    vocabulary = model.get_output_embeddings().weight.shape[0]
    batches = [
        torch.randint(0, vocabulary, (2, 24), generator=torch.Generator().manual_seed(i)) for i in (0, 1)
    ]
    costs = window_costs(model, batches, window=4, sinks=1)
    expected = []
    with torch.no_grad():
        full = [torch.log_softmax(model(batch).logits.float(), -1) for batch in batches]
        for layer in range(2):
            with window_restricted(model, 4, 1, layers=[layer]):
                cut = [torch.log_softmax(model(batch).logits.float(), -1) for batch in batches]
            kl = sum((f.exp() * (f - c)).sum().item() for f, c in zip(full, cut, strict=True))
            expected.append(kl / sum(batch.numel() for batch in batches))
    assert all(value > 1e-6 for value in expected)  # a 4-token window changes every layer's output here
    assert costs == pytest.approx(expected, rel=1e-3, abs=1e-7)
    only = window_costs(model, batches, window=4, sinks=1, layers=[1])
    assert only[0] == 0.0 and only[1] == pytest.approx(costs[1], rel=1e-5)


def test_the_baselines_take_the_students_window_and_say_when_it_has_none():
    from dofla.convert import convert, plan_for
    from dofla.models import build_tiny_model

    hybrid = build_tiny_model("llama")
    convert(hybrid, plan_for(hybrid, kind="hybrid", feature_map="elu1", feature_dim=8, window=12))
    linear = build_tiny_model("llama")
    convert(linear, plan_for(linear, kind="linear", feature_map="elu1", feature_dim=8))
    assert window_baseline.baseline_window(hybrid.dofla_plan) == 12
    assert window_baseline.baseline_window(linear.dofla_plan) == window_baseline.REFERENCE_WINDOW
    assert window_baseline.baseline_window(None) == window_baseline.REFERENCE_WINDOW
    assert window_baseline.baseline_notes(hybrid, 12) == []
    (note,) = window_baseline.baseline_notes(linear, 64)
    assert "keeps no window" in note and "window 64" in note
    assert window_baseline.baseline_notes(None, 64) == []


def _edge_reference(query, key, value, window, sinks, scaling, frequencies):
    """Sinks seen from the window's edge, built query by query: query i scores sink j (older than its window)
    after turning back to position min(i, window + sinks) with the rotate-half convention of the model
    files; the window's keys with the query as it is."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    length = query.shape[2]
    rows = []
    for i in range(length):
        angle = (min(i, window + sinks) - i) * torch.cat(
            [frequencies, frequencies]
        )  # float32, as the model's
        cos, sin = angle.cos().to(query.dtype), angle.sin().to(query.dtype)
        half = query.shape[-1] // 2
        q = query[:, :, i]
        turned = q * cos + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * sin
        scores, values = [], []
        for j in range(i + 1):
            if j > i - window:
                scores.append((q * key[:, :, j]).sum(-1))
            elif j < sinks:
                scores.append((turned * key[:, :, j]).sum(-1))
            else:
                continue
            values.append(value[:, :, j])
        weights = (torch.stack(scores, -1) * scaling).softmax(-1)  # (B, H, K)
        rows.append((weights[..., None] * torch.stack(values, 2)).sum(2))  # (B, H, Dv)
    return torch.stack(rows, 1)  # (B, T, H, Dv)


@pytest.mark.parametrize(("window", "sinks", "block"), [(5, 3, 4), (3, 1, 16), (6, 0, 8), (2, 9, 5)])
def test_sinks_at_the_edge_equal_a_query_by_query_reference_forward_and_gradients(window, sinks, block):
    generator = torch.Generator().manual_seed(window)
    shape = dict(generator=generator, dtype=torch.float64, requires_grad=True)
    query = torch.randn(2, 4, 29, 8, **shape)
    key, value = torch.randn(2, 2, 29, 8, **shape), torch.randn(2, 2, 29, 6, **shape)
    frequencies = 1.0 / 100.0 ** (torch.arange(4, dtype=torch.float32) / 4)
    upstream = torch.randn(2, 29, 4, 6, generator=generator, dtype=torch.float64)
    _assert_same_forward_and_gradients(
        lambda q, k, v: window_baseline.edge_sink_window_attention(
            q, k, v, window, sinks, 0.3, frequencies, block=block
        ),
        lambda q, k, v: _edge_reference(q, k, v, window, sinks, 0.3, frequencies),
        (query, key, value),
        upstream,
    )


def test_sinks_at_the_edge_change_only_queries_beyond_window_plus_sinks():
    model = small_llama()
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), window_restricted(model, 6, 2):
        true_positions = model(tokens).logits
    with torch.no_grad(), window_restricted(model, 6, 2, sinks_at_edge=True):
        at_edge = model(tokens).logits
    # queries up to position window + sinks see the sinks where they are; later ones from the edge
    torch.testing.assert_close(at_edge[:, :9], true_positions[:, :9], rtol=1e-5, atol=1e-5)
    assert (at_edge[:, 9:] - true_positions[:, 9:]).abs().max() > 1e-3


def test_sinks_at_the_edge_are_refused_without_rotary_positions_or_with_a_cache():
    from dofla.models import build_tiny_model

    with pytest.raises(DoflaError, match="rotary"):
        with window_restricted(build_tiny_model("gpt2"), 4, 2, sinks_at_edge=True):
            pass
    model = small_llama()
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), window_restricted(model, 4, 2, sinks_at_edge=True):
        model(torch.zeros(1, 12, dtype=torch.long), past_key_values=cache)  # a whole row from position 0
        with pytest.raises(DoflaError, match="uncached rows"):
            model(torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
