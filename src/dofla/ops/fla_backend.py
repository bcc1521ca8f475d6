"""Optional GPU backend: the chunked linear sums and the gated delta rule on flash-linear-attention's kernels.

What dispatches where. On a CUDA tensor in float32, bfloat16 or float16, with ``fla`` (package ``fla-core``)
importable and the environment variable ``DOFLA_FLA`` not set to ``0``, the chunked form (training and
prefill) of the cells runs its linear part on fla's kernels:

- ``linear`` and ``gla`` (alone or hybrid): ``linear_attention_sums`` of :mod:`dofla.ops.linear.chunked` becomes
  one call of fla's simple GLA kernel (``fla.ops.simple_gla.chunk_simple_gla``); the window's softmax,
  the sinks and the shared normalisation stay dofla's PyTorch code, unchanged.
- ``gated_delta`` (alone or hybrid): the memory of :func:`dofla.ops.chunked_gated_delta_rule` becomes one
  call of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (key dimension at most 256, fla's limit;
  wider keys stay on PyTorch). The window mix stays PyTorch.

Training on Hopper GPUs (compute capability 9) with Triton 3.4.0 up to 3.7.0 and no ``tilelang``: fla refuses
the backward of its gated kernels there (those Triton versions give wrong gradients), so while autograd records
(``torch.is_grad_enabled()``) the ops stay on PyTorch and only no-grad work (prefill, evaluation, the
teacher-forced forward without gradients) uses the kernels; a warning says so once. Upgrading Triton to
3.7.1 or installing ``tilelang`` lifts this.

Everything else (CPU, float64, the naive and recurrent forms, so decoding) is dofla's PyTorch code exactly
as without this module; decoding stays there because one token's recurrent update takes fewer operators
than this module's bookkeeping around a kernel call. States come back as dofla's own ``LinearState`` / ``DeltaState``, so a prefill on
the kernels continues in the recurrent form. The kernels run in dofla's compute dtype (float32), which
Triton multiplies in TF32 on recent GPUs: results equal the PyTorch path to float tolerance, not bit for
bit. The wrapping below is written against fla's documented semantics and tested on CPU with a PyTorch
stand-in kernel (``tests/test_fla_backend.py``); the real kernels are tested there only on a GPU.

Linear sums as simple GLA. dofla weighs key j at query t by ``exp(s_j - m_t)`` (s the key log scales,
m_t their running maximum, the state's offset). Simple GLA computes
``o_t = scale sum_{j<=t} exp(G_t - G_j) (q_t . k_j) v_j + scale exp(G_t) q_t . h0`` with ``G`` the cumulative
sum of per-token log gates ``g``. Taking ``g_t = m_{t-1} - m_t <= 0`` (so ``G_t - G_j = m_j - m_t``) and
keys ``k_j exp(s_j - m_j)`` (each factor <= 1) gives exactly dofla's weights, and the final state is
dofla's ``LinearState`` relative to its offset m_T. Values carry a column of ones, so one call gives the
numerator and the denominator. Before the first present key m is -inf; there the offsets take the first
finite one (nothing is summed yet, so the choice only has to be finite). Every gate is <= 0 and every key
factor <= 1 whatever the lengths and log scales, as in the PyTorch form. fla has no grouped queries: keys,
values and gates are repeated to the query heads and the state of a group's first head is returned
(all heads of a group hold the same state).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from collections.abc import Callable

import torch
from packaging.version import Version
from torch import Tensor

from dofla.errors import DoflaError
from dofla.ops.state import LinearState, exp_relative

ENVIRONMENT_SWITCH = "DOFLA_FLA"  # "0" keeps every op on PyTorch
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 (tests' ground truth) stays PyTorch
MAX_DELTA_KEY_DIM = 256  # fla's gated delta rule asserts K <= 256

# Kernels with the signatures of fla.ops.simple_gla.chunk_simple_gla and
# fla.ops.gated_delta_rule.chunk_gated_delta_rule: (outputs, final state or None).
SimpleGLAKernel = Callable[..., tuple[Tensor, Tensor | None]]
GatedDeltaKernel = Callable[..., tuple[Tensor, Tensor | None]]


def enabled() -> bool:
    """False when the environment variable ``DOFLA_FLA`` is ``0`` (force the PyTorch path everywhere)."""
    return os.environ.get(ENVIRONMENT_SWITCH, "1").strip() != "0"


@functools.cache
def fla_kernels() -> tuple[SimpleGLAKernel, GatedDeltaKernel] | None:
    """fla's (chunk_simple_gla, chunk_gated_delta_rule), or None when fla is not installed; a DoflaError when
    it is installed but does not import (e.g. a Triton it does not support)."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla
    except (ImportError, RuntimeError, AttributeError) as error:
        raise DoflaError(
            f"fla is installed but its kernels do not import ({error}); install the pinned version with "
            "`pip install -c constraints.txt -e '.[fla]'`, or set DOFLA_FLA=0 to run on PyTorch."
        ) from error
    return chunk_simple_gla, chunk_gated_delta_rule


