"""Rotary positions taken modulo a period in the converted layers' memories (``position_period``).

A student reads the teacher's q and k after rotary position embedding, and its learned feature maps see
the absolute rotation of each token: trained at T tokens, they never see the angles of positions beyond T,
and a pure-linear student fell apart there (measured: perplexity at 4,096 tokens in positions 2,048-4,095, 1,088
against 106 with a period of 1,024; docs/results/long_context/beyond_training_length/). With a period
P, the features of a token at position p are computed from its q and k rotated back to position p mod P,
angles the student was trained on; a layer's window softmax keeps the true positions (its relative
positions stay exact). Positions below P are unchanged, so a model evaluated within its training length
gives what it gave before.

The rotation is the teacher's own (the ``rotate_half`` layout of Llama-style rotary: pairs (i, i + r/2) of
the first r dimensions, r = 2 x the number of frequencies), by the angle (p mod P - p) x frequency,
computed in float32. Where no layer attends by softmax (every layer converted, none with a window) the
rotary embedding feeds only the memories, and its positions are wrapped once per forward instead (a hook on
the embedding: no per-layer rotations, a dozen small operators per layer in every decoding step). Rotary
embeddings whose frequencies depend on the length (dynamic NTK, LongRoPE) and models with more than one
(Gemma 3's local and global layers) are refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dofla.dispatch import is_teacher_forced
from dofla.errors import DoflaError

LENGTH_DEPENDENT = ("dynamic", "longrope")


def rotary_frequencies(model: nn.Module) -> Tensor | None:
    """The inverse frequencies (r/2,) of ``model``'s one rotary embedding, in float32 on the CPU; None for a
    model without rotary embeddings (e.g. GPT-2, whose positions are learned embeddings)."""
    found = rotary_embedding(model)
    return None if found is None else found[1]


def fixed_rotary_frequencies(model: nn.Module) -> Tensor | None:
    """As :func:`rotary_frequencies`, but None (instead of an error) for a model with several rotary
    embeddings or length-dependent ones: for features that apply only where the frequencies are fixed."""
    try:
        return rotary_frequencies(model)
    except DoflaError:
        return None


def check_edge_sinks(model: nn.Module) -> Tensor:
    """The rotary frequencies sinks at the window's edge turn queries with (the edge-sink baselines, and
    a student's ``sinks_at_edge``); a model without one rotary embedding of fixed frequencies is refused in
    one sentence."""
    frequencies = fixed_rotary_frequencies(model)
    if frequencies is None:
        raise DoflaError(
            "sinks at the window's edge move rotary positions, which needs one rotary embedding with fixed "
            "frequencies, and this model has not; leave --edge-sinks and --sinks-at-edge off for it."
        )
    return frequencies


def rotary_embedding(model: nn.Module) -> tuple[nn.Module, Tensor] | None:
    """``model``'s one rotary embedding module and its inverse frequencies (float32, CPU), or None; several
    or length-dependent ones are refused (see the module docstring)."""
    found = [
        (f"{name}.{buffer}" if name else buffer, module, tensor)
        for name, module in model.named_modules()
        for buffer, tensor in module.named_buffers(recurse=False)
        if buffer.endswith("inv_freq") and "original" not in buffer
    ]
    if not found:
        return None
    if len(found) > 1:  # e.g. Gemma 3: one set of frequencies for its local layers, one for its global ones
        names = ", ".join(name for name, _, _ in found)
        raise DoflaError(
            f"this model has {len(found)} rotary embeddings ({names}); a position period supports models "
            "with one, so leave it unset for this model."
        )
    name, module, frequencies = found[0]
    kind = getattr(module, "rope_type", "default")
    if kind in LENGTH_DEPENDENT:
        raise DoflaError(
            f"the rotary embedding {name} is of type {kind!r}, whose frequencies change with the length; a "
            "position period needs fixed frequencies, so leave it unset for this model."
        )
    return module, frequencies.detach().to("cpu", torch.float32).clone()  # the frequencies in use (scaled)


def wrap_positions_hook(period: int):
    """A forward pre-hook for a rotary embedding module ``forward(x, position_ids)``: its positions taken
    modulo ``period``. Used where no layer attends by softmax (every layer converted, none with a window): the
    rotary embedding then feeds only the memories, so wrapping the positions once per forward is the same as
    turning each layer's q and k back, without the per-layer rotations. Under
    :func:`dofla.dispatch.teacher_forced` (the layers run the teacher's softmax) the positions are left."""

    def hook(module, args, kwargs):
        if is_teacher_forced():  # the layers run the teacher's softmax: its own positions
            return args, kwargs
        if "position_ids" in kwargs:
            kwargs = {**kwargs, "position_ids": torch.remainder(kwargs["position_ids"], int(period))}
        elif len(args) > 1:
            args = (args[0], torch.remainder(args[1], int(period)), *args[2:])
        return args, kwargs

    return hook


def turns_of(angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The cosines and sines of ``angles`` in ``dtype``: what :func:`rotate_by` turns with."""
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_by(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` (B, H, T, D) rotated in the rotary planes (i, i + r/2) of its first r dimensions by the angles
    whose cosines and sines are given (B, 1, T, r/2) (:func:`turns_of`); the rest unchanged. In x's dtype."""
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    turned = [first * cos - second * sin, second * cos + first * sin]
    return torch.cat(turned + ([rest] if rest.shape[-1] else []), dim=-1)


@dataclass(frozen=True)
class Turns:
    """Turns of tokens in the rotary planes, applied by calling it on x (B, H, T, D): ``cos``, ``sin``
    (B, 1, T, r/2) as :func:`rotate_by` takes them; for one token on the CPU also ``matrix``, the same turn
    as one product (a decoding step's cost is its number of small operators: one ``mm`` instead of the dozen
    slicing and elementwise ones of :func:`rotate_by`): (D, D) where the batch shares one position, else
    (B, D, D); ``key_matrix`` its transpose (the opposite turn, see :meth:`keys_for_turned_query`)."""

    cos: Tensor
    sin: Tensor
    matrix: Tensor | None = None
    key_matrix: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        matrix = self.matrix
        if matrix is None or x.shape[2] != 1 or x.shape[-1] != matrix.shape[-1] or x.dtype != matrix.dtype:
            return rotate_by(x, self.cos, self.sin)
        return _one_token_product(x, matrix)

    def keys_for_turned_query(self, keys: Tensor) -> Tensor:
        """keys (B, Hk, S, D) turned the opposite way, so that an unturned query scores them as the turned
        query (this turn of one token) scores the keys themselves: q . result == self(q) . keys. One
        product (one-token turns with ``matrix`` only)."""
        return _one_token_product(keys, self.key_matrix)


def host_side(tensor: Tensor) -> bool:
    """Whether Python may look at ``tensor``'s values and keep things between calls: on the CPU, outside
    ``torch.compile`` (which traces a step once for every call, as a CUDA graph captures one)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _one_token_product(x: Tensor, matrix: Tensor) -> Tensor:
    """x (B, H, N, D) times ``matrix`` (D, D), or per batch row (B, D, D): one ``mm`` or ``bmm``."""
    if matrix.dim() == 2:  # one position for the whole batch: one product over every row
        return torch.mm(x.reshape(-1, x.shape[-1]), matrix).view(x.shape)
    return torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), matrix).view(x.shape)


def turn_matrix(cos: Tensor, sin: Tensor, dim: int) -> Tensor:
    """The (B, dim, dim) matrices M with x @ M == rotate_by(x, cos, sin) for one token's x (..., dim):
    cos, sin (B, 1, 1, r/2); the dimensions past the first r unchanged."""
    batch, half = cos.shape[0], cos.shape[-1]
    cos, sin = cos.reshape(batch, half), sin.reshape(batch, half)
    matrix = torch.eye(dim, dtype=cos.dtype, device=cos.device).repeat(batch, 1, 1)
    first = torch.arange(half, device=cos.device)
    second = first + half
    matrix[:, first, first] = cos
    matrix[:, second, second] = cos
    matrix[:, second, first] = -sin
    matrix[:, first, second] = sin
    return matrix


def _turns(angles: Tensor, dtype: torch.dtype, dim: int | None) -> Turns:
    """``Turns`` by ``angles`` (B, 1, T, r/2) float32, with the one-token matrix where ``dim`` is given, on
    the CPU (where the turns are kept for every layer, :func:`kept_turns`; elsewhere each layer would build
    its matrix)."""
    cos, sin = turns_of(angles, dtype)
    if dim is None or angles.shape[2] != 1 or not host_side(angles):
        return Turns(cos, sin)
    matrix = turn_matrix(cos, sin, dim)
    if matrix.shape[0] == 1:
        matrix = matrix[0]
    return Turns(cos, sin, matrix, matrix.transpose(-1, -2).contiguous())


# purpose -> (weak reference to position_ids, key, turns): see kept_turns
_KEPT_TURNS: dict[str, tuple] = {}


def kept_turns(purpose: str, position_ids: Tensor, key: tuple, compute):
    """``compute()`` (turns of the tokens at ``position_ids``, or None), kept on the CPU for the same
    ``position_ids`` tensor (unchanged since) and ``key``: every layer of a forward reads the one positions
    tensor, so a decoding step computes its turns once instead of once per layer. Not on other devices nor
    under ``torch.compile`` (a CUDA graph or a compiled step must compute them in every call: ``host_side``).
    A tensor made in inference mode keeps no version counter: its positions are compared with a copy kept
    beside the turns instead."""
    if not host_side(position_ids):
        return compute()
    inference = position_ids.is_inference()
    key = (*key, None if inference else position_ids._version)
    kept = _KEPT_TURNS.get(purpose)
    if (
        kept is not None
        and kept[0]() is position_ids
        and kept[1] == key
        and (not inference or torch.equal(kept[3], position_ids))
    ):
        return kept[2]
    turns = compute()
    _KEPT_TURNS[purpose] = (
        weakref.ref(position_ids),
        key,
        turns,
        position_ids.clone() if inference else None,
    )
    return turns


def _last(position_ids: Tensor, length: int) -> Tensor:
    """The last ``length`` positions of ``position_ids`` (B, T') or (T',) as (B, length)."""
    return (position_ids[None] if position_ids.dim() == 1 else position_ids)[:, -length:]


def edge_turns(
    position_ids: Tensor,
    length: int,
    edge: int,
    frequencies: Tensor,
    dtype: torch.dtype,
    dim: int | None = None,
) -> Turns | None:
    """The turns that take the last ``length`` tokens of ``position_ids`` (B, T') or (T',) back to position
    min(p, edge) (with ``dim``, the head size, one token's also as a matrix); None on the CPU (outside
    ``torch.compile``) where no token is past the edge (nothing to turn). Kept per positions tensor on the
    CPU (:func:`kept_turns`)."""

    def compute():
        positions = _last(position_ids, length)
        if host_side(positions) and int(positions.max()) < edge:
            return None
        shift = (positions.clamp(max=edge) - positions).to(torch.float32)  # (B, T) <= 0
        return _turns(shift[:, None, :, None] * frequencies, dtype, dim)

    return kept_turns("edge", position_ids, (length, edge, id(frequencies), dtype, dim), compute)


def period_turns(
    position_ids: Tensor,
    length: int,
    period: int,
    frequencies: Tensor,
    dtype: torch.dtype,
    dim: int | None = None,
) -> Turns | None:
    """The turns that take the last ``length`` tokens of ``position_ids`` back to their positions modulo
    ``period`` (:func:`wrap_angles`; with ``dim`` one token's also as a matrix); None on the CPU (outside
    ``torch.compile``) where every position is below the period. Kept per positions tensor on the CPU
    (:func:`kept_turns`)."""

    def compute():
        positions = _last(position_ids, length)
        if host_side(positions) and int(positions.max()) < period:
            return None
        return _turns(wrap_angles(positions, period, frequencies), dtype, dim)

    return kept_turns("period", position_ids, (length, period, id(frequencies), dtype, dim), compute)


def wrap_angles(position_ids: Tensor, period: int, frequencies: Tensor) -> Tensor:
    """The angles (B, 1, T, r/2) that turn tokens at ``position_ids`` (B, T) back to position mod period."""
    positions = position_ids.to(torch.int64)
    shift = (torch.remainder(positions, int(period)) - positions).to(torch.float32)  # <= 0
    return shift[:, None, :, None] * frequencies.to(position_ids.device)  # (a no-op where already there)


def check_period(period: int | None) -> None:
    if period is not None and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
        raise DoflaError(f"a position period must be a positive number of tokens, got {period!r}.")


class PositionTurns:
    """The turns a student layer's q and k take from their positions: its memory's rotary positions modulo
    ``position_period`` (with the teacher's ``rotary_frequencies``) and its sinks seen from the window's edge
    (``edge_sink_frequencies``), each None where off (set by ``dofla.convert.set_position_period`` and
    ``set_sinks_at_edge``). A base of ``dofla.attention.LinearAttention``, which holds those attributes
    and its ``kind``, ``window`` and ``sinks``."""

    def edge_sink_query(self, query: Tensor, position_ids: Tensor | None, state=None) -> Tensor | None:
        """The query (B, H, T, D) that scores the sinks when they are seen from the window's edge: each token
        turned back to position ``min(t, window + sinks)`` in the rotary planes, so that the sinks sit just
        before its window (where the teacher saw them in training) instead of t tokens away. None where the
        sinks keep their true positions and, on the CPU, where no token is past the edge (see
        ``edge_sink_turns``)."""
        turns = self.edge_sink_turns(query, position_ids, state)
        return None if turns is None else turns(query)

    def edge_sink_turns(self, query: Tensor, position_ids: Tensor | None, state=None) -> Turns | None:
        """The turns of ``edge_sink_query`` (for one token also as a matrix, see ``dofla.rotary.Turns``). None
        where the sinks keep their true positions (no ``edge_sink_frequencies``, no window or no sinks) and,
        on the CPU, where no token is past the edge (the query would be the same). ``position_ids`` (B, T)
        or (T,) give t; without them the call's tokens follow the ``state``'s (from 0 without one)."""
        frequencies = self.edge_sink_frequencies
        if frequencies is None or self.kind != "hybrid" or not self.sinks:
            return None
        length = query.shape[2]
        if position_ids is None:
            start = 0 if state is None else int(state.num_tokens)
            position_ids = torch.arange(start, start + length, device=query.device)
        if frequencies.device != position_ids.device:  # moved once (a copy would not go into a CUDA graph)
            self.edge_sink_frequencies = frequencies = frequencies.to(position_ids.device)
        # None where no token is past the edge, on the CPU (on a GPU the check would wait for the device:
        # the rotation is by zero there)
        return edge_turns(
            position_ids, length, self.window + self.sinks, frequencies, query.dtype, query.shape[-1]
        )

    def _wrapped(self, query: Tensor, key: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """query and key turned back to their positions modulo ``position_period`` (the same tensors where no
        period, no rotary or no positions are given, or, on the CPU, where every position is below it)."""
        turns = self.period_turns(query, position_ids)
        return (query, key) if turns is None else (turns(query), turns(key))

    def period_turns(self, query: Tensor, position_ids: Tensor | None) -> Turns | None:
        """The turns of ``_wrapped`` for the query (B, H, T, D)'s tokens at ``position_ids``: None where no
        period, no rotary or no positions are given, or, on the CPU, where every position is below it."""
        period, frequencies = self.position_period, self.rotary_frequencies
        if period is None or frequencies is None or position_ids is None:
            return None
        if frequencies.device != position_ids.device:  # moved once (a copy would not go into a CUDA graph)
            self.rotary_frequencies = frequencies = frequencies.to(position_ids.device)
        # None on the CPU where every position is below the period (on a GPU the check would wait for the
        # device: the rotation is by zero there)
        return period_turns(position_ids, query.shape[2], period, frequencies, query.dtype, query.shape[-1])
