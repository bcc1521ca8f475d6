"""The flash-linear-attention backend (``dofla.ops.fla_backend``).

On CPU (always): the wrapping math, with PyTorch stand-ins for fla's kernels written as the recurrences fla
documents. The chunked ops given a stand-in kernel must equal the PyTorch ops (outputs, states and
gradients, float64), with grouped queries, odd lengths, padding and a continuation from a state; the cells
must pass the kernels when the backend offers them and give the same outputs and gradients.

On a CUDA GPU with fla-core installed (``pip install -c constraints.txt -e '.[fla]'``; never in CI): the
stand-ins against fla's real kernels, the ops on fla's kernels against the PyTorch ops, in float32 and
bfloat16, forward and backward (forward only where fla refuses its gated backward: Hopper with Triton
3.4.0-3.7.0), and the cells dispatching there. Run them with ``pytest tests/test_fla_backend.py`` on the GPU
machine (``bench/gpu_run.sh`` does). On one H200 (Triton 3.6.0) the stand-in and cell tests passed and the
op-level tests failed, their cause not yet printed (``bench/results/gpu_h200_recipes.md``).
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from ops_helpers import relative_error

from dofla.cache import RecurrentCacheLayer
from dofla.cells import build_student
from dofla.config import LayerPlan
from dofla.convert import convert, plan_for
from dofla.errors import DoflaError
from dofla.models import build_tiny_model
from dofla.ops import (
    DeltaInputs,
    HybridInputs,
    HybridOptions,
    LinearInputs,
    chunked_gated_delta_rule,
    chunked_hybrid_attention,
    chunked_linear_attention,
    fla_backend,
    recurrent_hybrid_attention,
)

B, H, HKV = 2, 4, 2  # grouped queries: two query heads per key/value head
HAS_GPU_AND_FLA = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
gpu = pytest.mark.skipif(
    not HAS_GPU_AND_FLA, reason="needs a CUDA GPU and fla-core (pip install -c constraints.txt -e '.[fla]')"
)


def fla_differentiates() -> bool:
    """Whether fla's gated kernels have a backward on this GPU (fla_backend.backward_problem)."""
    return fla_backend.backward_problem(0) is None


# ------------------------------------------------------------------ stand-ins: fla's kernels as recurrences


def stand_in_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False):
    """fla's ``chunk_simple_gla`` as its recurrence: q, k (B, T, H, K), v (B, T, H, V), g (B, T, H) log gates,
    initial_state (B, H, K, V). ``h_t = exp(g_t) h_{t-1} + k_t v_t^T``, ``o_t = scale h_t^T q_t``.
    Returns o (B, T, H, V) and h_T (or None)."""
    batch, length, heads, key_dim = q.shape
    scale = key_dim**-0.5 if scale is None else scale
    h = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(length):
        if g is not None:
            h = h * g[:, t, :, None, None].exp()
        h = h + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outputs, dim=1), (h if output_final_state else None)


def stand_in_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False
):
    """fla's ``chunk_gated_delta_rule`` as its recurrence (shapes as above, beta (B, T, H)):
    ``h = exp(g_t) h``, ``h += k_t (beta_t (v_t - h^T k_t))^T``, ``o_t = scale h^T q_t``."""
    batch, length, heads, key_dim = q.shape
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    scale = key_dim**-0.5 if scale is None else scale
    h = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(length):
        h = h * g[:, t, :, None, None].exp()
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t], h)
        h = h + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - recalled))[:, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], h))
    return torch.stack(outputs, dim=1), (h if output_final_state else None)


# ------------------------------------------------------------------ cases: inputs and a run with or without a kernel


def leaves(generator, device, dtype, **shapes):
    """Leaf tensors drawn in float64 on CPU (the same numbers on every device), then moved and cast."""
    drawn = {}
    for name, (shape, kind) in shapes.items():
        tensor = (
            torch.rand(shape, generator=generator)
            if kind == "positive"
            else torch.randn(shape, generator=generator)
        )
        drawn[name] = tensor.double().to(device=device, dtype=dtype).requires_grad_()
    return drawn


def key_mask(length, split, device):
    """Row 0: no present key in the whole first call (its state enters the second call empty); row 1: holes."""
    mask = torch.ones(B, length, dtype=torch.bool)
    mask[0, :split] = False
    mask[1, 2] = mask[1, split + 1] = False
    return mask.to(device)


