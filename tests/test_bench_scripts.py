"""Smoke tests of the bench scripts (bench/): each runs on a tiny model or small shapes and prints or writes
what it promises. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dofla import attention
from dofla.attention import LinearAttention
from dofla.cells import build_student
from dofla.config import LayerPlan


@pytest.fixture
def one_thread():
    """A tiny model's operators are too small to share between threads (and waiting threads of a busy
    machine slow each one down): the script smoke tests run on one, restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str):
    """bench/NAME.py as a module (the folder is scripts, not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_bench_speed_runs_every_cell_on_a_tiny_model_and_skips_what_does_not_fit(
    tmp_path, capsys, monkeypatch
):
    bench = bench_script("bench_speed")
    arguments = ["--tiny", "--contexts", "32,64", "--batches", "1,2", "--steps", "1", "--window", "8"]
    arguments += ["--isolate", "none", "--prefill-chunks", "0,16,32"]
    arguments += [
        "--cells",
        ",".join(bench.STUDENTS),
        "--out",
        str(tmp_path),
        "--plot",
        str(tmp_path / "s.png"),
    ]
    assert bench.main(arguments) == 0
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    models = ["teacher", *bench.STUDENTS]
    assert {row["model"] for row in rows} == set(models)
    # prefill one forward and in pieces of 16 at 2 contexts, in pieces of 32 only at 64 (at 32 it is one
    # piece: the one-forward row), decode at 2 batches x 2 contexts
    assert len(rows) == len(models) * (2 * 2 + 1 + 2 * 2)
    assert all(row["tokens_per_second"] > 0 and row["cache_bytes"] > 0 for row in rows)
    teacher = {
        (r["phase"], r["batch"], r["context"]): r["cache_bytes"] for r in rows if r["model"] == "teacher"
    }
    linear = {
        (r["phase"], r["batch"], r["context"]): r["cache_bytes"] for r in rows if r["model"] == "linear"
    }
    assert linear[("decode", 2, 32)] == linear[("decode", 2, 64)]  # the state does not grow with the context
    mixed = {
        (r["phase"], r["batch"], r["context"]): r["cache_bytes"]
        for r in rows
        if r["model"] == "gated_delta+window (3 softmax)"
    }
    assert mixed[("decode", 2, 64)] > mixed[("decode", 2, 32)]  # its softmax layer's cache grows
    # a prefill in pieces leaves the same cache as one forward
    assert linear[("prefill/16", 1, 64)] == linear[("prefill", 1, 64)]
    assert teacher[("prefill/16", 1, 64)] == teacher[("prefill", 1, 64)]
    assert teacher[("decode", 2, 64)] > teacher[("decode", 2, 32)]
    assert (tmp_path / "s.png").stat().st_size > 0
    for model in models:
        assert f"| {model} |" in printed
    assert "32/96 ÷ fix" in printed
    assert "Prefill in pieces of 16 tokens" in printed and "each model's faster way" in printed

    # A setting that does not fit: one line for that row, the run goes on and still prints its tables.
    monkeypatch.setattr(bench, "available_memory_bytes", lambda: 1)
    assert (
        bench.main(
            ["--tiny", "--contexts", "32", "--batches", "1", "--steps", "1", "--cells", "linear"]
            + ["--isolate", "none", "--out", str(tmp_path), "--plot", str(tmp_path / "t.png")]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "skipped teacher prefill batch 1 context 32: needs about" in captured.err
    assert "does not fit" in captured.out
    assert "linear decode batch 1 context 32" in captured.err  # a student's row still ran


def test_bench_speed_no_attention_bound_is_the_teacher_attending_to_nothing_in_prefill_rows_only(tmp_path):
    bench = bench_script("bench_speed")
    arguments = ["--tiny", "--contexts", "32,64", "--batches", "1", "--steps", "1", "--isolate", "none"]
    arguments += ["--prefill-chunks", "0,16", "--cells", f"linear,{bench.NO_ATTENTION}"]
    assert bench.main([*arguments, "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    bound = sorted((r["phase"], r["context"]) for r in rows if r["model"] == bench.NO_ATTENTION)
    assert bound == [("prefill", 32), ("prefill", 64), ("prefill/16", 32), ("prefill/16", 64)]
    assert all(r["tokens_per_second"] > 0 for r in rows if r["model"] == bench.NO_ATTENTION)

    # attending to nothing: a position's logits do not depend on the tokens before it; restored afterwards
    model = bench.build_model(argparse.Namespace(tiny=True, contexts=[32], teacher=None))
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, :6] = (changed[0, :6] + 1) % model.config.vocab_size

    def last_logits(ids):
        with torch.no_grad():
            return model(input_ids=ids).logits[0, -1]

    before = last_logits(tokens)
    assert not torch.allclose(before, last_logits(changed))  # the teacher reads its context
    previous = model.config._attn_implementation
    bench.prepared_model(model, bench.NO_ATTENTION, None, lambda message: None)
    assert torch.equal(last_logits(tokens), last_logits(changed))
    model.set_attn_implementation(previous)
    assert torch.allclose(last_logits(tokens), before)


def test_bench_speed_decode_bound_attends_to_nothing_and_keeps_nothing_in_decode_rows_only(tmp_path):
    bench = bench_script("bench_speed")
    arguments = ["--tiny", "--contexts", "32,64", "--batches", "1,2", "--steps", "2", "--isolate", "none"]
    arguments += ["--prefill-chunks", "0", "--cells", bench.NO_ATTENTION_DECODE]
    assert bench.main([*arguments, "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 0
    rows = [r for r in json.loads((tmp_path / "speed.json").read_text())["rows"] if r["model"] != "teacher"]
    assert sorted((r["phase"], r["batch"], r["context"]) for r in rows) == [
        ("decode", batch, context) for batch in (1, 2) for context in (32, 64)
    ]
    assert all(r["tokens_per_second"] > 0 and r["cache_bytes"] == 0 for r in rows)

    # its cache counts the tokens (positions go on) and keeps no keys; a step's logits are the no-attention
    # model's on the same tokens
    model = bench.build_model(argparse.Namespace(tiny=True, contexts=[32], teacher=None))
    previous = model.config._attn_implementation
    bench.prepared_model(model, bench.NO_ATTENTION_DECODE, None, lambda message: None)
    cache = bench.counting_cache(model, 20)
    tokens = torch.randint(0, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stepped = [
            model(input_ids=tokens[:, i : i + 1], past_key_values=cache).logits[:, -1] for i in range(3)
        ]
        whole = model(input_ids=tokens).logits
    assert cache.get_seq_length() == 23 and all(layer.keys is None for layer in cache.layers)
    torch.testing.assert_close(torch.stack(stepped, 1), whole)
    model.set_attn_implementation(previous)


def test_bench_speed_in_place_teacher_decodes_as_the_teacher_in_decode_rows_only(tmp_path):
    from transformers import DynamicCache

    from dofla.cache import GrowingKVLayer

    bench = bench_script("bench_speed")
    arguments = ["--tiny", "--contexts", "32", "--batches", "1,2", "--steps", "1", "--isolate", "none"]
    arguments += ["--cells", bench.TEACHER_IN_PLACE]
    assert bench.main([*arguments, "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    in_place = sorted((r["phase"], r["batch"]) for r in rows if r["model"] == bench.TEACHER_IN_PLACE)
    assert in_place == [("decode", 1), ("decode", 2)]

    # the same teacher on the same keys: the same logits, step after step, its keys written in place
    model = bench.build_model(argparse.Namespace(tiny=True, contexts=[32], teacher=None))
    caches = [
        bench.synthetic_kv_cache(model, 2, 20),
        bench.in_place_kv(bench.synthetic_kv_cache(model, 2, 20)),
    ]
    assert all(isinstance(layer, GrowingKVLayer) for layer in caches[1].layers)
    assert isinstance(caches[0], DynamicCache) and not isinstance(caches[0].layers[0], GrowingKVLayer)
    token = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(3):
            logits = [model(input_ids=token, past_key_values=cache).logits for cache in caches]
            torch.testing.assert_close(logits[1], logits[0])
            token = logits[0][:, -1:].argmax(-1)
    assert caches[1].layers[0].buffers[0].shape[2] > caches[1].get_seq_length() == 23


def test_bench_speed_measures_every_row_in_its_own_process(tmp_path, capsys):
    bench = bench_script("bench_speed")
    arguments = ["--tiny", "--contexts", "32", "--batches", "2", "--steps", "1", "--window", "8"]
    arguments += [
        "--prefill-chunks",
        "0",
        "--cells",
        "linear",
        "--out",
        str(tmp_path),
        "--plot",
        str(tmp_path / "s.png"),
    ]
    assert bench.main(arguments) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert [(r["model"], r["phase"], r["batch"]) for r in rows] == [
        ("teacher", "prefill", 1),
        ("teacher", "decode", 2),
        ("linear", "prefill", 1),
        ("linear", "decode", 2),
    ]
    processes = {row["process"] for row in rows}
    assert len(processes) == 4 and os.getpid() not in processes
    assert all(row["tokens_per_second"] > 0 for row in rows)
    assert "every row in its own process" in capsys.readouterr().out


def test_bench_speed_goes_on_when_a_row_process_fails_or_is_killed(tmp_path, capsys, monkeypatch):
    bench = bench_script("bench_speed")
    real_run = subprocess.run
    statuses = iter([0, 1, -9, 0])  # teacher prefill, teacher decode, linear prefill, linear decode

    def fake_run(command, **options):
        if bench.ROW_FLAG not in command:  # e.g. platform.processor() asking uname
            return real_run(command, **options)
        row = json.loads(command[command.index(bench.ROW_FLAG) + 1])
        row.update(tokens_per_second=1.0, cache_bytes=1)
        return subprocess.CompletedProcess(command, next(statuses), stdout=json.dumps(row) + "\n")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    arguments = ["--tiny", "--contexts", "32", "--batches", "2", "--prefill-chunks", "0", "--cells", "linear"]
    assert bench.main([*arguments, "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 1
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert [row.get("error") for row in rows] == [None, "failed", "memory", None]
    captured = capsys.readouterr()
    assert "skipped teacher decode batch 2 context 32: its process stopped (exit status 1)" in captured.err
    assert "skipped linear prefill batch 1 context 32: its process stopped (killed)" in captured.err
    assert "| linear | does not fit | - |" in captured.out and "| teacher | failed | - |" in captured.out


def test_bench_window_op_times_both_paths_and_they_agree(capsys, one_thread):
    bench = bench_script("bench_window_op")
    arguments = ["--length", "40", "--fill", "24", "--window", "8", "--sinks", "2", "--heads", "4"]
    assert (
        bench.main([*arguments, "--kv-heads", "2", "--head-dim", "8", "--chunk-size", "8", "--repeats", "1"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "| general (blocked) |" in printed and "| fused |" in printed
    difference = float(printed.split("largest output difference ")[1].split()[0])
    assert difference < 1e-5


def test_profile_decode_prints_top_operators_per_model(capsys, one_thread):
    profile = bench_script("profile_decode")
    arguments = [
        "--tiny",
        "--cells",
        "linear",
        "--batches",
        "2",
        "--steps",
        "1",
        "--fill",
        "16",
        "--prefill",
        "32",
    ]
    assert profile.main(arguments) == 0
    printed = capsys.readouterr().out
    for title in ("teacher: decode step, batch 2", "linear: decode step, batch 2", "linear: prefill of 32"):
        assert title in printed
    assert "aten calls per step and layer" in printed and "Self CPU" in printed


def test_chunk_size_comes_from_the_measured_table_unless_the_plan_sets_one(
    tmp_path, capsys, one_thread, monkeypatch
):
    from dofla.ops.chunk_sizes import CHUNK_SIZES, choose_chunk_size

    for op, rows in CHUNK_SIZES.items():
        lengths = [length for length, _ in rows]
        assert lengths == sorted(lengths), f"{op}: rows must grow in length"
        for length, size in rows:
            assert choose_chunk_size(op, length) == size
        assert choose_chunk_size(op, lengths[-1] * 4) == rows[-1][1]  # beyond the table: its last size
    shape = dict(layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    default = LinearAttention(LayerPlan(kind="linear", feature_dim=6), **shape)
    assert default.chunk_size is None
    assert default.chunk_size_for("linear", 20000) == choose_chunk_size("linear", 20000)
    fixed = LinearAttention(LayerPlan(kind="linear", feature_dim=6, options={"chunk_size": 8}), **shape)
    assert fixed.chunk_size_for("linear", 20000) == 8
    # the gated delta cell's window op asks for the row of its kind: with sink slots or without
    asked = []
    monkeypatch.setattr(attention, "choose_chunk_size", lambda op, length: asked.append(op) or 16)
    for sinks in (2, 0):
        plan = LayerPlan(kind="hybrid", cell="gated_delta", feature_map="projection", feature_dim=8, window=4)
        cell = build_student(dataclasses.replace(plan, sinks=sinks), **shape)
        with torch.no_grad():
            cell(*(torch.randn(1, heads, 20, 8) for heads in (4, 2, 2)))
    assert [op for op in asked if op.startswith("window")] == ["window+sinks", "window"]

    sweep = bench_script("sweep_chunk_size")
    out = tmp_path / "chunk_sizes.json"
    arguments = ["--lengths", "40", "--chunks", "8,16", "--repeats", "1", "--window", "4", "--sinks", "2"]
    arguments += ["--out", str(out)]
    assert sweep.main([*arguments, "--heads", "4", "--kv-heads", "2", "--dim", "8"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"linear 40", "delta 40", "window 40"}
    assert all(row["chosen"] in (8, 16) for row in rows.values())
    assert '"linear": ((40, ' in capsys.readouterr().out


def test_layer_step_bench_prints_every_cell_alone_and_against_a_checkout(capsys, one_thread, monkeypatch):
    """bench/bench_layer_step.py on a tiny layer: a row per cell, alone and against a source folder (the
    subprocess of each side run in this process here: importing torch twice would take seconds)."""
    bench = bench_script("bench_layer_step")
    tiny = ["--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--feature-dim", "8", "--window", "4"]
    tiny += ["--fill", "6", "--steps", "3", "--rounds", "1", "--cells", "gla+window,gated_delta+window"]
    assert bench.main(tiny) == 0
    printed = capsys.readouterr().out
    assert "| gla+window |" in printed and "| gated_delta+window |" in printed
    sides = []

    def run_in(source, args, argv):
        sides.append(source)
        assert "--against" not in argv and "--json" not in argv
        return bench.run_here(args)

    monkeypatch.setattr(bench, "run_in", run_in)
    assert bench.main([*tiny, "--against", "/elsewhere/src", "--runs", "1"]) == 0
    assert sides == ["/elsewhere/src", str(bench.SOURCE)]
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if line.startswith("| g")]
    assert len(rows) == 2 and all(line.count("|") == 10 for line in rows)  # wall and CPU clock
    assert sum(line.startswith("- gla+window, ") for line in printed) == 2  # each side's runs
    assert any(line.startswith("load average") for line in printed)
    prefill = [*tiny[:-1], "gated_delta conv8", "--prefill", "10"]
    assert bench.main(prefill) == 0
    printed = capsys.readouterr().out
    assert "prefill of 10 tokens" in printed and "| gated_delta conv8 |" in printed


def test_layer_step_bench_allocation_times_both_dimensions_and_their_mean(capsys, one_thread, monkeypatch):
    """--allocation A,B: each cell at A, B and (A + B) / 2 features, the ratio of the A/B mean to the mean's."""
    bench = bench_script("bench_layer_step")
    tiny = ["--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--window", "4", "--fill", "6"]
    tiny += ["--steps", "2", "--rounds", "2", "--cells", "gated_delta+window"]
    seen = []
    real_measure = bench.measure

    def measure(name, args):
        seen.append(args.feature_dim)
        return dict(real_measure(name, args), us=float(args.feature_dim))  # time = dimension: ratio 1

    monkeypatch.setattr(bench, "measure", measure)
    assert bench.main([*tiny, "--allocation", "4,12"]) == 0
    assert seen == [4, 8, 12, 4, 8, 12]  # interleaved rounds
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gated_delta")]
    assert row == ["| gated_delta+window | 4.0 | 12.0 | 8.0 | 8.0 | 1.000x |"]
    with pytest.raises(SystemExit):
        bench.main([*tiny, "--allocation", "4,9"])  # no whole mean dimension
    assert "even sum" in capsys.readouterr().err


