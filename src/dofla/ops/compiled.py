"""Decoding steps as one compiled kernel on the CPU (``torch.compile``, inductor's C++ code).

A converted layer's decoding step is a few dozen small operators (features, gates, the memory's update and
read, the window's ring write and softmax, the mix); at batch 1 on a CPU each costs its dispatch more than
its arithmetic, so a step costs several times the teacher's one fused attention call. Here a whole step is
one pure function of tensors, written plainly (it is also its own eager reference), which ``torch.compile``
turns into one generated C++ kernel per shape: the layers share it (their parameters are its arguments).

The steps take the steady state only (the window full, every sink kept, no slot hidden, no padding, no
autograd); the cells run their usual eager step otherwise, and wherever compiling fails (no C++ compiler,
say): once, with a warning, and never again in the process. Enabled per model by
:func:`dofla.convert.set_compiled_steps` (``dofla generate --compile``); the first step of each shape
compiles (seconds on two cores; inductor keeps the code on disk for the next process).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from dofla.ops.decode import RingWindow
from dofla.rotary import rotate_by

_COMPILED: dict[Callable, Callable] = {}
_FAILED: set[Callable] = set()
# inductor's options for one layer's step: the generated wrapper in C++ too (a call costs microseconds, not
# tens of them)
COMPILE_OPTIONS = {"cpp_wrapper": True}
# and for a whole model's step: its wrapper in Python (in C++ it is one large file that g++ -O3 takes
# minutes over; the Python wrapper's calls, one per fused kernel, cost far less than the eager operators)
WHOLE_COMPILE_OPTIONS: dict = {}


def compiled(function: Callable) -> Callable | None:
    """``function`` compiled by ``torch.compile`` (kept per function; None once compiling it has failed)."""
    if function in _FAILED:
        return None
    kept = _COMPILED.get(function)
    if kept is None:
        kept = _COMPILED[function] = torch.compile(
            function, fullgraph=True, dynamic=None, options=COMPILE_OPTIONS
        )
    return kept


def run_compiled(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` through its compiled kernel; None (nothing run) where it cannot compile,
    with one warning per function. Inside a program ``torch.compile`` is tracing (a compiled whole step),
    ``function`` itself, traced into that program."""
    if torch.compiler.is_compiling():
        return function(*args, **kwargs)
    kernel = compiled(function)
    if kernel is None:
        return None
    try:
        return kernel(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any backend failure (compiler missing, codegen): fall back
        if not _compile_failure(error):
            raise
        _COMPILED.pop(function, None)
        _give_up(function, error, "the decoding step")
        return None


def compiled_method(method: Callable, what: str) -> Callable:
    """The bound ``method`` compiled whole (``torch.compile``, one program: its first call traces and
    compiles it): a callable that runs it compiled and, once compiling has failed (one warning, naming
    ``what``; never tried again in this process), runs the method itself."""
    function = getattr(method, "__func__", method)
    kernel = None
    if function not in _FAILED:
        kernel = torch.compile(method, fullgraph=True, options=WHOLE_COMPILE_OPTIONS)

    def run(*args, **kwargs):
        nonlocal kernel
        if kernel is not None:
            try:
                return kernel(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - see run_compiled
                if not _compile_failure(error):
                    raise
                kernel = None
                _give_up(function, error, what)
        return method(*args, **kwargs)

    return run


def _give_up(function: Callable, error: Exception, what: str) -> None:
    """Never compile ``function`` again in this process; say so once."""
    _FAILED.add(function)
    warnings.warn(
        f"dofla: compiling {what} failed ({type(error).__name__}: {_first_line(error)}); decoding goes on "
        "eagerly.",
        stacklevel=3,
    )


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"


def _compile_failure(error: Exception) -> bool:
    """Whether ``error`` came from compiling (dynamo or inductor), not from the step's inputs."""
    module = type(error).__module__
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx")) or isinstance(
        error, (OSError, ImportError, NotImplementedError)
    )


def slot_index(slot: int, size: int, device: torch.device) -> Tensor:
    """The ring slot ``slot`` of ``size`` as a 1-element int64 tensor, kept per (size, device) (a Python int
    would specialise the compiled step on it; a new tensor per step is one more allocation)."""
    key = (size, device)
    slots = _SLOTS.get(key)
    if slots is None:
        slots = _SLOTS[key] = torch.arange(size, device=device).split(1)
    return slots[slot]


_SLOTS: dict[tuple[int, torch.device], tuple[Tensor, ...]] = {}


def product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (broadcast batches) as a sum of products: compiled, it becomes loops fused with the
    operators around it, where a small matrix product would be a library call of its own (at decoding's sizes
    the call costs more than the arithmetic)."""
    return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)


def in_place(tensor: Tensor) -> bool:
    """Whether a state's buffer may be updated in place here (as ``dofla.ops.decode`` updates its rings):
    not one made in inference mode while this is not (under ``torch.compile``, which cannot ask, the
    compiled whole step's buffers, which ``dofla.graph_decode.CapturedDecoder`` makes so)."""
    if torch.compiler.is_compiling():
        return True
    return not (tensor.is_inference() and not torch.is_inference_mode_enabled())


def steady_ring(ring, dtype: torch.dtype, *, ones_column: bool = False) -> bool:
    """Whether a window (a ``RingWindow``) is in the steady state the compiled steps take: every slot
    visible (the window full, each sink kept, no slot hidden), in ``dtype``, its values with a column of
    ones where ``ones_column`` (the shared normalisation's), updatable in place."""
    return (
        isinstance(ring, RingWindow)
        and ring.keys.dtype == ring.values.dtype == dtype
        and ring.sinks_full
        and ring.num_tokens >= ring.hidden_until
        and ring.values.shape[-1] == ring.value_dim + int(ones_column)
        and in_place(ring.keys)
    )


def one_token_turn(turns, dtype: torch.dtype):
    """The cosines and sines (B, 1, 1, r/2) of one token's turn (``dofla.rotary.Turns``) as the compiled
    steps take them: (None, None) for no turns, None where they are not in ``dtype``."""
    if turns is None:
        return None, None
    if turns.cos.dtype != dtype or turns.cos.shape[2] != 1:
        return None
    return turns.cos, turns.sin


def _turned(x: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    """x (B, Hk, N, D) turned in the rotary planes by the angles of ``cos``, ``sin`` (B, 1, 1, r/2)
    (``dofla.rotary.rotate_by``: elementwise, fused into the kernel); x itself for None."""
    return x if cos is None else rotate_by(x, cos, sin)


def _sinks_turned(ring_keys: Tensor, cos: Tensor | None, sin: Tensor | None, sinks: int) -> Tensor:
    """The ring's keys (B, Hk, S + W, D) with its ``sinks`` sink keys turned by the opposite of the angles of
    ``cos``, ``sin`` (so that a query scores them as its turn would, ``Turns.keys_for_turned_query``); the
    ring's keys for None."""
    if cos is None:
        return ring_keys
    return torch.cat([rotate_by(ring_keys[:, :, :sinks], cos, -sin), ring_keys[:, :, sinks:]], dim=2)


def gated_delta_window_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    memory: Tensor,
    map_weight: Tensor,
    decay_weight: Tensor,
    decay_bias: Tensor,
    write_weight: Tensor,
    write_bias: Tensor,
    mix_logit: Tensor | None,
    ring_keys: Tensor | None,
    ring_values: Tensor | None,
    slot: Tensor | None,
    memory_cos: Tensor | None,
    memory_sin: Tensor | None,
    sink_cos: Tensor | None,
    sink_sin: Tensor | None,
    feature_mask: Tensor | None,
    conv_tail: Tensor | None,
    conv_weight: Tensor | None,
    out_gate_weight: Tensor | None,
    out_gate_bias: Tensor | None,
    scaling: float,
    sinks: int,
) -> tuple[Tensor, Tensor | None]:
    """One token of the gated delta rule over projected features, alone or mixed with the window's softmax
    (``GatedDeltaAttention``'s step, in its steady state): returns the output (B, 1, H, Dv) and the short
    convolution's new tail (or None); the memory is updated and the token's key and value written into the
    ring in place.

    query (B, H, 1, D), key and value (B, Hs, 1, D) (Hs state heads, the key/value heads; G = H // Hs), the
    memory S (B, Hs, F, Dv); the projection map's weight (Hs, D, F) and its head-wise mask (Hs, F) or None;
    the decay and write gates' weights (Hs, Dv) and biases (Hs,): a = sigmoid(v . w / sqrt(Dv) + b).
    ``conv_tail`` (B, W - 1, C) and ``conv_weight`` (W, C): the short convolution over the token's features
    and values (C channels: the features flattened, then the values) and its last W - 1 inputs; the output
    gate's weight (Hs, G, Dv, Dv) and bias (H, Dv) scale the memory's read-out by
    2 sigmoid(v W / sqrt(Dv) + b). Without a window (``ring_keys`` None) the memory's read-out is the
    output, else gamma = sigmoid(``mix_logit`` (H,)) mixes it per head with the window's softmax over
    ``ring_keys`` (B, Hs, S + W, D)
    and ``ring_values`` (B, Hs, S + W, Dv) after the token is written to ring slot ``slot`` (1-element
    int64); ``memory_cos``, ``memory_sin`` (B, 1, 1, r/2) turn the memory's q and k (a position period),
    ``sink_cos``, ``sink_sin`` the queries that score the ``sinks`` sinks, as the sink keys turned the
    opposite way (sinks seen from the window's edge); None: unturned.
    ``scaling``: the window softmax's logit scale.
    """
    batch, heads, _, dim = query.shape
    state_heads = key.shape[1]
    group = heads // state_heads
    queries = query.reshape(batch, state_heads, group, dim)
    both = torch.cat([queries, key], dim=2)  # (B, Hs, G + 1, D): each state head's queries, then its key
    features = product(_turned(both, memory_cos, memory_sin), map_weight)  # (B, Hs, G + 1, F)
    if feature_mask is not None:
        features = features * feature_mask[:, None]
    values = value[:, :, 0]  # (B, Hs, Dv)
    written = value  # what the memory stores: the value, or its short convolution
    tail = None
    if conv_weight is not None:
        present = torch.cat([features.flatten(1), values.flatten(1)], dim=1)  # (B, C)
        recent = torch.cat([conv_tail, present[:, None]], dim=1)  # (B, W, C)
        mixed = (recent * conv_weight).sum(1)  # (B, C)
        features = mixed[:, : features[0].numel()].view(features.shape)
        written = mixed[:, features[0].numel() :].view(value.shape)
        tail = recent[:, 1:]
    norms = torch.linalg.vector_norm(features, dim=-1, keepdim=True).clamp_min(1e-12)
    features = features / norms
    scale = values.shape[-1] ** -0.5
    decay = torch.sigmoid((values * decay_weight).sum(-1) * scale + decay_bias)[
        ..., None, None
    ]  # (B, Hs, 1, 1)
    beta = torch.sigmoid((values * write_weight).sum(-1) * scale + write_bias)[..., None, None]
    key_features = features[:, :, -1:]  # (B, Hs, 1, F)
    recalled = product(key_features, memory)  # (B, Hs, 1, Dv): k^T S
    correction = (written - decay * recalled) * beta  # b (v - a k^T S)
    memory.copy_(memory * decay + key_features.transpose(-1, -2) * correction)  # a S + k (b (v - a k^T S))^T
    output = product(features[:, :, :-1], memory)  # (B, Hs, G, Dv)
    if out_gate_weight is not None:
        logits = product(values[:, :, None, None], out_gate_weight * scale).squeeze(-2)  # (B, Hs, G, Dv)
        output = output * (2 * torch.sigmoid(logits + out_gate_bias.view(state_heads, group, -1)))
    if ring_keys is not None:
        ring_keys.index_copy_(2, slot, key)
        ring_values.index_copy_(2, slot, value)
        keys = _sinks_turned(ring_keys, sink_cos, sink_sin, sinks)
        scores = product(queries, keys.transpose(-1, -2)) * scaling  # (B, Hs, G, S + W)
        window = product(torch.softmax(scores, dim=-1), ring_values)  # (B, Hs, G, Dv)
        output = torch.lerp(output, window, torch.sigmoid(mix_logit).view(state_heads, group, 1))
    return output.reshape(batch, 1, heads, -1), tail


def hedgehog_window_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_decay_total: Tensor | None,
    signed_weight: Tensor,
    decay_weight: Tensor | None,
    decay_bias: Tensor | None,
    mix_logit: Tensor,
    ring_keys: Tensor,
    ring_values: Tensor,
    key_features: Tensor,
    key_log_scales: Tensor,
    sums: Tensor,
    log_offset: Tensor,
    slot: Tensor,
    oldest: Tensor,
    memory_cos: Tensor | None,
    memory_sin: Tensor | None,
    sink_cos: Tensor | None,
    sink_sin: Tensor | None,
    scaling: float,
    sinks: int,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One token of linear attention over Hedgehog features sharing its normalisation with the window's
    softmax, with forgetting (the ``gla`` cell) or without (the ``linear`` cell): the hybrid step of
    ``dofla.ops.decode.hybrid_decode_step``, its window full and every sink kept. Returns the output
    (B, 1, H, Dv), the new running log decay (B, Hs) (None without forgetting) and the sums' new log offset;
    the sums, the ring and the window's key features and log scales are updated in place.

    query (B, H, 1, D), key and value (B, Hs, 1, D); the map's columns interleaved with their negations
    (Hs, D, F) (phi = softmax over each pair's sign, then over the F/2 columns); with forgetting,
    ``log_decay_total`` A (B, Hs) before the token and the decay gate's weight (Hs, Dv) and bias (Hs,) (the
    key's log scale is then -A_t), else all three None (log scale 0); gamma = sigmoid(``mix_logit`` (H,)); the
    ring's keys (B, Hs, S + W, D) and values with their column of ones (B, Hs, S + W, Dv + 1); the window
    slots' key features (B, Hs, W, F) and log scales (B, Hs, W); the sums (B, Hs, F, Dv + 1) of the keys
    that left the window, relative to ``log_offset`` (B, Hs); ``slot`` the ring slot this token takes and
    ``oldest`` (slot - S) the window slot whose key leaves for the sums (1-element int64 each); the turns as
    in ``gated_delta_window_step``.
    """
    batch, heads, _, dim = query.shape
    state_heads = key.shape[1]
    group = heads // state_heads
    queries = query.reshape(batch, state_heads, group, dim)
    both = torch.cat([queries, key], dim=2)  # (B, Hs, G + 1, D)
    projection = product(_turned(both, memory_cos, memory_sin), signed_weight)  # (B, Hs, G + 1, F)
    features = torch.softmax(projection.unflatten(-1, (-1, 2)), dim=-2).flatten(-2)
    values = value[:, :, 0]  # (B, Hs, Dv)
    if decay_weight is None:
        total, log_scale = None, torch.zeros_like(log_offset)  # Hedgehog's log scale s_t = 0
    else:
        gate = (values * decay_weight).sum(-1) * values.shape[-1] ** -0.5 + decay_bias
        total = log_decay_total + torch.nn.functional.logsigmoid(gate)  # (B, Hs): A_t
        log_scale = -total  # the key's log scale s_t - A_t
    # the oldest window key joins the sums (read before this token overwrites its slots)
    leaving_scale = key_log_scales.index_select(2, oldest)[:, :, 0]  # (B, Hs)
    new_offset = torch.maximum(log_offset, leaving_scale)
    finite_offset = new_offset.clamp_min(torch.finfo(new_offset.dtype).min)
    decay = torch.exp(log_offset - finite_offset)[..., None, None]
    weight = torch.exp(leaving_scale - finite_offset)[..., None]  # (B, Hs, 1)
    leaving_key = key_features.index_select(2, oldest)[:, :, 0] * weight  # (B, Hs, F)
    leaving_value = ring_values.index_select(2, slot)  # (B, Hs, 1, Dv + 1)
    sums.copy_(sums * decay + leaving_key[..., None] * leaving_value)
    ring_keys.index_copy_(2, slot, key)
    ring_values.index_copy_(2, slot, torch.cat([value, torch.ones_like(value[..., :1])], dim=-1))
    key_features.index_copy_(2, oldest, features[:, :, -1:])
    key_log_scales.index_copy_(2, oldest, log_scale[..., None])
    keys = _sinks_turned(ring_keys, sink_cos, sink_sin, sinks)
    scores = product(queries, keys.transpose(-1, -2)) * scaling  # (B, Hs, G, S + W)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    window_sums = product(weights, ring_values)  # (B, Hs, G, Dv + 1): numerators, then denominators
    linear_sums = product(features[:, :, :-1], sums)  # relative to the offset
    mixed = torch.lerp(linear_sums, window_sums, torch.sigmoid(mix_logit).view(state_heads, group, 1))
    output = mixed[..., :-1] / (mixed[..., -1:] + eps)
    return output.reshape(batch, 1, heads, -1), total, new_offset
