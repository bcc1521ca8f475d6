"""Helpers shared by the op tests: random inputs, the reference comparison on forward and gradients."""

from __future__ import annotations

import torch


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
    from dofla.ops import chunked_linear_attention, linear_attention

    assert_matches_reference(
        chunked_linear_attention,
        linear_attention,
        inputs,
        LINEAR_NAMES,
        dtype,
        tolerance,
        {"chunk_size": chunk_size},
    )
