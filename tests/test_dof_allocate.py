"""Allocation under a budget: exact sums, minimum, clip, fix, keep_softmax, headwise and plans (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dofla import dof
from dofla.errors import DoflaError
from dofla.settings import PlanSettings

measures = st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=2, max_size=40)


@settings(max_examples=60, deadline=None)
@given(measures, st.integers(min_value=1, max_value=128), st.integers(min_value=1, max_value=4))
def test_allocation_sum_is_exact_and_minimum_held(values, budget, minimum):
    if minimum > budget:
        with pytest.raises(DoflaError):
            dof.allocate_feature_dims(values, budget=budget, minimum=minimum)
        return
    allocation = dof.allocate_feature_dims(values, budget=budget, minimum=minimum)
    assert sum(allocation.layer_dims) == budget * len(values)
    assert min(allocation.layer_dims) >= minimum
    fix = dof.allocate_feature_dims(values, budget=budget, variant="fix")
    assert fix.layer_dims == [budget] * len(values)


@settings(max_examples=60, deadline=None)
@given(measures, st.integers(min_value=1, max_value=64))
def test_clip_holds_and_redistributes(values, budget):
    allocation = dof.allocate_feature_dims(values, budget=budget, variant="dof_clip", head_size=64)
    assert max(allocation.layer_dims) <= 64
    assert sum(allocation.layer_dims) == budget * len(values)


def test_clip_budget_beyond_head_size_is_refused_and_keep_softmax_takes_the_top():
    with pytest.raises(DoflaError, match="at most 64"):
        dof.allocate_feature_dims([1.0, 2.0], budget=65, variant="dof_clip", head_size=64)
    with pytest.raises(DoflaError, match="positive"):
        dof.allocate_feature_dims([1.0, 2.0], budget=0)
    allocation = dof.allocate_feature_dims([5.0, 1.0, 9.0, 2.0], budget=10, keep_softmax=2)
    assert allocation.softmax_layers == [0, 2]
    assert allocation.layer_dims[0] == allocation.layer_dims[2] == 0
    assert sum(allocation.layer_dims) == 20
    proportional = dof.allocate_feature_dims([1.0, 3.0], budget=8)
    assert proportional.layer_dims == [4, 12]


def test_headwise_dims_and_plan_on_a_tiny_model():
    from dofla.models import build_tiny_model

    model = build_tiny_model("llama")
    batches = [torch.randint(3, 128, (2, 16)) for _ in range(2)]
    estimate = dof.estimate(model, batches, num_points=32, lambdas=[2**-4, 2**-6])
    assert len(estimate.heads) == 2 * 4 and all(0 < h.dof_over_j <= 1 for h in estimate.heads)
    assert all(not h.spectrum for h in estimate.heads)  # kernel spectra only on request (dofla dof's plot)
    with_spectra = dof.estimate(model, batches, num_points=32, kernel_spectra=True)
    assert all(len(h.spectrum) == min(32, dof.SPECTRUM_VALUES) for h in with_spectra.heads)
    plan = dof.make_plan(model, estimate, plan=PlanSettings(budget=8, allocation="headwise"))
    assert [len(layer.head_feature_dims) for layer in plan.layers] == [2, 2]  # one per key/value head
    assert all(layer.feature_dim == max(layer.head_feature_dims) for layer in plan.layers)
    with pytest.raises(DoflaError, match="J = 1000 points"):
        dof.estimate(model, batches, num_points=1000)
    with pytest.raises(DoflaError, match="no calibration data"):
        dof.estimate(model, [], num_points=8)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.floats(0.0, 1e3), min_size=3, max_size=3), min_size=2, max_size=12),
    st.integers(1, 64),
    st.integers(0, 1),
)
def test_headwise_sum_exact_and_keep_softmax_takes_the_highest(head_values, budget, keep):
    layer_values = [max(row) for row in head_values]
    allocation = dof.allocate_feature_dims(
        layer_values, budget=budget, variant="headwise", head_measure=head_values, keep_softmax=keep
    )
    converted = [i for i in range(len(head_values)) if i not in allocation.softmax_layers]
    assert len(allocation.softmax_layers) == keep
    if keep:
        assert layer_values[allocation.softmax_layers[0]] == max(layer_values)
    assert sum(sum(allocation.head_dims[i]) for i in converted) == budget * 3 * len(converted)
    assert all(min(allocation.head_dims[i]) >= 1 for i in converted)
    assert all(allocation.layer_dims[i] == max(allocation.head_dims[i]) for i in converted)


def test_clip_redistributes_the_excess_in_proportion():
    # Layer 0 would get 3·48·10/12 = 120 > 64: it is clipped to 64 and the 56 features over are shared by the
    # unclipped layers in proportion to their measure (12 + 28 each).
    allocation = dof.allocate_feature_dims([10.0, 1.0, 1.0], budget=48, variant="dof_clip", head_size=64)
    assert allocation.layer_dims == [64, 40, 40]
    unclipped = dof.allocate_feature_dims([10.0, 1.0, 1.0], budget=48, variant="dof")
    assert unclipped.layer_dims == [120, 12, 12]


def test_measure_points_subsets_and_attention_rank_on_a_tiny_model():
    from dofla.models import build_tiny_model

    model = build_tiny_model("llama")
    batches = [torch.randint(3, 128, (2, 16))]
    captured = dof.capture_points(model, batches, num_points=48, seed=1, spectra_sequences=2)
    assert captured.points[0][0].shape == (48, model.config.head_dim)
    subset = dof.measure_points(captured, num_points=24, lambdas=[2**-4])
    assert subset.num_points == 24 and all(head.measure["2^-4"] <= 24 for head in subset.heads)
    ranks = dof.measure_points(captured, measure="attention_rank", lambdas=[2**-4, 2**-8])
    for (
        head
    ) in ranks.heads:  # a causal row-stochastic 16 x 16 matrix: 1 <= rank measure <= 16, grows as λ falls
        assert 1.0 - 1e-9 <= head.measure["2^-4"] <= head.measure["2^-8"] <= 16
    with pytest.raises(DoflaError, match="more than the 48 captured"):
        dof.measure_points(captured, num_points=49)
    with pytest.raises(DoflaError, match="unknown measure"):
        dof.measure_points(captured, measure="entropy")
