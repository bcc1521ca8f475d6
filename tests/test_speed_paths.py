"""The speed work's fast paths against their references (forward and gradients), and the speed benchmarks'
scripts on a tiny model (timings are never asserted: only that every row and output appears)."""

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
from ops_helpers import LINEAR_NAMES, assert_chunked_linear_matches_naive, make_inputs, relative_error

import dofla.ops.linear.chunked as chunked_module
from dofla import attention
from dofla.attention import LinearAttention
from dofla.cache import RecurrentCacheLayer
from dofla.cells import build_student
from dofla.config import LayerPlan
from dofla.ops import chunked_linear_attention, linear_attention

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


def weighted_gradients(outputs, weights, inputs):
    """Gradients of sum(output * weight) over the outputs that are not None, with respect to ``inputs``."""
    present = [tensor for tensor in outputs if tensor is not None]
    total = sum((tensor * weight).sum() for tensor, weight in zip(present, weights, strict=True))
    return torch.autograd.grad(total, inputs)


@pytest.fixture
def one_thread():
    """A tiny model's operators are too small to share between threads (and waiting threads of a busy
    machine slow each one down): the script smoke tests run on one, restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("feature_map", ["learnable_prf", "t2r", "hedgehog", "elu1"])
def test_decode_features_in_one_call_equal_separate_query_and_key_calls(share, feature_map):
    plan = LayerPlan(kind="linear", feature_map=feature_map, feature_dim=6, share_kv_heads=share)
    student = LinearAttention(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = student.double()
    with torch.no_grad():  # parameters away from their (identity-like) start
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(0)
    for batch, length in ((1, 1), (2, 1), (2, 3)):  # calls of up to decode_tokens tokens take the joint call
        query = torch.randn(batch, 4, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
        key = torch.randn(batch, 2, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
        joint = student.features(query, key)
        q_separate, _ = student.feature_map(query, is_query=True)
        k_separate, log_scale = student.feature_map(student._state_heads_view(key), is_query=False)
        separate = (q_separate, k_separate, log_scale)
        for got, expected in zip(joint, separate, strict=True):
            if expected is None:
                assert got is None
            else:
                torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        weights = [
            torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in separate if t is not None
        ]

        inputs = (query, key, *student.feature_map.parameters())
        joint_gradients = weighted_gradients(joint, weights, inputs)
        for got, expected in zip(joint_gradients, weighted_gradients(separate, weights, inputs), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("log_scale_std", [0.0, 30.0])
def test_chunked_linear_scan_over_many_chunks_matches_the_reference(log_scale_std):
    """More chunks than SCAN_ABOVE_CHUNKS: the states entering the chunks come from the scan."""
    inputs = make_inputs(2, 6, 2, 45, 5, log_scale_std=log_scale_std)  # 23 chunks of 2 tokens
    assert -(-45 // 2) > chunked_module.SCAN_ABOVE_CHUNKS
    assert_chunked_linear_matches_naive(inputs, 2)


def test_scan_and_mixing_product_give_the_same_continuation_from_a_state(monkeypatch):
    inputs = make_inputs(1, 4, 2, 60, 5, log_scale_std=20.0)
    leaves = {name: inputs[name].detach() for name in LINEAR_NAMES}
    first = {name: tensor[:, :, :17] for name, tensor in leaves.items()}
    rest = {name: tensor[:, :, 17:] for name, tensor in leaves.items()}
    _, state = chunked_linear_attention(**first, chunk_size=4, return_state=True)
    scanned, scanned_state = chunked_linear_attention(
        **rest, chunk_size=2, initial_state=state, return_state=True
    )
    monkeypatch.setattr(chunked_module, "SCAN_ABOVE_CHUNKS", 10**6)
    mixed, mixed_state = chunked_linear_attention(
        **rest, chunk_size=2, initial_state=state, return_state=True
    )
    expected = linear_attention(**leaves)[:, :, 17:]
    assert relative_error(scanned, expected) < 1e-12 and relative_error(mixed, expected) < 1e-12
    torch.testing.assert_close(scanned_state.kv, mixed_state.kv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scanned_state.normalizer, mixed_state.normalizer, rtol=1e-10, atol=1e-12)


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


@pytest.mark.parametrize("name", ["prf", "learnable_prf"])
def test_prf_rows_alone_agree_with_the_batch_and_missing_features_are_zero(name):
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map(
        name, num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5, head_feature_dims=[6, 4]
    ).double()
    x = torch.randn(3, 4, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batched, batched_scale = feature_map(x, is_query=False)
    for row in range(3):
        alone, alone_scale = feature_map(x[row : row + 1], is_query=False)
        torch.testing.assert_close(alone, batched[row : row + 1], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(alone_scale, batched_scale[row : row + 1], rtol=1e-12, atol=1e-12)
    assert torch.all(batched[:, 2:, :, 4:] == 0)  # the second map head has 4 features: the rest exactly 0


@pytest.mark.parametrize("name", ["prf", "learnable_prf"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("is_query", [False, True])
def test_prf_forward_matches_the_reference_formula_and_follows_parameter_updates(name, batch, is_query):
    """The regrouped PRF (one product, the norm only in the log scale) against the formula as written:
    forward and gradients, with head-wise dimensions; without gradients its folded weights are kept, and
    rebuilt once a parameter changes in place (an optimiser step, a load)."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map(
        name, num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5, head_feature_dims=[6, 4]
    ).double()
    with torch.no_grad():
        for parameter in feature_map.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, 3, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    expected = feature_map.reference_forward(x, is_query=is_query)
    got = feature_map(x, is_query=is_query)
    assert (got[1] is None) == (expected[1] is None) == is_query
    for a, b in zip(got, expected, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    weights = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in expected if t is not None]
    inputs = (x, *[p for p in feature_map.parameters() if p.requires_grad])
    for a, b in zip(
        weighted_gradients(got, weights, inputs), weighted_gradients(expected, weights, inputs), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        feature_map(x, is_query=is_query)  # folded weights kept from here
        feature_map.directions().mul_(1.5)
        got = feature_map(x, is_query=is_query)
        expected = feature_map.reference_forward(x, is_query=is_query)
        for a, b in zip(got, expected, strict=True):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_values_kept_for_decoding_follow_an_in_place_change_of_their_parameter():
    """Hedgehog's signed weight, a hybrid layer's step window factor and the gated delta cell's stacked
    gates, kept between calls without autograd, are rebuilt once a parameter changes in place (an
    optimiser step, a load), is replaced, or moves to another dtype."""
    from dofla.cells import build_student
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map("hedgehog", num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5)
    shape = dict(layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = LinearAttention(LayerPlan(kind="hybrid", feature_map="hedgehog", feature_dim=6), **shape)
    delta = build_student(
        LayerPlan(kind="linear", cell="gated_delta", feature_map="projection", feature_dim=6), **shape
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 1, 8, generator=generator)
    values = torch.randn(3, 2, 8, generator=generator)  # (B, Hs, Dv)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(feature_map.decode_features(x)[0], feature_map(x, is_query=False)[0])
            torch.testing.assert_close(student.step_window_factor(), student.window_factor().view(2, 2, 1))
            weights = delta.step_weights(values.dtype)
            for index, gate in enumerate((delta.decay, delta.write)):
                torch.testing.assert_close(weights.gates[..., index], gate.weight * 8**-0.5)
                torch.testing.assert_close(weights.gate_bias[:, 0, index], gate.bias)
            feature_map.weight.mul_(1.7)
            student.window_factor_logit.add_(0.5)
            for gate in (delta.decay, delta.write):
                gate.weight.add_(torch.randn(gate.weight.shape, generator=generator))
                gate.bias.add_(0.3)
        feature_map.weight = torch.nn.Parameter(torch.randn(feature_map.weight.shape, generator=generator))
        torch.testing.assert_close(feature_map.decode_features(x)[0], feature_map(x, is_query=False)[0])
        feature_map.double()  # the same parameter object, another storage
        torch.testing.assert_close(
            feature_map.decode_features(x.double())[0], feature_map(x.double(), is_query=False)[0]
        )


_DECODE_CASES = [  # cell, kind, feature map, share_kv_heads, window, sinks (the prefill has 7 tokens)
    ("linear", "linear", "learnable_prf", True, 64, 0),
    ("linear", "linear", "hedgehog", False, 64, 0),
    ("gla", "linear", "learnable_prf", True, 64, 0),
    ("gla", "linear", "t2r", False, 64, 0),
    ("gated_delta", "linear", "projection", True, 64, 0),
    ("gated_delta", "linear", "learnable_prf", False, 64, 0),
    ("window", "hybrid", "learnable_prf", True, 3, 0),  # the window is full: its oldest key leaves
    ("window", "hybrid", "learnable_prf", False, 10, 0),  # not yet full
    ("linear", "hybrid", "learnable_prf", True, 3, 0),  # full: the oldest key joins the linear state
    ("linear", "hybrid", "hedgehog", False, 10, 0),  # still filling
    ("linear", "hybrid", "hedgehog", True, 3, 8),  # sinks still filling: the new key becomes one
    ("gla", "hybrid", "hedgehog", True, 3, 2),  # the recipe's cell: sinks held, window full
    ("gla", "hybrid", "learnable_prf", False, 10, 4),
    ("gla", "hybrid", "t2r", False, 2, 7),  # the new key is the last sink
    ("window", "hybrid", "learnable_prf", True, 3, 2),
    ("window", "hybrid", "learnable_prf", False, 10, 8),  # the new key becomes a sink
    ("gated_delta", "hybrid", "projection", True, 3, 2),  # the gated_delta recipe's cell: sinks held
    ("gated_delta", "hybrid", "learnable_prf", False, 10, 8),  # window and sinks still filling
]
DECODE_CASES = [  # ..., cell options
    *[(*case, {}) for case in _DECODE_CASES],
    ("gated_delta", "hybrid", "projection", True, 3, 2, {"mix": "adaptive"}),
    ("gated_delta", "hybrid", "learnable_prf", False, 10, 8, {"mix": "adaptive"}),
    ("gated_delta", "linear", "projection", True, 64, 0, {"short_conv": 4}),
    ("gated_delta", "hybrid", "learnable_prf", False, 10, 8, {"short_conv": 3}),
    ("gated_delta", "linear", "projection", True, 64, 0, {"short_conv": 4, "output_gate": True}),
    ("gated_delta", "hybrid", "projection", True, 3, 2, {"output_gate": True}),
]


@pytest.mark.parametrize("cell, kind, feature_map, share, window, sinks, options", DECODE_CASES)
def test_decode_step_equals_the_recurrent_form_forward_state_and_gradients(
    cell, kind, feature_map, share, window, sinks, options
):
    """A single decoded token through the cell's ``_decode_step`` (what generation runs) against the
    recurrent form from the same state: output, new state, and gradients of the inputs and parameters."""
    from dofla.cache import RecurrentCacheLayer
    from dofla.cells import build_student

    plan = LayerPlan(
        kind=kind,
        cell=cell,
        feature_map=feature_map,
        feature_dim=6,
        share_kv_heads=share,
        window=window,
        sinks=sinks,
        options=options,
    )
    torch.manual_seed(0)
    student = build_student(
        plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5
    ).double()
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(2)

    def draw(heads, length, grad=False):
        tensor = torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64)
        return tensor.requires_grad_(grad)

    layer = RecurrentCacheLayer()
    student.pending_cache_layer = layer
    student(draw(4, 7), draw(2, 7), draw(2, 7))  # the prefill that makes the state (its graph kept)
    state = layer.state
    query, key, value = draw(4, 1, True), draw(2, 1, True), draw(2, 1, True)
    assert student._decode_step(query, key, value, state, 8**-0.5) is not None
    results = {}
    for form in (None, "recurrent"):
        layer.state = state
        student.pending_cache_layer = layer
        output = student(query, key, value, form=form)
        weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
        inputs = [query, key, value, *student.trainable_parameters()]
        # allow_unused: a hybrid step's new key only enters the window, so its decay gate is unused
        gradients = torch.autograd.grad(
            (output * weights).sum(), inputs, allow_unused=True, retain_graph=True
        )  # the prefill's graph serves both forms
        results[form] = (output, layer.state, gradients)
    (fast, fast_state, fast_gradients), (slow, slow_state, slow_gradients) = (
        results[None],
        results["recurrent"],
    )
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    fast_state = fast_state.general_layout()  # a hybrid step's ring buffers, in order
    assert type(fast_state) is type(slow_state) and fast_state.num_tokens == slow_state.num_tokens == 8
    for a, b in zip(fast_state._tensors(), slow_state._tensors(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert [a is None for a in fast_gradients] == [b is None for b in slow_gradients]
    assert all(a is not None for a in fast_gradients[:3])  # query, key, value
    for a, b in zip(fast_gradients, slow_gradients, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adaptive_mix_decoding_without_gradients_equals_the_recurrent_form(dtype):
    """Generation (no autograd): the ring step's softmax and log-sum-exp come from one fused kernel call;
    token by token, against the recurrent form from the same state."""
    from dofla.cache import RecurrentCacheLayer
    from dofla.cells import build_student

    plan = LayerPlan(
        kind="hybrid",
        cell="gated_delta",
        feature_map="projection",
        feature_dim=6,
        window=3,
        sinks=2,
        options={"mix": "adaptive"},
    )
    torch.manual_seed(0)
    student = build_student(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    student = student.to(dtype)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=dtype))

        def draw(heads, length):
            return torch.randn(2, heads, length, 8, generator=generator, dtype=dtype)

        fast, slow = RecurrentCacheLayer(), RecurrentCacheLayer()
        student.pending_cache_layer = fast
        student(draw(4, 7), draw(2, 7), draw(2, 7))
        slow.state = fast.state._map(torch.clone)  # steps update their state in place
        tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        for _ in range(4):
            query, key, value = draw(4, 1), draw(2, 1), draw(2, 1)
            student.pending_cache_layer = fast
            got = student(query, key, value)
            student.pending_cache_layer = slow
            expected = student(query, key, value, form="recurrent")
            torch.testing.assert_close(got, expected, **tolerance)
    assert type(fast.state.window).__name__ == "RingWindow"  # the decoding layout ran


@pytest.mark.parametrize("sinks, query_heads", [(0, 4), (2, 4), (2, 2)])
@pytest.mark.parametrize(
    "length, window, chunk, split",
    [(13, 5, 4, 6), (13, 3, 8, 9), (16, 6, 4, 1), (5, 8, 4, 2), (20, 3, 8, 13)],
)
def test_fused_window_attention_matches_the_reference_and_the_general_chunked_path(
    length, window, chunk, split, sinks, query_heads
):
    """A window prefill with no padding or soft-capping takes one fused softmax call per chunk, from no state
    or continuing one, with or without sinks: against the naive form over the whole sequence (forward and
    gradients) and the general blocked path (output, state) call by call."""
    from dofla.ops import chunked_window_attention, window_attention

    generator = torch.Generator().manual_seed(3)
    query, key, value = (
        torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64, requires_grad=True)
        for heads in (query_heads, 2, 2)
    )
    settings = dict(scaling=8**-0.5, window=window, sinks=sinks, chunk_size=chunk, return_state=True)
    pieces = [slice(0, split), slice(split, length)]
    fast, state, general_state = [], None, None
    for piece in pieces:
        q, k, v = query[:, :, piece], key[:, :, piece], value[:, :, piece]
        out, state = chunked_window_attention(q, k, v, initial_state=state, **settings)
        all_present = torch.ones(2, k.shape[2], dtype=torch.bool)  # a key mask takes the general path
        slow, general_state = chunked_window_attention(
            q, k, v, initial_state=general_state, key_mask=all_present, **settings
        )
        torch.testing.assert_close(out, slow, rtol=1e-10, atol=1e-12)
        assert state.num_tokens == general_state.num_tokens
        for a, b in zip(state._tensors(), general_state._tensors(), strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        fast.append(out)
    fast = torch.cat(fast, dim=2)
    expected = window_attention(query, key, value, scaling=8**-0.5, window=window, sinks=sinks)
    torch.testing.assert_close(fast, expected, rtol=1e-10, atol=1e-12)
    weights = torch.randn(expected.shape, generator=generator, dtype=expected.dtype)
    inputs = (query, key, value)
    for a, b in zip(
        weighted_gradients([fast], [weights], inputs),
        weighted_gradients([expected], [weights], inputs),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("sinks", [0, 2])
def test_fused_window_attention_after_padding_keeps_one_mask_per_row(sinks, return_lse):
    """The fused path shares one mask between the (batch, head) rows only where they see alike; after a
    left-padded first call the rows' absent keys and sink positions differ, and each row keeps its own."""
    from dofla.ops import chunked_window_attention
    from dofla.ops.window.chunked import _rows_alike

    generator = torch.Generator().manual_seed(5)
    query, key, value = (
        torch.randn(2, heads, 14, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2)
    )
    settings = dict(scaling=8**-0.5, window=4, sinks=sinks, chunk_size=4, return_state=True)
    key_mask = torch.ones(2, 3, dtype=torch.bool)
    key_mask[1, :2] = False  # the second row starts two tokens later
    first = [tensor[:, :, :3] for tensor in (query, key, value)]
    _, state = chunked_window_attention(*first, key_mask=key_mask, **settings)
    assert not (_rows_alike(state.key_present) and _rows_alike(state.sink_count[..., None]))
    rest = [tensor[:, :, 3:] for tensor in (query, key, value)]
    fast = chunked_window_attention(*rest, initial_state=state, return_lse=return_lse, **settings)
    all_present = torch.ones(2, 11, dtype=torch.bool)  # a key mask takes the general path
    slow = chunked_window_attention(
        *rest, initial_state=state, key_mask=all_present, return_lse=return_lse, **settings
    )
    for a, b in zip(fast[:-1], slow[:-1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sinks, query_heads", [(0, 4), (2, 4), (2, 2)])
@pytest.mark.parametrize("length, window, chunk, split", [(13, 5, 4, 6), (16, 6, 4, 1), (20, 3, 8, 13)])
def test_fused_window_log_sum_exp_without_gradients_matches_the_blocked_path(
    length, window, chunk, split, sinks, query_heads, dtype
):
    """``return_lse`` without gradients to track takes the fused kernel's entry point that returns the
    log-sum-exp; with them, the blocked path (the fused kernel gives no gradient for it)."""
    from dofla.ops import chunked_window_attention
    from dofla.ops.window.chunked import takes_fused_lse

    generator = torch.Generator().manual_seed(4)
    query, key, value = (
        torch.randn(2, heads, length, 8, generator=generator, dtype=dtype) for heads in (query_heads, 2, 2)
    )
    settings = dict(scaling=8**-0.5, window=window, sinks=sinks, chunk_size=chunk, return_state=True)
    fast_state = slow_state = None
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for piece in (slice(0, split), slice(split, length)):
        q, k, v = query[:, :, piece], key[:, :, piece], value[:, :, piece]
        assert takes_fused_lse(q, k, v)
        out, lse, fast_state = chunked_window_attention(
            q, k, v, initial_state=fast_state, return_lse=True, **settings
        )
        all_present = torch.ones(2, k.shape[2], dtype=torch.bool)  # a key mask takes the blocked path
        slow, slow_lse, slow_state = chunked_window_attention(
            q, k, v, initial_state=slow_state, key_mask=all_present, return_lse=True, **settings
        )
        torch.testing.assert_close(out, slow, **tolerance)
        torch.testing.assert_close(lse, slow_lse, **tolerance)
        for a, b in zip(fast_state._tensors(), slow_state._tensors(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not takes_fused_lse(query.requires_grad_(), key, value)
    with torch.no_grad():
        assert takes_fused_lse(query, key, value)


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


def test_prf_key_with_an_overflowing_norm_is_not_silently_dropped():
    """A key whose squared norm overflows float32 makes the attention non-finite with the regrouped map,
    as with the formula as written (not a key of weight 0: a diverged run must show as NaN)."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map("learnable_prf", num_heads=1, head_dim=8, feature_dim=6, scaling=8**-0.5)
    query, key, value = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 3)
    key[0, 0, 1] = 1e20  # finite, but its squared norm is not
    for features in (feature_map, feature_map.reference_forward):
        q_features, _ = features(query, is_query=True)
        k_features, k_log_scale = features(key, is_query=False)
        out = chunked_linear_attention(q_features, k_features, value, k_log_scale=k_log_scale, chunk_size=2)
        assert torch.isnan(out[:, :, 1:]).all()  # every query that sees the key


def test_greedy_generate_of_the_recipe_cell_takes_the_hybrid_step_and_equals_full_forwards(monkeypatch):
    """The default recipe's cell (gla hybrid with sinks): generate() decodes through ``hybrid_decode_step``
    in every layer, and its greedy tokens equal the argmax of full forwards over the growing sequence
    (window 4 and 2 sinks: the window fills and slides during the 9 new tokens)."""
    import dofla.attention as attention_module
    from dofla.convert import convert, plan_for
    from dofla.models import build_tiny_model
    from dofla.models.tiny import TINY_VOCAB

    steps = []

    def counted(*args, **kwargs):
        steps.append(1)
        return hybrid_step(*args, **kwargs)

    hybrid_step = attention_module.hybrid_decode_step
    monkeypatch.setattr(attention_module, "hybrid_decode_step", counted)
    model = build_tiny_model("llama", seed=0)
    convert(
        model,
        plan_for(model, kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=8, window=4, sinks=2),
    )
    prompt = torch.randint(1, TINY_VOCAB, (1, 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=9,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected = prompt
        for _ in range(9):
            next_token = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected)
    assert len(steps) == 8 * model.config.num_hidden_layers  # every decoded token after the first


@pytest.mark.parametrize("prefill, window, sinks", [(2, 3, 2), (0, 4, 2), (1, 3, 3), (5, 3, 0)])
def test_ring_decode_steps_in_place_equal_the_recurrent_and_naive_forms(prefill, window, sinks):
    """Many steps of the ring-buffer decode ops (``dofla.ops.window.step``) without autograd, the buffers
    updated in place and the ring wrapping around several times, sinks filling during the steps or before:
    outputs against the recurrent form over all tokens and the naive form, the final state (put back in
    order) against the recurrent form's; the hybrid with key log scales, the window alone."""
    from dofla.ops import hybrid_attention, recurrent_window_attention, window_attention
    from dofla.ops.hybrid.recurrent import empty_hybrid_state, recurrent_hybrid_attention
    from dofla.ops.hybrid.step import hybrid_decode_step
    from dofla.ops.state import WindowState
    from dofla.ops.window.step import ring_window, ring_window_step

    length, group = 13, 2
    inputs = {
        name: None if tensor is None else tensor.detach()
        for name, tensor in make_inputs(2, 4, 2, length, 5, log_scale_std=1.0, seed=4).items()
    }
    query, key, v, log_scale = inputs["query"], inputs["key"], inputs["v"], inputs["k_log_scale"]
    q_features, k_features, gamma = inputs["q_features"], inputs["k_features"], inputs["window_factor"]
    settings = dict(scaling=0.5, window=window, sinks=sinks)
    hybrid = dict(q_features=q_features, k_features=k_features, v=v, k_log_scale=log_scale)
    expected, expected_state = recurrent_hybrid_attention(
        query, key, window_factor=gamma, **hybrid, **settings
    )
    naive = hybrid_attention(query, key, window_factor=gamma, **hybrid, **settings)
    expected_window, expected_window_state = recurrent_window_attention(query, key, v, **settings)
    naive_window = window_attention(query, key, v, **settings)
    torch.testing.assert_close(expected, naive, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(expected_window, naive_window, rtol=1e-10, atol=1e-12)

    def split(tensor, t):  # (B, H, T, X) -> token t grouped by key/value head (B, Hk, G, X)
        return tensor[:, :, t].view(2, 2, group, -1)

    with torch.no_grad():
        if prefill:
            _, state = recurrent_hybrid_attention(
                query[:, :, :prefill],
                key[:, :, :prefill],
                window_factor=gamma,
                **{name: tensor[:, :, :prefill] for name, tensor in hybrid.items()},
                **settings,
            )
            _, ring = recurrent_window_attention(
                query[:, :, :prefill], key[:, :, :prefill], v[:, :, :prefill], **settings
            )
        else:
            state = empty_hybrid_state(
                2, 2, 4, 5, 3, window, sinks=sinks, dtype=torch.float64, state_dtype=torch.float64
            )
            ring = WindowState.empty(2, 2, 4, 3, window, sinks, dtype=torch.float64)
        ring = ring_window(ring, prefill)  # the hybrid step converts its state itself
        outputs, window_outputs = [], []
        for t in range(prefill, length):
            output, state = hybrid_decode_step(
                state,
                split(query, t),
                split(q_features, t),
                key[:, :, t],
                k_features[:, :, t],
                v[:, :, t],
                log_scale[:, :, t],
                gamma.view(2, group, 1),
                scaling=0.5,
            )
            outputs.append(output.reshape(2, 4, -1))
            window_output, ring = ring_window_step(
                ring, split(query, t), key[:, :, t], v[:, :, t], scaling=0.5
            )
            window_outputs.append(window_output.reshape(2, 4, -1))
    torch.testing.assert_close(torch.stack(outputs, 2), expected[:, :, prefill:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        torch.stack(window_outputs, 2), expected_window[:, :, prefill:], rtol=1e-10, atol=1e-12
    )
    for got, want in ((state, expected_state), (ring, expected_window_state)):
        got = got.general_layout()
        assert type(got) is type(want) and got.num_tokens == want.num_tokens == length
        for a, b in zip(got._tensors(), want._tensors(), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ring_state_made_in_inference_mode_decodes_on_outside_it():
    """Ring buffers made under ``torch.inference_mode`` cannot be written outside it: the step copies them."""
    from dofla.cells import build_student

    plan = LayerPlan(kind="hybrid", cell="gla", feature_map="hedgehog", feature_dim=6, window=3, sinks=2)
    student = build_student(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)
    query, key, value = (torch.randn(1, heads, 6, 8) for heads in (4, 2, 2))
    layer, outputs = RecurrentCacheLayer(), []
    for start, mode in ((0, torch.inference_mode), (4, torch.inference_mode), (5, torch.no_grad)):
        stop = 4 if start == 0 else start + 1  # a prefill, then one step in each mode
        with mode():
            student.pending_cache_layer = layer
            outputs.append(student(query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]))
    with torch.no_grad():
        expected = student(query, key, value)
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-6)


def test_ring_layout_round_trip_keeps_padded_keys_sinks_and_a_partial_window():
    """A general hybrid state (left-padded rows, sinks, window not yet full in one call and wrapped in the
    other) put in the decoding layout and back is the same state, exactly."""
    from dofla.ops import chunked_hybrid_attention
    from dofla.ops.hybrid.step import ring_hybrid_state

    for length in (5, 11):  # window 7: partial, then wrapped
        inputs = make_inputs(2, 4, 2, length, 5, log_scale_std=1.0, seed=5)
        key_mask = torch.ones(2, length, dtype=torch.bool)
        key_mask[1, :3] = False  # left padding: absent keys, sinks counted from the first real token
        with torch.no_grad():
            _, state = chunked_hybrid_attention(
                inputs["query"],
                inputs["key"],
                inputs["q_features"],
                inputs["k_features"],
                inputs["v"],
                k_log_scale=inputs["k_log_scale"],
                window_factor=inputs["window_factor"],
                scaling=0.5,
                window=7,
                sinks=2,
                key_mask=key_mask,
                chunk_size=4,
                return_state=True,
            )
        back = ring_hybrid_state(state).general_layout()
        assert (
            back.num_tokens == state.num_tokens == length
            and back.linear.num_tokens == state.linear.num_tokens
        )
        for a, b in zip(back._tensors(), state._tensors(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


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
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| g")]
    assert len(rows) == 2 and all(line.count("|") == 7 for line in rows)
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
    args = argparse.Namespace(recipe="gated-delta-linear", feature_map="learnable_prf", feature_dim=32)
    options = generation.recipe_plan_options(args)
    assert (
        options["kind"] == "linear" and options["cell"] == "gated_delta" and options["options"]["short_conv"]
    )
    assert (args.feature_map, args.feature_dim) == ("projection", 64)
    from dofla.models import build_tiny_model

    args = argparse.Namespace(
        recipe="gated-delta-retrieval", feature_map="learnable_prf", feature_dim=32, softmax_layers="1"
    )
    plan, kept = generation.student_plan(
        build_tiny_model("llama"), args, generation.recipe_plan_options(args)
    )
    assert kept == [1] and [layer.kind for layer in plan.layers] == ["hybrid", "softmax"]
    assert (plan.layers[0].cell, plan.layers[0].window, plan.layers[0].sinks) == ("gated_delta", 128, 4)
    from dofla.recipes import plan_for_arguments

    assert plan_for_arguments("gated-delta-retrieval")["keep_softmax"] == 4
    assert "keep_softmax" not in plan_for_arguments("gated-delta")


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
