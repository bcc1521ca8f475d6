"""Data-parallel distillation with torch.distributed (gloo, 2 CPU processes) equals the single-process run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

TESTS = Path(__file__).parent


def _worker(rank: int, world_size: int, init_file: str, out_file: str) -> None:
    sys.path.insert(0, str(TESTS))
    import torch.distributed as dist
    from test_distill import quick_config, tiny_converted, token_data

    from dofla.convert import students
    from dofla.distill.trainer import distill

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = tiny_converted()
        distill(model, token_data(), token_data(8, seed=1), quick_config())
        weights = {
            f"{i}.{n}": p.detach().contiguous()
            for i, s in students(model).items()
            for n, p in s.named_parameters()
        }
        save_file(weights, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_process_data_parallel_equals_single_process(tmp_path):
    from test_distill import quick_config, tiny_converted, token_data

    from dofla.convert import students
    from dofla.distill.trainer import distill

    out_file = str(tmp_path / "weights.safetensors")
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), out_file), nprocs=2, join=True, start_method="spawn"
    )
    rank0, rank1 = load_file(f"{out_file}.0"), load_file(f"{out_file}.1")
    model = tiny_converted()
    distill(model, token_data(), token_data(8, seed=1), quick_config())
    single = {f"{i}.{n}": p.detach() for i, s in students(model).items() for n, p in s.named_parameters()}
    assert rank0.keys() == single.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0)  # all ranks take the same steps
        torch.testing.assert_close(rank0[name], tensor, rtol=1e-4, atol=1e-5)
    # and training moved the students (the comparison is not between two untouched initialisations)
    assert any(
        not torch.equal(tensor, tiny_converted().state_dict()[key])
        for key, tensor in model.state_dict().items()
        if "dofla_student" in key
    )


def test_layer_sharded_training_equals_all_layers_at_once():
    """Each 'rank' trains its own layers; merged, they equal training all layers at once (layers are
    independent under teacher forcing; clipping off, since a global norm would couple them)."""
    from test_distill import quick_config, tiny_converted, token_data

    from dofla.convert import students
    from dofla.distill.trainer import distill
    from dofla.errors import DoflaError

    config = quick_config(grad_clip=1e9)
    together = tiny_converted()
    distill(together, token_data(), token_data(8, seed=1), config)
    shards = {}
    for owned in ([0], [1]):
        model = tiny_converted()
        distill(model, token_data(), token_data(8, seed=1), config, layers=owned)
        shards[owned[0]] = students(model)[owned[0]]
        other = 1 - owned[0]  # the layer this shard does not own stays at its initial values
        torch.testing.assert_close(
            students(model)[other].state_dict(),
            students(tiny_converted())[other].state_dict(),
            rtol=0,
            atol=0,
        )
    for index, student in students(together).items():
        torch.testing.assert_close(shards[index].state_dict(), student.state_dict(), rtol=1e-6, atol=1e-7)
    with pytest.raises(DoflaError, match=r"layers \[5\] are not converted layers"):
        distill(tiny_converted(), token_data(), token_data(8, seed=1), config, layers=[5])


def test_linearize_on_two_processes_from_the_command_line_equals_one_process(tmp_path, capsys):
    """`dofla linearize --nproc 2` runs torchrun (gloo): the saved students equal a one-process run's."""
    import subprocess

    from safetensors.torch import load_file

    from dofla.cli import main
    from dofla.models.tiny import save_tiny_model_folder

    teacher = save_tiny_model_folder("llama", tmp_path / "teacher")
    text = tmp_path / "text.txt"
    text.write_text(
        "\n".join(f"Line {i} of the text tells of rivers, hills and {i % 7} towns." for i in range(80))
    )
    run = ["linearize", str(teacher), "--data", str(text), "--allocation", "fix", "--budget", "4"]
    run += ["--seq-len", "32", "--tokens", "1024", "--batch-size", "4", "--eval-every", "2", "--no-progress"]
    run += ["--eval-lengths", "32", "--passkey-trials", "0"]

    assert main([*run, "--out", str(tmp_path / "ddp"), "--nproc", "3"]) == 1  # checked before any work
    assert "--batch-size 4 is not divisible by --nproc 3" in capsys.readouterr().err

    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dofla", *run, "--out", str(tmp_path / "ddp"), "--nproc", "2"]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.count("held-out perplexity") == 1  # rank 0 alone reports
    assert main([*run, "--out", str(tmp_path / "single")]) == 0

    ddp = load_file(tmp_path / "ddp" / "model" / "model.safetensors")
    single = load_file(tmp_path / "single" / "model" / "model.safetensors")
    students = [name for name in single if "dofla_student" in name]
    assert students and ddp.keys() == single.keys()
    for name in students:
        torch.testing.assert_close(ddp[name], single[name], rtol=1e-4, atol=1e-5)
    for run_name, processes in (("ddp", 2), ("single", 1)):
        summary = json.loads((tmp_path / run_name / "result.json").read_text())
        assert summary["distill_processes"] == processes and summary["distill_steps"] == 1024 // (4 * 32)