def gate_precision(tensor):
    """Gates in float32 at least, as the cells compute them (``TokenGate``), also for bfloat16 inputs."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def gla_log_scales(gate_logits, k_log_scale):
    """The gla cell's key log scales: the feature map's minus the cumulative log decay (grows with t), with
    decays alpha = sigmoid(2 x + 2) (mostly remembering: memories of a few to tens of tokens)."""
    log_alpha = F.logsigmoid(2 * gate_precision(gate_logits) + 2)
    return gate_precision(k_log_scale) - torch.cumsum(log_alpha, dim=-1)


class LinearCase:
    """Two calls of chunked linear attention (the second from the first's state)."""

    def __init__(
        self, device="cpu", dtype=torch.float64, length=13, split=7, log_scales=True, dims=(5, 3), seed=0
    ):
        features, value_dim = dims
        generator = torch.Generator().manual_seed(seed)
        self.inputs = leaves(
            generator,
            device,
            dtype,
            q_features=((B, H, length, features), "positive"),
            k_features=((B, HKV, length, features), "positive"),
            v=((B, HKV, length, value_dim), "normal"),
            gate_logits=((B, HKV, length), "normal"),
            k_log_scale=((B, HKV, length), "normal"),
        )
        self.log_scales, self.split = log_scales, split
        self.mask = key_mask(length, split, device) if log_scales else None

    def run(self, kernel):
        """Outputs and state tensors to differentiate, and the state's exact bookkeeping to compare."""
        x = self.inputs
        log_scale = gla_log_scales(x["gate_logits"], x["k_log_scale"]) if self.log_scales else None
        results, state = [], None
        for part in (slice(0, self.split), slice(self.split, None)):
            out, state = chunked_linear_attention(
                LinearInputs(
                    x["q_features"][:, :, part],
                    x["k_features"][:, :, part],
                    x["v"][:, :, part],
                    None if log_scale is None else log_scale[:, :, part],
                    None if self.mask is None else self.mask[:, part],
                ),
                chunk_size=4,
                initial_state=state,
                return_state=True,
                kernel=kernel,
            )
            results.append(out)
        return [*results, state.kv, state.normalizer], [state.log_offset, state.num_tokens]


class HybridCase:
    """Two calls of the chunked hybrid (window 4, 2 sinks), GLA-like key log scales, then two decoded tokens."""

    def __init__(
        self, device="cpu", dtype=torch.float64, length=13, split=6, window=4, sinks=2, dims=(4, 5, 3), seed=0
    ):
        head_dim, features, value_dim = dims
        generator = torch.Generator().manual_seed(seed)
        self.inputs = leaves(
            generator,
            device,
            dtype,
            query=((B, H, length + 2, head_dim), "normal"),
            key=((B, HKV, length + 2, head_dim), "normal"),
            q_features=((B, H, length + 2, features), "positive"),
            k_features=((B, HKV, length + 2, features), "positive"),
            v=((B, HKV, length + 2, value_dim), "normal"),
            gate_logits=((B, HKV, length + 2), "normal"),
            k_log_scale=((B, HKV, length + 2), "normal"),
            window_logits=((H,), "normal"),
        )
        self.length, self.split, self.window, self.sinks = length, split, window, sinks
        self.mask = key_mask(length + 2, split, device)

    def run(self, kernel):
        x = self.inputs
        log_scale = gla_log_scales(x["gate_logits"], x["k_log_scale"])
        gamma = torch.sigmoid(x["window_logits"])
        options = HybridOptions(scaling=0.5, window=self.window, sinks=self.sinks)
        results, state = [], None
        parts = (slice(0, self.split), slice(self.split, self.length), slice(self.length, None))
        for index, part in enumerate(parts):
            tensors = [x[name][:, :, part] for name in ("query", "key", "q_features", "k_features", "v")]
            inputs = HybridInputs(*tensors, gamma, log_scale[:, :, part], self.mask[:, part])
            if index < 2:  # prefill: the chunked form (on the kernel when given)
                out, state = chunked_hybrid_attention(
                    inputs, options, chunk_size=4, initial_state=state, return_state=True, kernel=kernel
                )
            else:  # decoding: the recurrent form continues from the state
                out, state = recurrent_hybrid_attention(inputs, options, state=state)
            results.append(out)
        linear = state.linear
        return [*results, linear.kv, linear.normalizer], [
            linear.log_offset,
            linear.num_tokens,
            state.num_tokens,
        ]


class DeltaCase:
    """Two calls of the chunked gated delta rule (the second from the first's state)."""

    def __init__(self, device="cpu", dtype=torch.float64, length=11, split=5, dims=(6, 3), seed=0):
        key_dim, value_dim = dims
        generator = torch.Generator().manual_seed(seed)
        self.inputs = leaves(
            generator,
            device,
            dtype,
            q=((B, H, length, key_dim), "normal"),
            k=((B, HKV, length, key_dim), "normal"),
            v=((B, HKV, length, value_dim), "normal"),
            decay_logits=((B, HKV, length), "normal"),
            beta_logits=((B, HKV, length), "normal"),
        )
        self.split = split
        self.mask = key_mask(length, split, device)

    def run(self, kernel):
        x = self.inputs
        log_decay = F.logsigmoid(gate_precision(x["decay_logits"]) + 2)
        beta = torch.sigmoid(gate_precision(x["beta_logits"]))
        results, state = [], None
        for part in (slice(0, self.split), slice(self.split, None)):
            out, state = chunked_gated_delta_rule(
                DeltaInputs(
                    x["q"][:, :, part],
                    x["k"][:, :, part],
                    x["v"][:, :, part],
                    log_decay[:, :, part],
                    beta[:, :, part],
                    self.mask[:, part],
                ),
                normalize_keys=True,
                chunk_size=4,
                initial_state=state,
                return_state=True,
                kernel=kernel,
            )
            results.append(out)
        return [*results, state.kv], [state.num_tokens]


def values_and_gradients(case, kernel, differentiate=True):
    """The case's differentiable results, exact bookkeeping and gradients of a fixed random weighting (no
    gradients, [], with ``differentiate=False``)."""
    if not differentiate:
        with torch.no_grad():
            tensors, exact = case.run(kernel)
        return [tensor.detach() for tensor in tensors], exact, []
    tensors, exact = case.run(kernel)
    generator = torch.Generator().manual_seed(1)
    loss = sum(
        (
            tensor.double()
            * torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.device)
        ).sum()
        for tensor in tensors
    )
    inputs = list(case.inputs.values())
    gradients = torch.autograd.grad(loss, inputs, allow_unused=True)
    gradients = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, gradients, strict=True)]
    return [tensor.detach() for tensor in tensors], exact, gradients