def gated_backward_problem(
    capability: tuple[int, int], triton_version: str, has_tilelang: bool
) -> str | None:
    """Why fla's gated kernels cannot be differentiated on this setup, or None: fla raises in the backward of
    its gated kernels on Hopper (capability 9.x) with Triton >= 3.4.0 and < 3.7.1 unless tilelang is there."""
    if capability[0] != 9 or has_tilelang:
        return None
    if Version("3.4.0") <= Version(Version(triton_version).base_version) < Version("3.7.1"):
        return (
            f"fla's gated kernels have no backward on Hopper GPUs with Triton {triton_version} (fla needs "
            "Triton >= 3.7.1 or tilelang there), so training runs dofla's PyTorch ops and only no-grad "
            "prefill and evaluation use fla's kernels; upgrade Triton or `pip install tilelang` to train on them"
        )
    return None


@functools.cache
def backward_problem(device_index: int) -> str | None:
    """:func:`gated_backward_problem` for CUDA device ``device_index`` (warned once when there is one)."""
    import triton

    problem = gated_backward_problem(
        torch.cuda.get_device_capability(device_index),
        triton.__version__,
        importlib.util.find_spec("tilelang") is not None,
    )
    if problem is not None:
        warnings.warn(problem, stacklevel=3)
    return problem


def available(tensor: Tensor) -> bool:
    """Whether ops on ``tensor`` dispatch to fla: a CUDA tensor of a kernel dtype, fla installed, not disabled,
    and either no gradients recorded or fla's backward usable on this GPU (:func:`backward_problem`)."""
    if not (tensor.is_cuda and tensor.dtype in KERNEL_DTYPES and enabled() and fla_kernels() is not None):
        return False
    return not (torch.is_grad_enabled() and backward_problem(tensor.device.index or 0) is not None)


def simple_gla_kernel(tensor: Tensor) -> SimpleGLAKernel | None:
    """The kernel for the linear sums of the chunked linear and hybrid ops on ``tensor``, or None (PyTorch)."""
    return fla_kernels()[0] if available(tensor) else None


def gated_delta_kernel(tensor: Tensor, key_dim: int) -> GatedDeltaKernel | None:
    """The kernel for the chunked gated delta rule on ``tensor`` with keys of ``key_dim``, or None (PyTorch)."""
    return fla_kernels()[1] if available(tensor) and key_dim <= MAX_DELTA_KEY_DIM else None


def _to_query_heads(tensor: Tensor, group: int) -> Tensor:
    """(B, Hk, T, X) -> fla's layout (B, T, Hk * G, X): each key/value head repeated for its G query heads."""
    batch, num_kv_heads, length, width = tensor.shape
    if group > 1:
        tensor = tensor.unsqueeze(2).expand(batch, num_kv_heads, group, length, width)
    return tensor.reshape(batch, num_kv_heads * group, length, width).transpose(1, 2)


def _state_to_query_heads(state: Tensor, group: int) -> Tensor:
    """(B, Hk, K, V) -> (B, Hk * G, K, V), contiguous (fla reads the initial state as given)."""
    return state.repeat_interleave(group, dim=1) if group > 1 else state.contiguous()


