"""The measured allocation: error curves (interpolation, short fits, cache), greedy allocation, softmax choices."""

import pytest
import torch
from helpers import small_llama

from dofla import dof, planning
from dofla.errors import DoflaError
from dofla.settings import PlanSettings


def curves_of(rows: dict[int, list[float]], dims=(4, 8, 16)) -> dof.ErrorCurves:
    layers = sorted(rows)
    return dof.ErrorCurves(
        dims=list(dims),
        layers=layers,
        errors=[rows[layer] for layer in layers],
        layer_loss=[rows[layer] for layer in layers],
        criterion="relative",
    )


def test_error_is_a_least_squares_line_in_log_d_that_never_rises():
    curves = curves_of({0: [6.0, 4.0, 2.0], 1: [1.0, 3.0, 0.5], 2: [1.0, 2.0, 3.0]})
    assert [curves.error(0, d) for d in (2, 4, 8, 16, 32)] == pytest.approx([8.0, 6.0, 4.0, 2.0, 2.0])
    assert curves.error(1, 8) == pytest.approx(1.5)  # noisy points: the line through their mean
    assert curves.error(1, 4) - curves.error(1, 16) == pytest.approx(0.5)  # slope 0.25 per doubling... twice
    assert curves.error(2, 4) == curves.error(2, 16) == pytest.approx(2.0)  # rising points: no gain, flat
    with pytest.raises(DoflaError, match="layer 5 has no measured error curve"):
        curves.error(5, 8)


def test_greedy_gives_features_where_the_error_drops_most_to_an_exact_total():
    curves = curves_of({0: [8.0, 4.0, 2.0], 1: [1.0, 0.9, 0.8], 2: [3.0, 2.0, 1.0]})
    dims = dof.greedy_dims(curves, [0, 1, 2], 24, 1, None)
    assert sum(dims) == 24 and dims[0] > dims[2] > dims[1] >= 1
    # d ∝ slope (3, 0.1 and 1 per doubling) until layer 0 reaches 16, the largest fitted dimension (no gain beyond)
    assert dims == [16, 1, 7]
    assert dof.greedy_dims(curves, [0, 2], 12, 1, None) == [9, 3]
    assert dof.greedy_dims(curves, [0, 1, 2], 24, 1, 9) == [9, 6, 9]  # layer 0 and 2 capped at 9
    flat = curves_of({0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0]})
    assert dof.greedy_dims(flat, [0, 1], 10, 1, None) == [5, 5]  # no measured gain: spread evenly
    with pytest.raises(DoflaError, match="needs 6, more than the budget 4; raise the budget"):
        dof.greedy_dims(curves, [0, 1, 2], 4, 2, None)
    with pytest.raises(DoflaError, match="cannot be placed in 3 layers of at most 9 each"):
        dof.greedy_dims(curves, [0, 1, 2], 30, 1, 9)


def test_measured_allocation_and_softmax_choices():
    curves = curves_of({0: [8.0, 4.0, 2.0], 1: [1.0, 0.9, 0.8], 2: [3.0, 2.0, 1.0], 3: [9.0, 8.0, 7.0]})
    allocation = dof.allocate_feature_dims([0.0] * 4, budget=8, variant="measured", curves=curves)
    assert sum(allocation.layer_dims) == 32 and allocation.layer_dims[0] > allocation.layer_dims[1]
    assert min(allocation.layer_dims) >= 4  # nothing was measured below the smallest fitted dimension
    assert (
        min(dof.allocate_feature_dims([0.0] * 4, budget=3, variant="measured", curves=curves).layer_dims) >= 1
    )
    kept = dof.allocate_feature_dims([0.0] * 4, budget=8, variant="fix", keep_softmax=1, curves=curves)
    assert kept.softmax_layers == [3] and kept.layer_dims == [8, 8, 8, 0]  # highest error at 8 features
    by_measure = dof.allocate_feature_dims(
        [1.0, 5.0, 2.0, 0.0], budget=8, variant="fix", keep_softmax=1, curves=curves, softmax_choice="dof"
    )
    assert by_measure.softmax_layers == [1]
    layers = list(range(30))
    uniform = dof.SOFTMAX_CHOICES["uniform"](layers, 3, measure=None, curves=None, budget=8)
    assert uniform == [5, 15, 25]
    with pytest.raises(DoflaError, match="allocation 'measured' allocates by measured error curves"):
        dof.allocate_feature_dims([0.0] * 4, budget=8, variant="measured")
    with pytest.raises(DoflaError, match="keep_softmax must be between 0 and 3 for 4 layers, got 4"):
        dof.allocate_feature_dims([0.0] * 4, budget=8, variant="measured", curves=curves, keep_softmax=4)
    with pytest.raises(
        DoflaError, match="budget of 8 features per layer cannot be placed in layers of at most 6"
    ):
        dof.allocate_feature_dims([0.0] * 4, budget=8, variant="measured", curves=curves, maximum=6)
    with pytest.raises(DoflaError, match="layer 4 has no measured error curve"):  # curves of another model
        dof.allocate_feature_dims([0.0] * 5, budget=8, variant="measured", curves=curves)