def test_bench_speed_repeats_take_each_rows_median_sample_and_print_the_spread(tmp_path, capsys, monkeypatch):
    bench = bench_script("bench_speed")
    real_run = subprocess.run
    speeds = iter([10.0, 4.0, 30.0, 2.0, 20.0, 5.0, 60.0, 8.0, 40.0, 3.0, 50.0, 6.0])  # 3 rounds x 4 rows

    def fake_run(command, **options):
        if bench.ROW_FLAG not in command:  # e.g. platform.processor() asking uname
            return real_run(command, **options)
        row = json.loads(command[command.index(bench.ROW_FLAG) + 1])
        row.update(tokens_per_second=next(speeds), cache_bytes=1)
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(row) + "\n")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    arguments = ["--tiny", "--contexts", "32", "--batches", "2", "--prefill-chunks", "0", "--cells", "linear"]
    arguments += ["--repeats", "3", "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]
    assert bench.main(arguments) == 0
    record = json.loads((tmp_path / "speed.json").read_text())
    assert len(record["samples"]) == 12
    medians = {
        (row["model"], row["phase"]): (row["tokens_per_second"], row["samples"]) for row in record["rows"]
    }
    assert medians == {
        ("teacher", "prefill"): (20.0, [10.0, 20.0, 40.0]),
        ("teacher", "decode"): (4.0, [3.0, 4.0, 5.0]),
        ("linear", "prefill"): (50.0, [30.0, 50.0, 60.0]),
        ("linear", "decode"): (6.0, [2.0, 6.0, 8.0]),
    }
    printed = capsys.readouterr().out
    assert "| linear | decode | 2 | 32 | 3 | 2.0 / 6.0 / 8.0 | 0.50x - 2.00x |" in printed
    assert "3 rounds, each row its median sample" in printed
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_bench_generation_measures_the_contexts_that_fit_and_says_which_did_not(monkeypatch, capsys):
    """A context whose generation runs out of memory is one line on stderr and a None row; the others are
    measured (bench/bench_generation.py), and --recipe gives the recipe's plan."""
    generation = bench_script("bench_generation")

    def measure(model, *, context_lengths, batch_size, new_tokens, graph):
        if context_lengths[0] > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return [{"context": context_lengths[0], "batch_size": batch_size, "graph": graph}]

    monkeypatch.setattr(generation, "measure_generation", measure)
    args = argparse.Namespace(batch_size=2, new_tokens=3)
    rows = generation.measure_rows(None, [64, 4096, 96], args, "teacher")
    assert rows == [
        {"context": 64, "batch_size": 2, "graph": False},
        None,
        {"context": 96, "batch_size": 2, "graph": False},
    ]
    assert "teacher at 4096 tokens, batch 2: out of memory" in capsys.readouterr().err
    assert generation.measure_rows(None, [64], args, "student", graph=True)[0]["graph"] is True

    def static(model, context, batch_size, new_tokens):
        if context > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return {"context": context, "static": True}

    monkeypatch.setattr(generation, "static_teacher_row", static)
    rows = generation.measure_rows(None, [64, 4096], args, "teacher (static cache)", static=True)
    assert rows == [{"context": 64, "static": True}, None]
    assert "teacher (static cache) at 4096 tokens, batch 2: out of memory" in capsys.readouterr().err
    args = argparse.Namespace(
        recipe="gated-delta-linear",
        feature_map="learnable_prf",
        feature_dim=32,
        window=None,
        cell_options=None,
    )
    options = generation.recipe_plan_options(args)
    assert (
        options["kind"] == "linear" and options["cell"] == "gated_delta" and options["options"]["short_conv"]
    )
    assert (args.feature_map, args.feature_dim) == ("projection", 64)
    from dofla.models import build_tiny_model

    args = argparse.Namespace(
        recipe="gated-delta-retrieval",
        feature_map="learnable_prf",
        feature_dim=32,
        softmax_layers="1",
        window=None,
        cell_options=None,
    )
    plan, kept = generation.student_plan(
        build_tiny_model("llama"), args, generation.recipe_plan_options(args)
    )
    assert kept == [1] and [layer.kind for layer in plan.layers] == ["hybrid", "softmax"]
    assert (plan.layers[0].cell, plan.layers[0].window, plan.layers[0].sinks) == ("gated_delta", 128, 4)
    from dofla.recipes import plan_for_arguments

    assert plan_for_arguments("gated-delta-retrieval")["keep_softmax"] == 4
    assert "keep_softmax" not in plan_for_arguments("gated-delta")


def test_bench_generation_changes_a_recipes_window_and_cell_options_and_refuses_them_alone():
    generation = bench_script("bench_generation")

    def arguments(recipe, window=None, options=None):
        return argparse.Namespace(
            recipe=recipe, feature_map="learnable_prf", feature_dim=32, window=window, cell_options=options
        )

    options = generation.recipe_plan_options(
        arguments("gated-delta-recall", 48, "heavy_hitters=8,recall_cache=4,mix=adaptive")
    )
    assert options["window"] == 48
    assert options["options"] == {
        "window_factor": 0.999,
        "recall_cache": 4,
        "heavy_hitters": 8,
        "mix": "adaptive",
    }
    assert (
        generation.recipe_plan_options(arguments("gated-delta-linear", None, "output_gate=false"))["options"][
            "output_gate"
        ]
        is False
    )
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        generation.recipe_plan_options(arguments("gated-delta-recall", None, "heavy_hitters"))
    with pytest.raises(SystemExit, match="give --recipe too"):
        generation.recipe_plan_options(arguments(None, 48))


def test_bench_generation_times_the_static_cache_teachers_decoding_steps_without_its_prefill(monkeypatch):
    """--teacher-static: two generations with a static cache (the first compiles on CUDA); the rate counts
    the times between the second's decoding steps only."""
    from dofla.models import build_tiny_model

    generation = bench_script("bench_generation")
    clocks = []
    original = generation._StepClock

    def clock(device):
        clocks.append(original(device))
        return clocks[-1]

    monkeypatch.setattr(generation, "_StepClock", clock)
    model = build_tiny_model("llama", vocab_size=64, num_hidden_layers=2, seed=0).eval()
    row = generation.static_teacher_row(model, 40, 2, 5)
    times = clocks[0].times
    assert len(times) == 6  # the prefill's end, then one per decoded token
    assert row["decode_tokens_per_second"] == pytest.approx(2 * 5 / (times[-1] - times[0]))
    assert row["context"] == 40 and row["compiled"] is False


def test_profile_decode_counts_only_with_the_period_and_edge_sinks(capsys, one_thread):
    """--counts-only prints one line per model (no tables, no prefill); the students are converted as the
    speed bench converts them, the period and edge sinks included (a window past its edge, positions past
    the period)."""
    profile = bench_script("profile_decode")
    arguments = ["--tiny", "--cells", "gla+window", "--window", "8", "--batches", "1", "--steps", "1"]
    arguments += ["--fill", "40", "--counts-only", "--position-period", "16", "--sinks-at-edge"]
    assert profile.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "gla+window: decode step, batch 1" in printed and "prefill" not in printed.split("\n", 3)[-1]
    assert "Self CPU" not in printed
    counts = [int(line.split(", ")[-1].split()[0]) for line in printed.splitlines() if "aten calls" in line]
    assert len(counts) == 2 and counts[1] > counts[0]  # the student's step does more small operators


def test_bench_speed_decodes_a_student_through_its_compiled_whole_step_in_decode_rows_only(
    tmp_path, monkeypatch, capsys
):
    import dofla.graph_decode as graph_decode

    decoders = []
    real = graph_decode.CapturedDecoder

    def spy(*args, **kwargs):
        decoders.append(
            real(*args, **{**kwargs, "compiled": False})
        )  # eagerly (compiling: test_graph_decode)
        assert kwargs["compiled"] is True
        return decoders[-1]

    monkeypatch.setattr(graph_decode, "CapturedDecoder", spy)
    bench = bench_script("bench_speed")
    name = "gated-delta-retrieval recipe" + bench.WHOLE_SUFFIX  # kept softmax layers too
    arguments = ["--tiny", "--contexts", "256", "--batches", "1,2", "--steps", "2", "--isolate", "none"]
    arguments += ["--cells", name, "--position-period", "64", "--sinks-at-edge", "--prefill-chunks", "0"]
    assert bench.main([*arguments, "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert sorted((r["model"], r["phase"], r["batch"]) for r in rows if r["model"] == name) == [
        (name, "decode", 1),
        (name, "decode", 2),
    ]
    assert len(decoders) == 2 and all(decoder.steps == 3 + 2 for decoder in decoders)  # warm-up + timed
    assert all(r["tokens_per_second"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--cells", "linear (compiled)"])
    assert "unknown student 'linear (compiled)'" in capsys.readouterr().err


def test_bench_speed_compiled_teacher_times_decode_rows_from_a_static_cache(tmp_path, monkeypatch):
    """The compiled teacher's row: decode rows only, timed over the steps asked for, its step the teacher's
    forward over a StaticCache (here uncompiled: compiling takes seconds)."""
    bench = bench_script("bench_speed")
    monkeypatch.setattr(bench.torch, "compile", lambda function, **options: function)
    arguments = ["--tiny", "--contexts", "32", "--batches", "1", "--steps", "2", "--isolate", "none"]
    arguments += ["--cells", bench.TEACHER_COMPILED, "--decode-only"]
    assert bench.main([*arguments, "--out", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert sorted((r["model"], r["phase"]) for r in rows) == [
        ("teacher", "decode"),
        (bench.TEACHER_COMPILED, "decode"),
    ]
    compiled_row = next(r for r in rows if r["model"] == bench.TEACHER_COMPILED)
    assert compiled_row["tokens_per_second"] > 0 and compiled_row["steps"] == 2


def test_the_llama_cpp_setup_marks_one_version_need_weak_and_the_library_still_loads(tmp_path):
    """bench/llama_cpp/weak_glibc_2_38.py on a copy of one of Python's own extension libraries: the need of
    the version named is marked weak, nothing else changes, and the library still loads."""
    import ctypes
    import shutil
    import sysconfig

    sys.path.insert(0, str(BENCH / "llama_cpp"))
    try:
        import weak_glibc_2_38 as weak
    finally:
        sys.path.remove(str(BENCH / "llama_cpp"))
    folder = Path(sysconfig.get_config_var("DESTSHARED") or Path(ctypes._ctypes.__file__).parent)
    libraries = [path for path in sorted(folder.glob("*.so")) if dict(weak.version_needs(str(path)))]
    if not libraries:
        pytest.skip(f"no extension library in {folder} needs a symbol version")
    original = libraries[0]
    copy = tmp_path / original.name
    shutil.copy(original, copy)
    before = weak.version_needs(str(copy))
    name = before[0][0]
    assert weak.mark_weak(str(copy), name) == sum(1 for item, _ in before if item == name) >= 1
    after = weak.version_needs(str(copy))
    assert after == [(item, flags | (weak.VER_FLG_WEAK if item == name else 0)) for item, flags in before]
    changed = [
        i for i, (a, b) in enumerate(zip(original.read_bytes(), copy.read_bytes(), strict=True)) if a != b
    ]
    assert len(changed) <= len(before)  # only flag bytes
    assert weak.version_needs(str(original)) == before  # the original is untouched
    ctypes.CDLL(str(copy))


def test_bench_llama_cpp_refuses_a_runtime_folder_without_the_bindings(tmp_path):
    script = bench_script("bench_llama_cpp")
    arguments = [
        "--student",
        str(tmp_path),
        "--converter",
        str(tmp_path / "convert.py"),
        "--work",
        str(tmp_path),
    ]
    with pytest.raises(SystemExit, match="--runtime is needed"):
        script.main(arguments)
    with pytest.raises(SystemExit, match="holds no llama_cpp_py_sync package"):
        script.main(arguments + ["--runtime", str(tmp_path)])