def _first_of_group(state: Tensor, group: int) -> Tensor:
    """(B, Hk * G, K, V) -> (B, Hk, K, V): the state of each group's first query head."""
    batch, heads = state.shape[:2]
    return state.view(batch, heads // group, group, *state.shape[2:])[:, :, 0]


def kernel_linear_attention_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_scale: Tensor | None,
    state: LinearState | None,
    chunk_size: int,
    *,
    kernel: SimpleGLAKernel,
) -> tuple[Tensor, Tensor, LinearState]:
    """``dofla.ops.linear.chunked.linear_attention_sums`` computed by one call of a simple GLA ``kernel``.

    Same arguments and results: q (B, Hk, G, T, F), k (B, Hk, T, F), v (B, Hk, T, Dv), log_scale (B, Hk, T)
    or None, all in the compute dtype; returns numerator (B, Hk, G, T, Dv) and denominator (B, Hk, G, T)
    relative to exp(m_t), and the LinearState after the last token. ``chunk_size`` is the PyTorch form's
    and is not passed on (the kernel chunks by itself). Exact: the state's offset and token count (the
    same running maximum as the PyTorch form). Equal up to rounding: the sums and the state's kv and
    normaliser (the kernel rebuilds ``exp(m_j - m_t)`` from a cumulative sum of gates, in TF32 products).
    """
    batch, num_kv_heads, group, length, feature_dim = q.shape
    value_dim = v.shape[-1]
    if log_scale is None:
        if state is not None:
            raise ValueError("linear_attention_sums needs explicit log scales when continuing from a state")
        log_scale = torch.zeros(k.shape[:3], dtype=q.dtype, device=q.device)
    if state is None:
        initial_offset = torch.full((batch, num_kv_heads), float("-inf"), dtype=q.dtype, device=q.device)
    else:
        initial_offset = state.log_offset.to(q.dtype)
    # m before the call and after each token, as in the PyTorch form: (B, Hk, T + 1), non-decreasing.
    offsets = torch.cat(
        [
            initial_offset[..., None],
            torch.maximum(torch.cummax(log_scale, -1).values, initial_offset[..., None]),
        ],
        dim=-1,
    )
    finite = torch.isfinite(offsets)
    first_finite = torch.where(finite, offsets, float("inf")).amin(-1, keepdim=True)  # (B, Hk, 1)
    first_finite = torch.where(torch.isfinite(first_finite), first_finite, 0.0).detach()
    reference = torch.where(finite, offsets, first_finite)  # finite everywhere; = m wherever a key was seen
    log_gate = reference[..., :-1] - reference[..., 1:]  # (B, Hk, T): g_t = m_{t-1} - m_t <= 0
    keys = k * exp_relative(log_scale, reference[..., 1:])[..., None]  # (B, Hk, T, F): k_j exp(s_j - m_j)
    values = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)  # (B, Hk, T, Dv + 1)

    initial_state = None
    if state is not None:
        joined = torch.cat([state.kv, state.normalizer[..., None]], dim=-1).to(q.dtype)  # (B, Hk, F, Dv + 1)
        seen = torch.isfinite(initial_offset)[..., None, None]  # an offset of -inf: nothing summed yet
        initial_state = _state_to_query_heads(torch.where(seen, joined, 0.0), group)
    queries = q.reshape(batch, num_kv_heads * group, length, feature_dim).transpose(1, 2)  # (B, T, H, F)
    out, final = kernel(
        queries,
        _to_query_heads(keys, group),  # (B, T, H, F)
        _to_query_heads(values, group),  # (B, T, H, Dv + 1)
        _to_query_heads(log_gate[..., None], group)[..., 0],  # (B, T, H)
        scale=1.0,
        initial_state=initial_state,
        output_final_state=True,
    )
    sums = out.to(q.dtype).transpose(1, 2).reshape(batch, num_kv_heads, group, length, value_dim + 1)
    final = _first_of_group(final.to(q.dtype), group)  # (B, Hk, F, Dv + 1)
    previous_tokens = 0 if state is None else state.num_tokens
    new_state = LinearState(  # copies, as in the PyTorch form: views would keep the G-fold kernel state alive
        final[..., :value_dim].clone(),
        final[..., value_dim].clone(),
        offsets[..., -1].clone(),
        previous_tokens + length,
    )
    return sums[..., :value_dim], sums[..., value_dim], new_state


def kernel_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    memory: Tensor | None,
    *,
    kernel: GatedDeltaKernel,
) -> tuple[Tensor, Tensor]:
    """The chunked gated delta rule (semantics in :mod:`dofla.ops.delta`) by one call of a gated delta
    ``kernel``, on inputs already prepared by that module (compute dtype, absent keys masked).

    q (B, H, T, K), k (B, Hk, T, K), v (B, Hk, T, Dv), log_decay (B, Hk, T) <= 0, beta (B, Hk, T),
    memory (B, Hk, K, Dv) the state before the call (None: zeros). Returns out (B, H, T, Dv) and the memory after the
    last token (B, Hk, K, Dv), both in q's dtype. fla's update ``h = exp(g) h; h += k (beta (v - h^T k))^T;
    o = scale h^T q`` is dofla's; keys are not normalised again (``use_qk_l2norm_in_kernel=False``).
    """
    batch, num_heads, length, key_dim = q.shape
    group = num_heads // k.shape[1]
    out, final = kernel(
        q.transpose(1, 2),  # (B, T, H, K)
        _to_query_heads(k, group),  # (B, T, H, K)
        _to_query_heads(v, group),  # (B, T, H, Dv)
        _to_query_heads(log_decay[..., None], group)[..., 0],  # (B, T, H)
        _to_query_heads(beta[..., None], group)[..., 0],  # (B, T, H)
        scale=1.0,
        initial_state=None if memory is None else _state_to_query_heads(memory, group),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    return out.to(q.dtype).transpose(1, 2), _first_of_group(final.to(q.dtype), group).clone()