def test_short_fits_train_and_scaled_kl_matches_kl_at_the_reference_dimension(tmp_path, monkeypatch):
    model = small_llama()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 64, (2, 24), generator=generator) for _ in range(2)]
    common = dict(dims=(2, 4), length=24, heldout_pieces=1, lr=3e-2)
    untrained = planning.measure_error_curves(
        model, batches, planning.CurveSettings(steps=0, criterion="relative", **common)
    )
    trained = planning.measure_error_curves(
        model, batches, planning.CurveSettings(steps=6, criterion="relative", **common)
    )
    assert trained.layers == [0, 1] and len(trained.errors[0]) == 2
    assert sum(map(sum, trained.layer_loss)) < sum(map(sum, untrained.layer_loss))  # the fits learn
    exact = planning.measure_error_curves(
        model, batches, planning.CurveSettings(steps=3, criterion="kl", **common)
    )
    scaled = planning.measure_error_curves(
        model, batches, planning.CurveSettings(steps=3, criterion="kl_scaled", **common)
    )
    for layer in (0, 1):
        assert scaled.error(layer, 4) == pytest.approx(exact.error(layer, 4), rel=1e-4)
        assert exact.row(layer)[1] > 0
    settings = planning.CurveSettings(steps=1, criterion="relative", **common)
    first = planning.cached_error_curves(model, batches, settings, folder=tmp_path)
    assert (tmp_path / "error_curves.json").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("cached curves were measured again")

    with pytest.raises(DoflaError, match="give more calibration rows"):
        planning.measure_error_curves(model, batches[:1], planning.CurveSettings(length=24, heldout_pieces=2))
    monkeypatch.setattr(planning.error_curves, "measure_error_curves", refuse)
    assert planning.cached_error_curves(model, batches, settings, folder=tmp_path).errors == first.errors


def test_measure_and_plan_with_the_measured_allocation_on_a_tiny_model(tmp_path):
    model = small_llama()
    batches = [torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    options = dict(dims=(2, 8), steps=2, length=24, heldout_pieces=1, criterion="relative")
    plan = planning.measure_and_plan(
        model,
        batches,
        plan=PlanSettings(allocation="measured", budget=4),
        curve_options=options,
        curves_folder=tmp_path,
    )
    assert sum(layer.feature_dim for layer in plan.layers) == 8
    assert plan.metadata["allocation"] == "measured" and plan.metadata["error_criterion"] == "relative"
    kept = planning.measure_and_plan(
        model,
        batches,
        plan=PlanSettings(allocation="fix", budget=4, keep_softmax=1, softmax_choice="measured"),
        curve_options=options,
        curves_folder=tmp_path,
    )
    assert [layer.kind for layer in kept.layers].count("softmax") == 1
    assert kept.metadata["softmax_choice"] == "measured"
    assert len(list(tmp_path.glob("error_curves-*.json"))) == 1  # the second plan reused the curves
    curves = dof.ErrorCurves.load(tmp_path / "error_curves.json")
    for layer in (0, 1):  # the per-head errors split the layer's error over its 2 key/value heads
        for position in range(len(curves.dims)):
            parts = curves.head_errors[layer][position]
            assert sum(parts) == pytest.approx(curves.errors[layer][position]) and min(parts) >= 0
        values = [row[1] for row in curves.head_errors[layer]]  # two dims: the line meets both if it falls
        expected = values if values[0] >= values[1] else [sum(values) / 2] * 2
        assert [curves.head_error(layer, 1, dim) for dim in curves.dims] == pytest.approx(expected)
    headwise = dof.make_plan(
        model, plan=PlanSettings(budget=4, allocation="measured_headwise"), curves=curves
    )
    head_dims = [layer.head_feature_dims for layer in headwise.layers]
    assert [len(row) for row in head_dims] == [2, 2] and sum(map(sum, head_dims)) == 4 * 2 * 2
    assert all(layer.feature_dim == max(layer.head_feature_dims) for layer in headwise.layers)
    with pytest.raises(DoflaError, match="no per-head errors"):
        curves_of({0: [1.0, 0.5, 0.2], 1: [1.0, 0.5, 0.2]}).head_error(0, 0, 4)


def test_measured_plan_records_its_predicted_gain_and_warns_when_it_is_small():
    from dofla.dof.allocate import predicted_gain_over_fix

    model = small_llama()  # 2 layers
    steep = curves_of({0: [8.0, 4.0, 2.0], 1: [1.0, 1.0, 1.0]})
    # fix at 8: 4 + 1; measured: layer 0 gets 12 (error 3 - ... by the fitted line), layer 1 the minimum 4
    plan = dof.make_plan(model, plan=PlanSettings(budget=8, allocation="measured"), curves=steep)
    dims = [layer.feature_dim for layer in plan.layers]
    expected = 1 - (steep.error(0, dims[0]) + steep.error(1, dims[1])) / (
        steep.error(0, 8) + steep.error(1, 8)
    )
    assert plan.metadata["predicted_error_reduction_vs_fix"] == pytest.approx(expected)
    assert expected > 0.1
    assert predicted_gain_over_fix(steep, [8, 8], 8) == pytest.approx(0.0)
    assert predicted_gain_over_fix(steep, [8, 0], 8) == pytest.approx(0.0)  # softmax layers are left out
    flat = curves_of({0: [1.0, 0.99, 0.98], 1: [1.0, 0.99, 0.98]})
    with pytest.warns(UserWarning, match="unlikely to beat fix"):
        dof.make_plan(model, plan=PlanSettings(budget=8, allocation="measured"), curves=flat)


def one_softmax_layer_plan(choice: str):
    """A small Llama, two calibration batches and its hybrid plan (window 4 + 1 sink) keeping one softmax
    layer chosen by ``choice``: (model, batches, plan)."""
    model = small_llama()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 64, (2, 40), generator=generator) for _ in range(2)]
    plan = planning.measure_and_plan(
        model,
        batches,
        plan=PlanSettings(
            allocation="fix",
            budget=4,
            kind="hybrid",
            window=4,
            sinks=1,
            keep_softmax=1,
            softmax_choice=choice,
        ),
    )
    return model, batches, plan