CPU_CASES = {
    "linear": lambda: LinearCase(log_scales=False),
    "linear_gla_padded": lambda: LinearCase(log_scales=True),
    "hybrid_sinks_padded": lambda: HybridCase(),
    "gated_delta_padded": lambda: DeltaCase(),
}
STAND_INS = {"linear": stand_in_simple_gla, "hybrid": stand_in_simple_gla, "gated": stand_in_gated_delta_rule}


# ------------------------------------------------------------------ CPU: the wrapping math


@pytest.mark.parametrize("name", CPU_CASES)
def test_ops_on_a_stand_in_kernel_equal_the_pytorch_ops(name):
    case = CPU_CASES[name]()
    kernel = STAND_INS[name.split("_")[0]]
    expected, expected_exact, expected_gradients = values_and_gradients(case, None)
    got, got_exact, gradients = values_and_gradients(case, kernel)
    for actual, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-9, atol=1e-10)
    for actual, reference in zip(got_exact, expected_exact, strict=True):  # offsets (with their -inf), counts
        assert torch.equal(torch.as_tensor(actual), torch.as_tensor(reference))
    for actual, reference in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-8, atol=1e-10)
    assert any(gradient.abs().sum() > 0 for gradient in gradients)


def test_linear_sums_on_a_kernel_hold_float32_over_a_long_strongly_decaying_sequence():
    """GLA log scales grow by ~1.3 per token (to ~400 here): the gates the backend builds telescope back to
    the same offsets in float32 without loss."""
    case = HybridCase(dtype=torch.float32, length=300, split=170, window=16, sinks=4)
    with torch.no_grad():
        case.inputs["gate_logits"].sub_(1.6)  # alpha ~ 0.3: strong forgetting
    expected, _, _ = values_and_gradients(case, None)
    got, _, _ = values_and_gradients(case, stand_in_simple_gla)
    for actual, reference in zip(got, expected, strict=True):
        assert relative_error(actual, reference) < 1e-5


def test_the_switch_keeps_cpu_float64_and_disabled_runs_on_pytorch(monkeypatch):
    for tensor in (torch.zeros(1), torch.zeros(1, dtype=torch.float64)):
        assert not fla_backend.available(tensor)
        assert fla_backend.simple_gla_kernel(tensor) is None
        assert fla_backend.gated_delta_kernel(tensor, 64) is None
    assert fla_backend.enabled()
    monkeypatch.setenv("DOFLA_FLA", "0")
    assert not fla_backend.enabled()


