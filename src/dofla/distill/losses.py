"""Distillation losses: per layer (kernel L2, softmax cross-entropy, attention-output MSE) and whole-model.

Which kernel is compared. For query i and causal keys j <= i the teacher's attention row is
``P_ij = softmax_j(scaling * q_i.k_j)``. The student's row is its own attention weights normalised per
row, ``A_ij = a_ij / sum_j a_ij``, with ``a_ij`` exactly the weights of :mod:`dofla.ops`:
``phi(q_i).phi(k_j) exp(s_j)`` for linear layers (s = the key log scale; the query's own factor cancels),
and for hybrid layers the window softmax part weighted by gamma plus the linear part weighted by 1 - gamma.
Both kernels are thus normalised per query row, so the L2 loss and the cross-entropy compare the same
objects, and neither depends on the arbitrary per-token scale of the feature maps.

Every loss is registered in :data:`LOSSES` by name, at one of three scopes:

* ``kernel`` (a row function over the two kernels, run through :func:`kernel_loss`):
  ``softmax``: ``-sum_j P_ij log A_ij`` averaged over rows (the cross-entropy; its minimum over A is the
  teacher's row entropy, so the value is not 0 at a perfect fit); ``l2``: ``sum_j (P_ij - A_ij)^2``.
* ``layer`` (a function of one student and its teacher-forced attention call):
  ``output_mse``: mean squared error of the attention outputs before the output projection;
  ``projected_mse``: that error after the teacher's output projection (what the layer adds to the residual
  stream), so each direction of the error counts as much as the projection makes it count;
  ``split_mse``: that, plus its mix and memory halves trained apart (hybrid ``gated_delta`` layers).
* ``model`` (the whole model end to end): ``direct``: next-token cross-entropy, optionally + KL to the
  teacher's logits.

Adding a loss is one function decorated with :func:`register_loss` (and its test); :func:`layer_loss`
and the trainer look it up by name.

The two kernel losses are computed in log space over chunks of queries (each chunk against the keys it
can see only); for long sequences each chunk is recomputed in the backward pass (activation
checkpointing), so memory is O(chunk * T) per head instead of O(T^2) and T = 2048 fits. Padded keys (``key_mask`` False) take part nowhere; padded query rows are left out.
Teacher rows are plain causal softmax over the given keys: sliding-window or soft-capped teachers
(Gemma-2, Mistral windows) are compared as if they were full causal softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dofla.errors import DoflaError
from dofla.models.adapters import output_projection
from dofla.ops._checks import soft_cap
from dofla.ops.window.chunked import takes_fused_lse
from dofla.registry import Registry

SCOPES = ("kernel", "layer", "model")
DEFAULT_QUERY_CHUNK = 128
# Above this many (B * H * T * T) pairs the chunks are recomputed in the backward pass instead of stored.
CHECKPOINT_ELEMENTS = 2**25
# On GPUs kernel launches, not caches, set the pace: chunks grow to about this many (B * H * C * T) pairs.
CUDA_CHUNK_ELEMENTS = 2**26


@dataclass(frozen=True)
class Loss:
    """A registered loss and its scope (what its function takes):

    - "kernel": ``rows(teacher P (B, H, C, T), student_log (B, H, C, T), normaliser (B, H, C, 1),
      allowed (B, 1, C, T)) -> (B, H, C)``, the loss of each query row (see :func:`_row_logs`);
    - "layer": ``function(student, call, *, key_mask, query_chunk) -> 0-dim``, one converted layer;
    - "model": ``function(logits, labels, teacher_logits, *, kl_weight, temperature) -> 0-dim``, end to end.
    """

    name: str
    function: Callable[..., Tensor]
    scope: str

    @property
    def layerwise(self) -> bool:
        """Trained layer by layer from one teacher-forced forward (kernel and layer scopes)."""
        return self.scope != "model"


LOSSES: Registry[Loss] = Registry("loss")


def register_loss(name: str, *, scope: str = "layer"):
    """Function decorator: make ``function`` the loss ``name`` of ``scope`` ("kernel", "layer" or "model")."""
    if scope not in SCOPES:
        raise ValueError(f"a loss scope is one of {', '.join(SCOPES)}, not {scope!r}")

    def register(function):
        LOSSES.add(name, Loss(name, function, scope))
        return function

    return register


def layerwise_loss_names() -> list[str]:
    """The registered losses trained layer by layer (for the stored-teacher-state and benchmark options)."""
    return [name for name, loss in LOSSES.items() if loss.layerwise]


def _expand_heads(tensor: Tensor | None, num_heads: int) -> Tensor | None:
    """(B, Hk, ...) -> (B, H, ...): query head h reads key/value head h // (H / Hk)."""
    if tensor is None or tensor.shape[1] == num_heads:
        return tensor
    return tensor.repeat_interleave(num_heads // tensor.shape[1], dim=1)


def _row_logs(
    start: int,
    query: Tensor,
    key: Tensor,
    q_features: Tensor,
    k_features: Tensor,
    log_scale: Tensor,
    key_present: Tensor,
    scaling: float,
    window: int | None,
    window_factor: Tensor | None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Teacher P and the student's log weights for the query rows ``start : start + C`` against T keys.

    query (B, H, C, D), key (B, H, T, D), q_features (B, H, C, F), k_features (B, H, T, F),
    log_scale (B, H, T), key_present (B, T) bool. Returns teacher P (B, H, C, T) (0 outside the causal,
    present keys), the student's unnormalised log weights log a (B, H, C, T) (finite; their value where
    P is 0 does not matter), its row normaliser log sum_j a_ij (B, H, C, 1) over the allowed keys,
    allowed (B, 1, C, T) bool and the rows' weights (B, 1, C): 1 for real query tokens, 0 for padding.
    """
    chunk, length = query.shape[2], key.shape[2]
    query_index = torch.arange(start, start + chunk, device=query.device)[:, None]  # (C, 1)
    key_index = torch.arange(length, device=query.device)[None, :]  # (1, T)
    allowed = (key_index <= query_index)[None, None] & key_present[:, None, None, :]  # (B, 1, C, T)
    # rows without any visible key (left padding) attend everywhere so no NaN appears; they get weight 0
    row_visible = allowed.any(-1, keepdim=True)  # (B, 1, C, 1)
    row_weight = (row_visible[..., 0] & key_present[:, None, start : start + chunk]).to(query.dtype)
    allowed = allowed | ~row_visible
    # 0 where a key may be seen, -inf elsewhere: one addition instead of a masked copy per (B, H, C, T) block
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(
        ~allowed, float("-inf")
    )
    scores = soft_cap(scaling * (query @ key.transpose(-1, -2)), softcap)  # (B, H, C, T)
    teacher = torch.softmax(scores + bias, dim=-1)  # 0 where not allowed

    dot = q_features @ k_features.transpose(-1, -2)  # (B, H, C, T)
    linear_log = torch.log(dot.clamp_min(1e-30)) + log_scale[:, :, None, :]  # (B, H, C, T), finite
    if window is None:
        student_log = linear_log  # finite everywhere; only allowed keys enter the normaliser
        normaliser = torch.logsumexp(linear_log + bias, dim=-1, keepdim=True)
    else:
        in_window = allowed & (key_index > query_index - window)[None, None]
        left_window = allowed & (key_index <= query_index - window)[None, None]
        window_scores = scores.masked_fill(~in_window, float("-inf"))
        window_max = window_scores.amax(-1, keepdim=True)  # (B, H, C, 1)
        window_max = torch.where(torch.isfinite(window_max), window_max, torch.zeros_like(window_max))
        old_scale = log_scale[:, :, None, :].masked_fill(~left_window, float("-inf"))
        old_max = old_scale.amax(-1, keepdim=True)  # (B, H, C, 1): offset of the linear part
        old_max = torch.where(torch.isfinite(old_max), old_max, torch.zeros_like(old_max))
        gamma = window_factor.view(1, -1, 1, 1)
        window_log = torch.log(gamma) + window_scores - window_max
        old_log = (torch.log1p(-gamma) + linear_log - old_max).masked_fill(~left_window, float("-inf"))
        masked = torch.where(in_window, window_log, old_log)  # -inf outside the allowed keys
        normaliser = torch.logsumexp(masked, dim=-1, keepdim=True)
        student_log = torch.where(allowed, masked, torch.zeros_like(masked))  # finite, 0 where P is 0
    return teacher, student_log, normaliser, allowed, row_weight


def _chunk_loss(rows: Callable[..., Tensor], start: int, *tensors_and_options) -> Tensor:
    """Sum over the chunk's present rows of the row loss ``rows`` (a 0-dim tensor)."""
    teacher, student_log, normaliser, allowed, row_weight = _row_logs(start, *tensors_and_options)
    return (rows(teacher, student_log, normaliser, allowed) * row_weight).sum()


@register_loss("softmax", scope="kernel")
def cross_entropy_rows(teacher: Tensor, student_log: Tensor, normaliser: Tensor, allowed: Tensor) -> Tensor:
    """-sum_j P_ij log A_ij per row (B, H, C), with sum_j P_ij = 1 over the allowed keys."""
    return normaliser[..., 0] - (teacher * student_log).sum(-1)


@register_loss("l2", scope="kernel")
def l2_rows(teacher: Tensor, student_log: Tensor, normaliser: Tensor, allowed: Tensor) -> Tensor:
    """sum_j (P_ij - A_ij)^2 per row (B, H, C)."""
    student = torch.where(allowed, torch.exp(student_log - normaliser), torch.zeros_like(teacher))
    return (teacher - student).pow(2).sum(-1)


def kernel_loss(
    kind: str,
    query: Tensor,
    key: Tensor,
    q_features: Tensor,
    k_features: Tensor,
    k_log_scale: Tensor | None,
    *,
    scaling: float,
    key_mask: Tensor | None = None,
    window: int | None = None,
    window_factor: Tensor | None = None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    softcap: float | None = None,
) -> Tensor:
    """The kernel-scope loss ``kind`` (e.g. "softmax", "l2") of one layer, averaged over present query rows
    and heads.

    query (B, H, T, D) and key (B, Hkv, T, D) as the teacher saw them (after rotary); q_features
    (B, H, T, F), k_features (B, Hs, T, F), k_log_scale (B, Hs, T) or None from ``student.features``;
    key_mask (B, T) bool, True for real tokens. Hybrid layers pass their ``window`` and window_factor
    gamma (H,). ``softcap``: the teacher's logit soft-capping (Gemma-2), on the teacher's rows and the
    student's window scores. Computed in float32 (float64 for float64 inputs), ``query_chunk`` rows at a time.
    """
    rows_loss = _kernel_rows(kind)
    if (window is None) != (window_factor is None):
        raise DoflaError("hybrid kernel losses need both window and window_factor.")
    batch, num_heads, length, _ = query.shape
    if query.is_cuda:
        query_chunk = max(query_chunk, CUDA_CHUNK_ELEMENTS // (batch * num_heads * length))
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    keys = _expand_heads(key, num_heads).to(dtype)  # (B, H, T, D)
    k_feats = _expand_heads(k_features, num_heads).to(dtype)  # (B, H, T, F)
    if k_log_scale is None:
        log_scale = torch.zeros(batch, num_heads, length, dtype=dtype, device=query.device)
    else:
        log_scale = _expand_heads(k_log_scale, num_heads).to(dtype)  # (B, H, T)
    present = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    if key_mask is not None:
        present = key_mask.to(torch.bool)
    gamma = None if window_factor is None else window_factor.to(dtype)
    total = query.new_zeros((), dtype=dtype)
    # recompute chunks in the backward pass only when keeping them would cost real memory
    use_checkpoint = torch.is_grad_enabled() and batch * num_heads * length * length > CHECKPOINT_ELEMENTS
    for start in range(0, length, query_chunk):
        stop = min(start + query_chunk, length)  # causal: these queries see keys [0, stop) only
        arguments = (
            query[:, :, start:stop].to(dtype),
            keys[:, :, :stop],
            q_features[:, :, start:stop].to(dtype),
            k_feats[:, :, :stop],
            log_scale[:, :, :stop],
            present[:, :stop],
            float(scaling),
            window,
            gamma,
            softcap,
        )
        if use_checkpoint:
            total = total + checkpoint(_chunk_loss, rows_loss, start, *arguments, use_reentrant=False)
        else:
            total = total + _chunk_loss(rows_loss, start, *arguments)
    rows = present.sum() * num_heads
    return total / rows.clamp_min(1)


def _kernel_rows(kind: str) -> Callable[..., Tensor]:
    loss = LOSSES[kind]
    if loss.scope != "kernel":
        kernels = [name for name, entry in LOSSES.items() if entry.scope == "kernel"]
        raise DoflaError(f"{kind!r} is not a kernel loss; kernel losses are {', '.join(kernels)}.")
    return loss.function


def output_mse_loss(student_output: Tensor, teacher_output: Tensor, key_mask: Tensor | None = None) -> Tensor:
    """Mean squared error per element of the attention outputs (B, T, H, Dv), before the output projection.

    Padded positions (key_mask (B, T) False) are left out. Computed in float32.
    """
    difference = (student_output.float() - teacher_output.float()).pow(2)  # (B, T, H, Dv)
    if key_mask is None:
        return difference.mean()
    weights = key_mask.to(difference.dtype)[:, :, None, None]
    count = weights.sum() * difference.shape[2] * difference.shape[3]
    return (difference * weights).sum() / count.clamp_min(1)


@register_loss("direct", scope="model")
def direct_loss(
    logits: Tensor,
    labels: Tensor,
    teacher_logits: Tensor | None = None,
    *,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
) -> Tensor:
    """Next-token cross-entropy of logits (B, T, V) against labels (B, T) (position t predicts t + 1;
    label -100 is ignored), plus ``kl_weight * T^2 * KL(teacher || student)`` on temperature-softened
    distributions when teacher_logits (B, T, V) are given. Mean per predicted token, float32.
    """
    shifted = logits[:, :-1].float()  # (B, T-1, V)
    targets = labels[:, 1:]
    loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=-100)
    if teacher_logits is not None and kl_weight > 0:
        keep = (targets != -100).reshape(-1)
        student_log = torch.log_softmax(shifted / temperature, dim=-1).reshape(-1, shifted.shape[-1])[keep]
        teacher_log = torch.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)
        teacher_log = teacher_log.reshape(-1, shifted.shape[-1])[keep]
        kl = F.kl_div(student_log, teacher_log, log_target=True, reduction="batchmean")
        loss = loss + kl_weight * temperature**2 * kl
    return loss