def test_window_choice_keeps_the_layers_whose_window_costs_most_and_the_plan_records_the_costs():
    costs = [0.1, 0.5, 0.05, 0.5, 0.2]
    kept = dof.allocate_feature_dims(
        [0.0] * 5, budget=8, variant="fix", keep_softmax=2, softmax_choice="window", window_cost=costs
    )
    assert kept.softmax_layers == [1, 3] and kept.layer_dims == [8, 0, 8, 0, 8]  # ties: the earlier layer
    only = dof.allocate_feature_dims(
        [0.0] * 5,
        budget=8,
        variant="fix",
        keep_softmax=1,
        softmax_choice="window",
        window_cost=costs,
        layers=[0, 2, 4],
    )
    assert only.softmax_layers == [4]  # among the layers given
    with pytest.raises(DoflaError, match="the window softmax-layer choice needs each layer's window cost"):
        dof.allocate_feature_dims([0.0] * 5, budget=8, variant="fix", keep_softmax=1, softmax_choice="window")

    model, batches, plan = one_softmax_layer_plan("window")
    from dofla.planning.window_costs import window_costs

    measured = window_costs(model, batches, window=4, sinks=1)
    assert plan.metadata["window_cost"] == pytest.approx(measured, rel=1e-4, abs=1e-6)
    assert plan.metadata["softmax_choice"] == "window"
    assert plan.metadata["softmax_layers"] == [max(range(2), key=lambda layer: measured[layer])]
    assert [layer.kind for layer in plan.layers].count("softmax") == 1


def test_recall_choice_keeps_the_first_layers_of_the_recall_order_and_the_plan_records_it():
    kept = dof.allocate_feature_dims(
        [0.0] * 5, budget=8, variant="fix", keep_softmax=2, softmax_choice="recall", recall_order=[3, 0, 4]
    )
    assert kept.softmax_layers == [0, 3] and kept.layer_dims == [0, 8, 8, 0, 8]
    among = dof.allocate_feature_dims(
        [0.0] * 5,
        budget=8,
        variant="fix",
        keep_softmax=1,
        softmax_choice="recall",
        recall_order=[3, 0],
        layers=[0, 1, 2],
    )
    assert among.softmax_layers == [0]  # the first of the order among the layers given
    with pytest.raises(DoflaError, match="needs the greedy recall order"):
        dof.allocate_feature_dims([0.0] * 5, budget=8, variant="fix", keep_softmax=1, softmax_choice="recall")
    with pytest.raises(DoflaError, match="fewer than the 2 to keep"):
        dof.allocate_feature_dims(
            [0.0] * 5, budget=8, variant="fix", keep_softmax=2, softmax_choice="recall", recall_order=[1]
        )

    model, batches, plan = one_softmax_layer_plan("recall")
    from dofla.planning.recall_order import recall_layer_order

    order = recall_layer_order(model, batches, 1, window=4, sinks=1)
    assert plan.metadata["recall_order"] == [order[0][0]]
    assert plan.metadata["softmax_layers"] == [order[0][0]] and plan.metadata["softmax_choice"] == "recall"
    assert [layer.kind for layer in plan.layers].count("softmax") == 1


def test_the_recall_choice_keeps_its_order_in_the_curves_folder_for_a_rerun(tmp_path, monkeypatch):
    import dofla.planning.recall_order as recall

    model = small_llama()
    batches = [torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    plan = PlanSettings(
        allocation="fix", budget=4, kind="hybrid", window=4, sinks=1, keep_softmax=1, softmax_choice="recall"
    )
    first = planning.measure_and_plan(model, batches, plan=plan, curves_folder=tmp_path)
    assert len(list(tmp_path.glob("recall_order-*.json"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("the recall order was measured again")

    monkeypatch.setattr(recall, "recall_layer_order", refuse)
    again = planning.measure_and_plan(model, batches, plan=plan, curves_folder=tmp_path)
    assert again.metadata["recall_order"] == first.metadata["recall_order"]
