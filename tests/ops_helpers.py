"""Helpers shared by the op tests: random inputs, the reference comparison on forward and gradients, brute
force window and hybrid outputs (one query, one key at a time)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from dofla import ops
from dofla.ops import HybridInputs, HybridOptions, WindowInputs, WindowOptions


def by_keywords(form, inputs_type, options_type=None):
    """``form`` (an op form taking its bundles) called as the op tests write their cases: the leading
    positional tensors and the keywords that are fields of ``inputs_type`` go into that bundle, the keywords
    that are fields of ``options_type`` into that one, the rest (state, chunk size, ...) to the form as
    they are."""

    def taken(bundle, keywords):  # the keywords that are fields of ``bundle``, removed from ``keywords``
        return {
            field.name: keywords.pop(field.name)
            for field in dataclasses.fields(bundle)
            if field.name in keywords
        }

    def call(*tensors, **keywords):
        inputs = inputs_type(*tensors, **taken(inputs_type, keywords))
        if options_type is None:
            return form(inputs, **keywords)
        return form(inputs, options_type(**taken(options_type, keywords)), **keywords)

    return call


# the window and hybrid forms called with keywords, as the op tests write their cases
chunked_hybrid_attention = by_keywords(ops.chunked_hybrid_attention, HybridInputs, HybridOptions)
chunked_window_attention = by_keywords(ops.chunked_window_attention, WindowInputs, WindowOptions)
hybrid_attention = by_keywords(ops.hybrid_attention, HybridInputs, HybridOptions)
recurrent_hybrid_attention = by_keywords(ops.recurrent_hybrid_attention, HybridInputs, HybridOptions)
recurrent_window_attention = by_keywords(ops.recurrent_window_attention, WindowInputs, WindowOptions)
window_attention = by_keywords(ops.window_attention, WindowInputs, WindowOptions)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-2) -> float:
    """|actual - expected| / |expected| (Frobenius); the floor keeps gradients that are ~0 by construction
    (e.g. d out / d q with a single key, which only eps makes non-zero) from comparing float32 noise."""
    difference = (actual.double() - expected.double()).norm()
    return (difference / expected.double().norm().clamp_min(floor)).item()


def make_inputs(
    batch, heads, kv_heads, length, features, *, head_dim=4, value_dim=3, log_scale_std=None, seed=0
):
    """Leaf float64 tensors: q/k features >= 0, values, optional key log scales, raw query/key, gamma."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, positive=False):
        tensor = (
            torch.rand(*shape, generator=generator) if positive else torch.randn(*shape, generator=generator)
        )
        return tensor.double()

    inputs = {
        "q_features": draw(batch, heads, length, features, positive=True),
        "k_features": draw(batch, kv_heads, length, features, positive=True),
        "v": draw(batch, kv_heads, length, value_dim),
        "k_log_scale": None if log_scale_std is None else log_scale_std * draw(batch, kv_heads, length),
        "query": draw(batch, heads, length, head_dim),
        "key": draw(batch, kv_heads, length, head_dim),
        "window_factor": torch.sigmoid(draw(heads)),
    }
    return {name: None if tensor is None else tensor.requires_grad_() for name, tensor in inputs.items()}


LINEAR_NAMES = ("q_features", "k_features", "v", "k_log_scale")
HYBRID_NAMES = ("query", "key", "q_features", "k_features", "v", "k_log_scale", "window_factor")


def cast(inputs, names, dtype):
    """Fresh leaves in ``dtype`` (gradients of each call kept apart)."""
    return {
        name: None if inputs[name] is None else inputs[name].detach().to(dtype).requires_grad_()
        for name in names
    }


