"""Conversion plans: validation, JSON round trip, refusal of a plan for another model; atomic writes."""

import errno
import json

import pytest

from dofla.config import ConversionPlan, LayerPlan
from dofla.errors import DoflaError
from dofla.io import write_atomic, write_text_atomic


def _plan(**layer_options) -> ConversionPlan:
    layers = [LayerPlan(kind="softmax"), LayerPlan(**{"kind": "linear", **layer_options})]
    return ConversionPlan(
        model_type="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, layers=layers
    )


def test_round_trip_through_json(tmp_path):
    plan = _plan(feature_dim=12, head_feature_dims=[12, 5])
    plan.save(tmp_path / "plan.json")
    again = ConversionPlan.load(tmp_path / "plan.json")
    assert again == plan
    assert again.converted_layers == [1]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"feature_dim": 0}, "feature dimension must be positive"),
        ({"kind": "quadratic"}, "unknown kind"),
        ({"feature_dim": 8, "head_feature_dims": [8, 4, 2]}, "2 key/value heads"),
        ({"feature_dim": 8, "head_feature_dims": [4, 4]}, "largest head dimension"),
        ({"kind": "hybrid", "window": 0}, "window must be positive"),
    ],
)
def test_bad_layer_plans_are_refused(options, message):
    with pytest.raises(DoflaError, match=message):
        _plan(**options).validate()


def test_plan_for_another_model_is_refused():
    with pytest.raises(DoflaError, match="key/value heads is 2 in the plan but 3"):
        _plan().check_matches("llama", 2, 4, 3, 8)


def test_layer_count_mismatch_and_garbage_files(tmp_path):
    plan = _plan()
    plan.num_layers = 3
    with pytest.raises(DoflaError, match="lists 2 layers"):
        plan.validate()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DoflaError, match="not valid JSON"):
        ConversionPlan.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"layers": []}))
    with pytest.raises(DoflaError, match="not a dofla plan"):
        ConversionPlan.load(tmp_path / "other.json")
    with pytest.raises(DoflaError, match="does not exist"):
        ConversionPlan.load(tmp_path / "missing.json")


def test_failed_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "state.txt"
    write_text_atomic(target, "good")

    def full_disk(path):
        path.write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DoflaError, match="No space left on device"):
        write_atomic(target, full_disk)
    assert target.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["state.txt"]


def test_atomic_files_get_ordinary_permissions(tmp_path):
    import os

    mask = os.umask(0)
    os.umask(mask)
    path = write_text_atomic(tmp_path / "plan.json", "{}")
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