def direct_loss_in_pieces(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    labels: Tensor,
    teacher_hidden: Tensor | None = None,
    *,
    rows_per_piece: int,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`direct_loss` from the final hidden states (B, T, E) instead of the logits: ``head`` (hidden
    (R, E) -> float32 logits (R, V), the model's output head with its soft-capping) runs on
    ``rows_per_piece`` predicted positions at a time, each piece checkpointed (its logits are made again
    for the backward pass), so no (B, T, V) tensor is ever held: what a 262k-entry vocabulary needs.
    teacher_hidden (B, T, E): the teacher's final hidden states for the KL term (no gradient)."""
    width = hidden.shape[-1]
    rows = hidden[:, :-1].reshape(-1, width)  # (B * (T-1), E)
    targets = labels[:, 1:].reshape(-1)
    teacher_rows = None if teacher_hidden is None else teacher_hidden[:, :-1].reshape(-1, width).detach()
    with_kl = teacher_rows is not None and kl_weight > 0

    def piece_sums(piece: Tensor, piece_targets: Tensor, teacher_piece: Tensor | None) -> Tensor:
        logits = head(piece)  # (R, V) float32
        cross_entropy = F.cross_entropy(logits, piece_targets, ignore_index=-100, reduction="sum")
        if not with_kl:
            return cross_entropy[None]
        keep = piece_targets != -100
        student_log = torch.log_softmax(logits[keep] / temperature, dim=-1)
        with torch.no_grad():
            teacher_log = torch.log_softmax(head(teacher_piece[keep]) / temperature, dim=-1)
        kl = F.kl_div(student_log, teacher_log, log_target=True, reduction="sum")
        return torch.stack([cross_entropy, kl])

    sums = None
    for start in range(0, len(rows), max(1, int(rows_per_piece))):
        piece = slice(start, start + max(1, int(rows_per_piece)))
        teacher_piece = teacher_rows[piece] if with_kl else None
        part = checkpoint(piece_sums, rows[piece], targets[piece], teacher_piece, use_reentrant=False)
        sums = part if sums is None else sums + part
    count = (targets != -100).sum().clamp_min(1)
    loss = sums[0] / count
    if with_kl:
        loss = loss + kl_weight * temperature**2 * sums[1] / count
    return loss


@register_loss("output_mse", scope="layer")
def output_mse_layer_loss(
    student, call, *, key_mask: Tensor | None = None, query_chunk: int = DEFAULT_QUERY_CHUNK
) -> Tensor:
    """:func:`output_mse_loss` of the student's attention output against the teacher's on one call."""
    output = student(
        call.query, call.key, call.value, call.attention_mask, scaling=call.scaling
    )  # (B, T, H, Dv)
    return output_mse_loss(output, call.output, key_mask)


@register_loss("projected_mse", scope="layer")
def projected_mse_layer_loss(
    student, call, *, key_mask: Tensor | None = None, query_chunk: int = DEFAULT_QUERY_CHUNK
) -> Tensor:
    """The mean squared error, per element of the hidden size, of the student's attention output against
    the teacher's after the teacher's output projection (its bias cancels in the difference). Two outputs
    as far apart before the projection can be far apart by different amounts after it: this loss weighs
    the error as the residual stream receives it. Padded positions are left out, as in ``output_mse``."""
    output = student(
        call.query, call.key, call.value, call.attention_mask, scaling=call.scaling
    )  # (B, T, H, Dv)
    projection = output_projection(call.module)
    dtype = next(projection.parameters()).dtype
    difference = projection(output.flatten(2).to(dtype)) - projection(call.output.flatten(2).to(dtype))
    return _mean_square(difference[..., None], key_mask)  # (B, T, hidden, 1)


@torch.no_grad()
def causal_log_sum_exp(
    query: Tensor,
    key: Tensor,
    *,
    scaling: float,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> Tensor:
    """The teacher's causal softmax log-sum-exp per query, query (B, H, T, D), key (B, Hk, T, D) -> (B, H, T)
    in float32 (float64 for float64 inputs), a chunk of queries at a time (O(chunk * T) memory); absent keys
    (key_mask (B, T) False) take no part, a query that sees no key gets -inf. No gradient (a target).
    Without a mask or soft-capping on a CPU, PyTorch's fused causal kernel gives it in one call."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    length = query.shape[2]
    keys = _expand_heads(key, query.shape[1]).to(dtype)  # (B, H, T, D)
    queries = query.to(dtype)
    if key_mask is None and not softcap and takes_fused_lse(queries, keys, keys):
        # PyTorch's fused CPU kernel returns the log-sum-exp beside its output (keys stand in for values)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, keys, is_causal=True, scale=scaling
        )[1]
    columns = torch.arange(length, device=query.device)
    pieces = []
    for start in range(0, length, query_chunk):
        queries = query[:, :, start : start + query_chunk].to(dtype)
        scores = soft_cap(scaling * (queries @ keys.transpose(-1, -2)), softcap)  # (B, H, C, T)
        visible = columns[None, :] <= columns[start : start + queries.shape[2], None]  # (C, T)
        if key_mask is not None:
            visible = visible & key_mask[:, None, None, :].to(torch.bool)
        pieces.append(torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1))
    return torch.cat(pieces, dim=-1)


def _mean_square(difference: Tensor, key_mask: Tensor | None) -> Tensor:
    return output_mse_loss(difference, torch.zeros_like(difference), key_mask)


@register_loss("split_mse", scope="layer")
def split_mse_layer_loss(
    student, call, *, key_mask: Tensor | None = None, query_chunk: int = DEFAULT_QUERY_CHUNK
) -> Tensor:
    """``output_mse`` plus the two halves of its error trained apart, for a layer that mixes the window's
    softmax with a memory, ``gamma w + (1 - gamma) m`` (the ``gated_delta`` cell with a window).

    The teacher's output splits exactly the same way, ``o = s w + (1 - s) f``: w is the softmax over the
    window and sinks (the student's own window part: the same q, k, v and scores), s the teacher's
    attention mass on them, ``exp(lse_window - lse_all)`` (both log-sum-exps in O(T) memory), and f its
    output over the keys beyond the window. So the student's error is ``(gamma - s)(w - m) + (1 - s)(m - f)``:
    a mix error and a memory error. Each is added as its own mean square (the mix's with m held fixed, the
    memory's at the teacher's own mix s), so the memory learns what the teacher reads beyond the window at
    the strength the teacher reads it, whatever the student's gamma, and the mix learns the teacher's mass.
    """
    parts_of = getattr(student, "window_memory_parts", None)
    if parts_of is None or student.kind != "hybrid":
        raise DoflaError(
            f"the split_mse loss trains the window and the memory of a hybrid layer apart; layer "
            f"{student.layer_index} ({student.cell_name}, kind {student.kind}) has no such halves: use the "
            "gated_delta cell with a window, or output_mse."
        )
    parts = parts_of(call.query, call.key, call.value, call.attention_mask, scaling=call.scaling)
    window, memory, gamma = parts["window"], parts["memory"], parts["gamma"]  # (B, T, H, Dv), (., ., H, 1)
    everything = causal_log_sum_exp(
        call.query,
        call.key,
        scaling=call.scaling,
        key_mask=key_mask,
        softcap=student.softcap,
        query_chunk=query_chunk,
    )
    share = torch.exp(parts["window_lse"].detach().to(everything.dtype) - everything)  # (B, H, T)
    share = torch.where(torch.isfinite(share), share, torch.ones_like(share)).clamp(0.0, 1.0)
    share = share.transpose(1, 2)[..., None].to(memory.dtype)  # (B, T, H, 1); padded rows: 1, left out
    target = call.output.to(memory.dtype)
    output = gamma * window + (1 - gamma) * memory
    mix_error = (gamma - share) * (window - memory.detach())
    memory_error = share * window + (1 - share) * memory - target
    return (
        output_mse_loss(output, target, key_mask)
        + _mean_square(mix_error, key_mask)
        + _mean_square(memory_error, key_mask)
    )


def check_kernel_loss(kind: str, cell: str, sinks: int) -> None:
    """Kernel losses compare attention weights as the plain ``linear`` cell forms them (no decay, no memory,
    no sinks); for any other cell they would train the wrong weights, so they are refused."""
    if LOSSES[kind].scope == "kernel" and (cell != "linear" or int(sinks) > 0):
        raise DoflaError(
            f"the {kind!r} loss compares the plain linear cell's attention weights; with cell {cell!r} and "
            f"{sinks} sink tokens use a layer loss such as output_mse."
        )


def layer_loss(kind: str, student, call, *, key_mask: Tensor | None = None, query_chunk: int = 128) -> Tensor:
    """The registered loss ``kind`` of one converted layer on one teacher-forced attention call.

    student: a :class:`dofla.attention.LinearAttention`; call: the :class:`dofla.dispatch.AttentionCall`
    of its layer (the teacher's q, k, v and softmax output). Inputs are detached: gradients reach this
    layer's student only.
    """
    loss = LOSSES[kind]
    if not loss.layerwise:
        raise DoflaError(
            f"{kind!r} trains the whole model end to end, not one layer; layer losses are "
            f"{', '.join(layerwise_loss_names())}."
        )
    call = replace(
        call,
        query=call.query.detach(),
        key=call.key.detach(),
        value=call.value.detach(),
        output=call.output.detach(),
    )
    if loss.scope == "layer":
        return loss.function(student, call, key_mask=key_mask, query_chunk=query_chunk)
    check_kernel_loss(kind, student.cell_name, student.sinks)
    q_features, k_features, k_log_scale = student.features(call.query, call.key)
    hybrid = student.kind == "hybrid"
    return kernel_loss(
        kind,
        call.query,
        call.key,
        q_features,
        k_features,
        k_log_scale,
        scaling=call.scaling,
        key_mask=key_mask,
        window=student.window if hybrid else None,
        window_factor=student.window_factor() if hybrid else None,
        query_chunk=query_chunk,
        softcap=student.softcap,
    )