@pytest.mark.parametrize(
    "capability, triton_version, has_tilelang, refused",
    [
        ((9, 0), "3.6.0", False, True),  # Hopper, a Triton fla refuses to differentiate on
        ((9, 0), "3.4.0", False, True),
        ((9, 0), "3.7.0+git5a1b", False, True),
        ((9, 0), "3.7.1", False, False),
        ((9, 0), "3.3.1", False, False),
        ((9, 0), "3.6.0", True, False),  # tilelang takes fla's gated backward there
        ((8, 0), "3.6.0", False, False),  # not Hopper
        ((10, 0), "3.6.0", False, False),
    ],
)
def test_the_gated_backward_rule_follows_fla(capability, triton_version, has_tilelang, refused):
    problem = fla_backend.gated_backward_problem(capability, triton_version, has_tilelang)
    assert (problem is not None) == refused
    if refused:
        assert triton_version in problem and "tilelang" in problem


def test_without_a_usable_backward_only_no_grad_work_goes_to_the_kernels(monkeypatch):
    """Where fla cannot differentiate its gated kernels, ops recording gradients stay on PyTorch and no-grad
    ops (prefill, evaluation) still use the kernels; with a usable backward both do."""
    on_gpu = SimpleNamespace(is_cuda=True, dtype=torch.float32, device=SimpleNamespace(index=0))
    monkeypatch.setattr(fla_backend, "fla_kernels", lambda: (stand_in_simple_gla, stand_in_gated_delta_rule))
    for problem, with_grad in ((None, True), ("no backward", False)):
        monkeypatch.setattr(fla_backend, "backward_problem", lambda index, problem=problem: problem)
        assert fla_backend.available(on_gpu) is with_grad
        assert (fla_backend.gated_delta_kernel(on_gpu, 64) is not None) is with_grad
        with torch.no_grad():
            assert fla_backend.available(on_gpu)
            assert fla_backend.simple_gla_kernel(on_gpu) is stand_in_simple_gla


def test_an_fla_that_does_not_import_is_an_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(fla_backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # importing it raises ImportError
    fla_backend.fla_kernels.cache_clear()
    try:
        with pytest.raises(DoflaError, match="fla is installed but its kernels do not import .*DOFLA_FLA=0"):
            fla_backend.fla_kernels()
    finally:
        fla_backend.fla_kernels.cache_clear()


CELL_CASES = [
    ("linear", "hybrid", "hedgehog", True),
    ("gla", "linear", "learnable_prf", True),
    ("gla", "hybrid", "learnable_prf", False),
    ("gated_delta", "linear", "projection", True),
    ("gated_delta", "hybrid", "hedgehog", True),
]


def make_cell(cell, kind, feature_map, share, device="cpu", dtype=torch.float64, feature_dim=6, head_dim=8):
    plan = LayerPlan(
        kind=kind,
        sinks=2 if kind == "hybrid" else 0,
        cell=cell,
        feature_map=feature_map,
        feature_dim=feature_dim,
        share_kv_heads=share,
        window=5,
        options={"chunk_size": 4},
    )
    torch.manual_seed(0)
    shape = dict(layer_index=1, num_heads=H, num_kv_heads=HKV, head_dim=head_dim, scaling=head_dim**-0.5)
    student = build_student(plan, **shape)
    with torch.no_grad():  # parameters away from their initial symmetric values
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return student.to(device=device, dtype=dtype)


def prefill_then_decode(student, length=11, decoded=2, device="cpu", dtype=torch.float64, gradients=True):
    """A prefill of ``length`` tokens (chunked form) and ``decoded`` single tokens (recurrent form) through a
    cache; returns the outputs (B, T, H, D) and the gradients of the inputs and parameters (None without
    ``gradients``)."""
    head_dim = student.head_dim
    generator = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(B, heads, length + decoded, head_dim, generator=generator, dtype=torch.float64)
        .to(device=device, dtype=dtype)
        .requires_grad_()
        for heads in (H, HKV, HKV)
    )
    cache, outputs = RecurrentCacheLayer(), []
    for part in [slice(0, length)] + [slice(t, t + 1) for t in range(length, length + decoded)]:
        student.pending_cache_layer = cache
        outputs.append(student(q[:, :, part], k[:, :, part], v[:, :, part]))
    output = torch.cat(outputs, dim=1)
    if not gradients:
        return output.detach(), None
    weights = torch.linspace(-1, 1, output.numel(), dtype=torch.float64, device=device).view_as(output)
    inputs = [q, k, v, *student.trainable_parameters()]
    return output.detach(), torch.autograd.grad((output.double() * weights).sum(), inputs)