def forward_and_gradients(function, inputs, output_weight, **kwargs):
    out = function(**inputs, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    (out.double() * output_weight).sum().backward()
    # No gradient at all (e.g. features when no key has left the window yet) means zeros.
    gradients = {
        name: torch.zeros_like(tensor) if tensor.grad is None else tensor.grad
        for name, tensor in inputs.items()
        if tensor is not None
    }
    return out.detach(), gradients


def assert_matches_reference(fast, reference, inputs, names, dtype, tolerance, fast_kwargs=None, **kwargs):
    fast_inputs, reference_inputs = cast(inputs, names, dtype), cast(inputs, names, torch.float64)
    if dtype != torch.float64:  # the reference sees exactly the rounded values the fast form sees
        reference_inputs = cast(fast_inputs, names, torch.float64)
    probe = reference(
        **{k: (None if t is None else t.detach()) for k, t in reference_inputs.items()}, **kwargs
    )
    output_weight = torch.randn(probe.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out, gradients = forward_and_gradients(fast, fast_inputs, output_weight, **kwargs, **(fast_kwargs or {}))
    expected, expected_gradients = forward_and_gradients(reference, reference_inputs, output_weight, **kwargs)
    assert out.dtype == dtype
    assert relative_error(out, expected) < tolerance, "forward"
    for name, gradient in gradients.items():
        # Gradients sum ~numel(out) random-weighted terms: that sets the floor of their natural size.
        error = relative_error(gradient, expected_gradients[name], floor=1e-2 * expected.numel() ** 0.5)
        assert error < tolerance, f"gradient of {name}: relative error {error:.2e}"


def split(inputs, names, start, stop):
    return {name: None if inputs[name] is None else inputs[name].detach()[:, :, start:stop] for name in names}


def random_key_mask(batch, length, seed=2):
    mask = torch.rand(batch, length, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[0, :5] = False  # a row that starts with absent keys: its first queries see nothing
    return mask


def assert_chunked_linear_matches_naive(inputs, chunk_size, dtype=torch.float32, tolerance=1e-4):
    """The chunked linear attention against the naive one, forward and gradients, at this chunk size."""
    from dofla.ops import LinearInputs, chunked_linear_attention, linear_attention

    assert_matches_reference(
        by_keywords(chunked_linear_attention, LinearInputs),
        by_keywords(linear_attention, LinearInputs),
        inputs,
        LINEAR_NAMES,
        dtype,
        tolerance,
        {"chunk_size": chunk_size},
    )


WINDOW_NAMES = ("query", "key", "v")


def first(result):
    return result[0] if isinstance(result, tuple) else result


def brute_force_softmax_set(i: int, window: int, sinks: int) -> list[int]:
    """Keys query i attends to by softmax (no padding): its window and the sinks."""
    return [j for j in range(i + 1) if j > i - window or j < sinks]


def brute_force_hybrid(inputs, *, scaling, window, sinks, eps=1e-6):
    query, key, q_features, k_features, v, log_scale, gamma = (
        inputs[name].detach() for name in HYBRID_NAMES
    )  # fmt: skip
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kv = h // group
            for i in range(length):
                soft = brute_force_softmax_set(i, window, sinks)
                linear = [j for j in range(i + 1) if j not in soft]
                scores = torch.stack([scaling * query[b, h, i] @ key[b, kv, j] for j in soft])
                weights = {
                    j: gamma[h] * torch.exp(s - scores.max()) for j, s in zip(soft, scores, strict=True)
                }
                if linear:
                    offset = max(log_scale[b, kv, j] for j in linear)
                    for j in linear:
                        kernel = q_features[b, h, i] @ k_features[b, kv, j]
                        weights[j] = (1 - gamma[h]) * kernel * torch.exp(log_scale[b, kv, j] - offset)
                total = sum(weights.values())
                out[b, h, i] = sum(w * v[b, kv, j] for j, w in weights.items()) / (total + eps)
    return out


def brute_force_window(inputs, *, scaling, window, sinks):
    """Softmax over each query's window and sinks; the sinks scored by ``inputs["sink_query"]`` if given."""
    query, key, v = (inputs[name].detach() for name in WINDOW_NAMES)
    sink_query = query if inputs.get("sink_query") is None else inputs["sink_query"].detach()
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(batch, heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                soft = brute_force_softmax_set(i, window, sinks)
                scores = torch.stack(
                    [
                        scaling * (sink_query if j < sinks else query)[b, h, i] @ key[b, h // group, j]
                        for j in soft
                    ]
                )
                probabilities = torch.softmax(scores, dim=0)
                out[b, h, i] = sum(p * v[b, h // group, j] for p, j in zip(probabilities, soft, strict=True))
    return out


def brute_force_window_lse(inputs, *, scaling, window, sinks):
    query, key = (inputs[name].detach() for name in WINDOW_NAMES[:2])
    batch, heads, length, _ = query.shape
    group = heads // key.shape[1]
    lse = torch.zeros(batch, heads, length, dtype=torch.float64)
    for b, h, i in itertools.product(range(batch), range(heads), range(length)):
        soft = brute_force_softmax_set(i, window, sinks)
        lse[b, h, i] = torch.logsumexp(
            torch.stack([scaling * query[b, h, i] @ key[b, h // group, j] for j in soft]), dim=0
        )
    return lse


def padded_copy(tensors, pad):
    """Left-pad every (B, heads, T, ...) tensor with ``pad`` large random tokens (features stay >= 0)."""
    padded = {}
    for name, tensor in tensors.items():
        if tensor is None or tensor.dim() < 3:
            padded[name] = tensor
            continue
        noise = torch.randn_like(tensor[:, :, :pad]) * 1e3
        padded[name] = torch.cat([noise.abs() if "features" in name else noise, tensor], dim=2)
    return padded


def weighted_gradients(outputs, weights, inputs):
    """Gradients of sum(output * weight) over the outputs that are not None, with respect to ``inputs``."""
    present = [tensor for tensor in outputs if tensor is not None]
    total = sum((tensor * weight).sum() for tensor, weight in zip(present, weights, strict=True))
    return torch.autograd.grad(total, inputs)
