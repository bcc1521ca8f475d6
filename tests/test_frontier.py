"""dofla frontier on a tiny model: every grid cell runs through the public pipeline once, finished cells are
skipped on a second call, and the summary, table and plot are written."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from dofla.errors import DoflaError
from dofla.frontier import FrontierConfig, GridCell, grid, run_frontier, targets
from dofla.models import save_tiny_model_folder


def tiny_grid(tmp_path, **changes) -> FrontierConfig:
    folder = save_tiny_model_folder("llama", tmp_path / "tiny-llama")
    text = tmp_path / "text.txt"
    text.write_text(
        "\n".join(f"Line {i}: the river bends past hill {i % 7} and mill {i % 5}." for i in range(200))
    )
    settings = dict(
        data=dict(path=str(text), seq_len=32, heldout_sequences=2),
        plan=dict(dof_batches=2),
        distill=dict(tokens=64, batch_size=2, loss="output_mse", eval_every=0, checkpoint_every=0),
        evaluate=dict(error_sequences=1),
    )
    config = FrontierConfig(
        out_dir=str(tmp_path / "grid"),
        model=str(folder),
        allocations=["fix", "measured"],
        budgets=[4],
        softmax_counts=[0, 1],
        softmax_choices=["uniform", "measured"],
        settings=settings,
        eval_length=64,
        decode_tokens=2,
    )
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def test_frontier_runs_every_cell_once_and_writes_the_summary(tmp_path, monkeypatch):
    from dofla import frontier

    config = tiny_grid(tmp_path, softmax_choices=["uniform", "measured"], allocations=["measured"])
    summary = run_frontier(config, progress=False)
    names = [cell.name for cell in grid(config)]
    assert names == ["measured-b4-k0", "measured-b4-k1-uniform", "measured-b4-k1-measured"]
    assert sorted(row["name"] for row in summary["rows"]) == sorted(names) and not summary["missing"]
    rows = {row["name"]: row for row in summary["rows"]}
    assert rows["measured-b4-k1-uniform"]["softmax_layers"] == [
        1
    ]  # position (0 + 1/2) * 2 / 1 of layers 0, 1
    assert rows["measured-b4-k1-uniform"]["feature_dims"] == [4, 0]  # the budget is per converted layer
    assert sum(rows["measured-b4-k0"]["feature_dims"]) == 8
    assert all(row["state_bytes"] > 0 and row["decode_tokens_per_second"] > 0 for row in rows.values())
    grid_dir = tmp_path / "grid"
    assert len(list((grid_dir / "curves").glob("error_curves-*.json"))) == 1  # measured once, reused by cells
    plan = json.loads((grid_dir / "cells" / "measured-b4-k0" / "plan.json").read_text())
    assert (
        plan["metadata"]["error_curves_key"] in next((grid_dir / "curves").glob("error_curves-*.json")).name
    )
    assert [target["kind"] for target in summary["targets"]] == ["softmax layers"]
    assert "| measured-b4-k0 |" in (grid_dir / "frontier.md").read_text()
    # the reference lines come from the fully converted cell; the K = 1 cells have their own baselines
    assert rows["measured-b4-k0"]["window_layers"] is None
    assert rows["measured-b4-k1-uniform"]["window_layers"] == [0]
    assert frontier.reference_row(summary["rows"])["name"] == "measured-b4-k0"
    assert "(every layer restricted)" in (grid_dir / "frontier.md").read_text()
    assert (grid_dir / "frontier.png").stat().st_size > 0 and (grid_dir / "curves.png").stat().st_size > 0

    def refuse(*args, **kwargs):
        raise AssertionError("a finished cell was run again")

    monkeypatch.setattr("dofla.pipeline.linearize", refuse)
    assert frontier.run_frontier(config, progress=False)["rows"] == summary["rows"]


def test_targets_compare_measured_with_fix_and_with_uniform_softmax_layers():
    def row(allocation, count=0, choice=None, perplexity=20.0):
        cell = GridCell(allocation, 32, count, choice)
        return dict(name=cell.name, **asdict(cell), perplexity=perplexity, teacher_perplexity=10.0)

    rows = [
        row("fix", perplexity=30.0),
        row("measured", perplexity=20.0),
        row("measured", 3, "uniform", perplexity=18.0),
        row("measured", 3, "measured", perplexity=15.0),
    ]
    allocation, softmax = targets(rows)
    assert allocation["against"] == "fix-b32-k0" and allocation["removed"] == pytest.approx(0.5)
    assert softmax["removed"] == pytest.approx(0.5) and softmax["uniform_removed"] == pytest.approx(0.2)
    assert softmax["ratio"] == pytest.approx(2.5)


def test_frontier_refuses_k_that_leaves_nothing_to_convert(tmp_path):
    config = tiny_grid(tmp_path, softmax_counts=[2])
    with pytest.raises(DoflaError, match="K = 2 softmax layers leaves nothing to convert in a 2-layer"):
        run_frontier(config, progress=False)


def test_the_reference_row_restricts_every_layer():
    from dofla.frontier import _own_baseline, reference_row

    kept = dict(name="k3", window_layers=[0, 2], window_perplexity={"window": 50.0, "window+sinks4": 12.5})
    full = dict(name="k0", window_layers=None, window_perplexity={"window": 40.0, "window+sinks4": 13.0})
    assert reference_row([kept, full])["name"] == "k0" and reference_row([kept])["name"] == "k3"
    assert _own_baseline(kept) == "12.500" and _own_baseline(full) == ""
    kept["window_perplexity"]["window+sinks10"] = 11.0  # the most sinks, not the last name in order
    assert _own_baseline(kept) == "11.000"


def test_frontier_keeps_the_layers_the_greedy_recall_order_names(tmp_path, monkeypatch):
    calls = []

    def fake_order(model, batches, count, *, window, sinks=0, layers=None, seed=0):
        calls.append((count, window, sinks))
        return [(0, 2.0), (1, 1.0)][:count]

    monkeypatch.setattr("dofla.planning.recall_order.recall_layer_order", fake_order)
    config = tiny_grid(
        tmp_path, softmax_choices=["recall"], allocations=["fix"], softmax_counts=[1], decode_tokens=0
    )
    rows = run_frontier(config, progress=False)["rows"]
    assert [row["softmax_layers"] for row in rows] == [[0]]  # the uniform choice would keep layer 1
    assert len(calls) == 1 and calls[0][0] == 1  # measured once for the grid, up to its largest K