def counting(kernel, calls):
    def counted(*args, **kwargs):
        calls.append(kernel.__name__)
        return kernel(*args, **kwargs)

    return counted


@pytest.mark.parametrize("cell, kind, feature_map, share", CELL_CASES)
def test_cells_pass_the_backend_kernels_and_keep_their_results(monkeypatch, cell, kind, feature_map, share):
    student = make_cell(cell, kind, feature_map, share)
    expected, expected_gradients = prefill_then_decode(student)
    calls = []
    monkeypatch.setattr(fla_backend, "simple_gla_kernel", lambda tensor: counting(stand_in_simple_gla, calls))
    monkeypatch.setattr(
        fla_backend, "gated_delta_kernel", lambda tensor, key_dim: counting(stand_in_gated_delta_rule, calls)
    )
    output, gradients = prefill_then_decode(student)
    assert calls == [
        "stand_in_gated_delta_rule" if cell == "gated_delta" else "stand_in_simple_gla"
    ]  # prefill
    torch.testing.assert_close(output, expected, rtol=1e-9, atol=1e-10)
    for actual, reference in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-8, atol=1e-10)


# ------------------------------------------------------------------ GPU: fla's real kernels (skipped without them)


@gpu
@pytest.mark.parametrize("which", ["simple_gla", "gated_delta"])
def test_stand_ins_follow_fla_kernels(which):
    """The stand-ins above are fla's semantics: fla's kernel (float32, TF32 products) against the stand-in in
    float64 on the same numbers, outputs, final states and gradients (with an initial state, T not a
    multiple of fla's chunk of 64, an odd value width as the backend's ones column makes)."""
    batch, length, heads, key_dim, value_dim = 2, 150, 3, 32, 17
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = draw(batch, length, heads, key_dim), draw(batch, length, heads, key_dim)
    if which == "gated_delta":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    inputs = {
        "q": q,
        "k": k,
        "v": draw(batch, length, heads, value_dim),
        "g": F.logsigmoid(draw(batch, length, heads) + 3),
        "initial_state": 0.1 * draw(batch, heads, key_dim, value_dim),
    }
    if which == "gated_delta":
        inputs["beta"] = torch.sigmoid(draw(batch, length, heads))
    fla_kernel = fla_backend.fla_kernels()[0 if which == "simple_gla" else 1]
    stand_in = stand_in_simple_gla if which == "simple_gla" else stand_in_gated_delta_rule
    differentiate = fla_differentiates()  # else forward only: fla refuses its gated backward on this GPU
    results = {}
    for name, kernel, dtype in (("fla", fla_kernel, torch.float32), ("stand_in", stand_in, torch.float64)):
        tensors = {
            key: value.to("cuda", dtype).requires_grad_(differentiate) for key, value in inputs.items()
        }
        out, final = kernel(**tensors, scale=1.0, output_final_state=True)
        gradients = []
        if differentiate:
            weight_generator = torch.Generator().manual_seed(1)
            loss = sum(
                (
                    x.double() * torch.randn(x.shape, generator=weight_generator, dtype=torch.float64).cuda()
                ).sum()
                for x in (out, final)
            )
            gradients = torch.autograd.grad(loss, list(tensors.values()))
        results[name] = (out.detach(), final.detach(), gradients)
    for actual, reference in zip(results["fla"][:2], results["stand_in"][:2], strict=True):
        assert relative_error(actual, reference) < 1e-2
    if differentiate:
        for name, actual, reference in zip(inputs, results["fla"][2], results["stand_in"][2], strict=True):
            assert relative_error(actual, reference) < 2e-2, f"gradient of {name}"


GPU_CASES = {
    # GLA-like log scales over 300 tokens (grow by ~0.7 per token), padding, a continuation
    "linear": lambda dtype: LinearCase("cuda", dtype, length=300, split=130, dims=(32, 16)),
    "hybrid": lambda dtype: HybridCase(
        "cuda", dtype, length=300, split=130, window=64, sinks=4, dims=(32, 32, 16)
    ),
    "gated": lambda dtype: DeltaCase("cuda", dtype, length=300, split=130, dims=(32, 16)),
}


@gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("name", GPU_CASES)
def test_ops_on_fla_kernels_match_the_pytorch_ops_on_gpu(name, dtype, tolerance):
    """Forward and backward of the chunked ops on fla's kernels against the PyTorch ops in float64 on the
    same (rounded) inputs; float32 differs by TF32 products, bfloat16 by its rounding of the results. Forward
    only where fla has no gated backward on this GPU."""
    case, reference_case = GPU_CASES[name](dtype), GPU_CASES[name](dtype)
    reference_case.inputs = {name: x.detach().double().requires_grad_() for name, x in case.inputs.items()}
    kernel = fla_backend.fla_kernels()[1 if name == "gated" else 0]
    differentiate = fla_differentiates()  # else forward only: fla refuses its gated backward on this GPU
    got, got_exact, gradients = values_and_gradients(case, kernel, differentiate)
    expected, expected_exact, expected_gradients = values_and_gradients(reference_case, None, differentiate)
    for actual, reference in zip(got, expected, strict=True):
        assert relative_error(actual, reference) < tolerance
    for actual, reference in zip(got_exact, expected_exact, strict=True):
        if torch.is_tensor(actual):  # the offsets: the same running maxima, in the compute dtype
            torch.testing.assert_close(actual.double(), reference.double(), rtol=1e-5, atol=1e-5)
        else:
            assert actual == reference
    assert len(gradients) == len(expected_gradients) == (len(case.inputs) if differentiate else 0)
    for input_name, actual, reference in zip(
        case.inputs if differentiate else [], gradients, expected_gradients, strict=True
    ):
        floor = 1e-2 * reference.numel() ** 0.5
        assert relative_error(actual, reference, floor=floor) < tolerance, f"gradient of {input_name}"


@gpu
@pytest.mark.parametrize("cell, kind, feature_map, share", CELL_CASES)
def test_cells_dispatch_to_fla_on_gpu(monkeypatch, cell, kind, feature_map, share):
    """On CUDA float32 the cells' prefill runs on fla's kernel (counted), with the outputs and gradients of
    the PyTorch path (``DOFLA_FLA=0``) to TF32 accuracy; decoding continues from the kernel's state. Where fla
    has no gated backward on this GPU, the prefill recording gradients stays on PyTorch (no kernel call, the
    same gradients) and a no-grad prefill runs on the kernel."""
    student = make_cell(cell, kind, feature_map, share, "cuda", torch.float32, feature_dim=32, head_dim=32)
    monkeypatch.setenv("DOFLA_FLA", "0")
    expected, expected_gradients = prefill_then_decode(
        student, length=150, device="cuda", dtype=torch.float32
    )
    monkeypatch.setenv("DOFLA_FLA", "1")
    calls, (simple_gla, gated_delta) = [], fla_backend.fla_kernels()
    monkeypatch.setattr(
        fla_backend, "fla_kernels", lambda: (counting(simple_gla, calls), counting(gated_delta, calls))
    )
    output, gradients = prefill_then_decode(student, length=150, device="cuda", dtype=torch.float32)
    assert len(calls) == (1 if fla_differentiates() else 0)
    assert relative_error(output, expected) < 5e-3
    for actual, reference in zip(gradients, expected_gradients, strict=True):
        assert relative_error(actual, reference, floor=1e-3) < 1e-2
    calls.clear()
    with torch.no_grad():
        output, _ = prefill_then_decode(
            student, length=150, device="cuda", dtype=torch.float32, gradients=False
        )
    assert len(calls) == 1
    assert relative_error(output, expected) < 5e-3


@gpu
@pytest.mark.parametrize("cell", ["gla", "gated_delta"])
def test_a_converted_model_on_gpu_gives_the_pytorch_logits_and_generates(monkeypatch, cell):
    """A whole converted tiny model on CUDA: logits with fla's kernels (default) against ``DOFLA_FLA=0``, and a
    greedy generation (prefill on the kernels, decoding on PyTorch from their states) that runs."""
    feature_map = "projection" if cell == "gated_delta" else "hedgehog"
    model = build_tiny_model("llama", seed=0)
    convert(
        model,
        plan_for(model, kind="hybrid", cell=cell, feature_map=feature_map, feature_dim=16, window=8, sinks=2),
    )
    model = model.cuda().float().eval()
    tokens = torch.randint(0, 64, (2, 100), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        monkeypatch.setenv("DOFLA_FLA", "0")
        expected = model(tokens).logits
        monkeypatch.setenv("DOFLA_FLA", "1")
        assert relative_error(model(tokens).logits, expected) < 5e-3
        generated = model.generate(tokens[:1, :80], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 85)
