"""The registries: an unknown name lists the registered ones, a name is taken once, and adding a measure, an
allocation or a loss is one registered function that the library then uses by name (as docs/architecture.md
shows). Also the per-family table that convert and LoRA read."""

from __future__ import annotations

import pytest
import torch
from helpers import small_llama

from dofla import dof
from dofla.convert import convert, plan_for
from dofla.distill.losses import LOSSES, kernel_loss, layer_loss, register_loss
from dofla.distill.teacher_forcing import freeze_teacher, teacher_forced_step
from dofla.errors import DoflaError
from dofla.models import TINY_FAMILIES, build_tiny_model, get_adapter
from dofla.models.adapters import CACHE_ARGUMENTS, FAMILIES
from dofla.registry import Registry
from dofla.settings import DistillSettings, PlanSettings


@pytest.fixture
def cleanup():
    """Registers made by a test are removed afterwards: yields a list of (registry, name) to drop."""
    added: list[tuple[Registry, str]] = []
    yield added
    for registry, name in added:
        registry.pop(name, None)


def test_unknown_names_list_the_registered_ones_and_names_are_taken_once():
    registry = Registry("colour")
    registry.add("red", 1)
    registry.add("red", 1)  # the same thing again is harmless (a module imported twice)
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        registry.add("red", 2)
    with pytest.raises(DoflaError, match="unknown colour 'blue'; choose one of: red."):
        registry["blue"]
    assert registry.get("blue") is None  # plain dict lookups keep their meaning
    with pytest.raises(
        DoflaError,
        match="unknown loss 'kl'; choose one of: direct, l2, output_mse, projected_mse, softmax, split_mse",
    ):
        DistillSettings(loss="kl").validate()
    with pytest.raises(
        DoflaError, match="unknown allocation 'even'; choose one of: dof, dof_clip, fix, headwise"
    ):
        dof.allocate_feature_dims([1.0, 2.0], budget=4, variant="even")
    with pytest.raises(DoflaError, match="unknown measure 'entropy'; choose one of: attention_rank, dof"):
        dof.estimate(small_llama(), [torch.zeros(1, 4, dtype=torch.long)], measure="entropy")


def test_a_new_measure_is_one_registered_function(cleanup):
    @dof.register_measure("spread")
    def spread(sample: dof.HeadSample, lambdas) -> torch.Tensor:
        """The points' total variance, the same at every λ."""
        value = sample.points.double().var(0).sum()
        return value.expand(len(lambdas)).clone()

    cleanup.append((dof.MEASURES, "spread"))
    model = small_llama()
    batches = [torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(0))]
    captured = dof.capture_points(model, batches, num_points=24)
    result = dof.measure_points(captured, measure="spread", lambdas=[2**-4, 2**-6])
    first = result.heads[0]
    expected = float(captured.points[0][0].double().var(0).sum())
    assert first.measure == {"2^-4": pytest.approx(expected), "2^-6": pytest.approx(expected)}
    plan = dof.make_plan(model, result, plan=PlanSettings(budget=4, allocation="dof"))
    assert sum(layer.feature_dim for layer in plan.layers) == 8 and plan.metadata["measure"] == "spread"


def test_a_new_allocation_is_one_registered_function(cleanup):
    @dof.register_allocation("front_loaded", needs_measure=False)
    def front_loaded(request: dof.AllocationRequest):
        """Twice the budget for the first converted layer, the rest shared by the others."""
        count = len(request.layer_measure)
        first = min(2 * request.budget, request.budget * count - (count - 1))
        rest = dof.largest_remainder(
            [1.0] * (count - 1), request.budget * count - first, request.minimum, None
        )
        return [first, *rest], None

    cleanup.append((dof.ALLOCATIONS, "front_loaded"))
    model = build_tiny_model("llama", num_hidden_layers=3)
    plan = dof.make_plan(
        model, plan=PlanSettings(budget=4, allocation="front_loaded")
    )  # needs no measure, so no estimate
    assert [layer.feature_dim for layer in plan.layers] == [8, 2, 2]
    assert plan.metadata == {"allocation": "front_loaded", "budget": 4}
    with pytest.raises(DoflaError, match="allocation 'dof' allocates by a measure"):
        dof.make_plan(model, plan=PlanSettings(budget=4, allocation="dof"))


def test_a_new_loss_is_one_registered_function(cleanup):
    @register_loss("l1", scope="kernel")
    def l1_rows(teacher, student_log, normaliser, allowed):
        """sum_j |P_ij - A_ij| per row."""
        student = torch.where(allowed, torch.exp(student_log - normaliser), torch.zeros_like(teacher))
        return (teacher - student).abs().sum(-1)

    cleanup.append((LOSSES, "l1"))
    model = small_llama()
    convert(model, plan_for(model, feature_dim=4))
    by_layer = freeze_teacher(model)
    batch = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = teacher_forced_step(model, batch, by_layer, "l1", backward=True)
    assert set(losses) == {0, 1} and all(0 < value < 2 for value in losses.values())  # rows differ by < 2
    assert all(p.grad is not None for student in by_layer.values() for p in student.parameters())
    DistillSettings(loss="l1").validate()
    with pytest.raises(DoflaError, match="'direct' trains the whole model end to end"):
        layer_loss("direct", None, None)
    with pytest.raises(DoflaError, match="'direct' is not a kernel loss"):
        kernel_loss("direct", *[torch.zeros(1, 1, 2, 2)] * 4, None, scaling=1.0)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_family_table_names_lora_targets_and_layer_lists_that_exist(family):
    from dofla.distill.lora import attention_projection_names

    model = build_tiny_model(family)
    adapter = get_adapter(model)
    assert attention_projection_names(model) == list(adapter.family.lora_targets)
    layers = adapter.decoder_layer_list(model)
    assert isinstance(layers, torch.nn.ModuleList) and len(layers) == adapter.num_layers
    assert adapter.family.cache_argument in CACHE_ARGUMENTS
    softcaps = {adapter.attention_softcap(module) for module in adapter.attention_modules(model)}
    assert softcaps == {getattr(model.config, "attn_logit_softcapping", None)}
    assert set(CACHE_ARGUMENTS) == {"past_key_values", "layer_past"} and len(FAMILIES) == 8


def test_a_registry_decorator_registers_names_its_target_and_refuses_a_taken_name():
    from dofla.registry import Registry

    shapes = Registry("shape")

    @shapes.decorator("square", attribute="shape_name")
    class Square:
        pass

    assert shapes["square"] is Square and Square.shape_name == "square"
    with pytest.raises(ValueError, match="shape 'square' is already registered"):
        shapes.decorator("square")(type("Other", (), {}))
    with pytest.raises(DoflaError, match="unknown shape 'circle'; choose one of: square."):
        shapes["circle"]
