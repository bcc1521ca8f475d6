"""Distillation sharded by data or by layers with torch.distributed (gloo, 2 CPU processes) equals the
single-process run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

TESTS = Path(__file__).parent
CURRICULUM = [(12, 0.5), (24, 0.5)]  # half the tokens at half test_distill's length (8 rows per step)

CLIP = (
    1e-3  # below every step's gradient norm (about 3e-3): clipping acts on each step of the layer-sharded run
)


class _Interrupted(Exception):
    pass


def _student_weights(model) -> dict[str, torch.Tensor]:
    from dofla.models.surgery import students

    return {
        f"{i}.{n}": p.detach().contiguous()
        for i, s in students(model).items()
        for n, p in s.named_parameters()
    }


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Data-parallel distillation, then layer-sharded distillation interrupted at step 6 and resumed."""
    sys.path.insert(0, str(TESTS))
    import torch.distributed as dist
    from test_distill import quick_config, tiny_converted, token_data

    from dofla.distill import distributed
    from dofla.distill.trainer import distill
    from dofla.errors import DoflaError
    from dofla.models.surgery import students

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = tiny_converted()
        distill(model, token_data(), token_data(8, seed=1), quick_config())
        save_file(_student_weights(model), f"{out_dir}/data.{rank}.safetensors")
        model = tiny_converted()  # a length curriculum: its short stage's batch of 8 is sliced 4 + 4
        distill(model, token_data(), token_data(8, seed=1), quick_config(length_schedule=CURRICULUM))
        save_file(_student_weights(model), f"{out_dir}/curriculum.{rank}.safetensors")

        config = quick_config(grad_clip=CLIP)
        blocks = distributed.layer_blocks(students(tiny_converted()), world_size)
        run_dir = Path(out_dir) / f"rank-{rank}"  # each rank its own log and checkpoints
        options = dict(layers=blocks[rank], data_parallel=False)

        try:  # every rank training every layer is refused on every rank, before any step
            distill(
                tiny_converted(),
                token_data(),
                token_data(8, seed=1),
                config,
                data_parallel=False,
                layers=[0, 1],
            )
            refused = None
        except DoflaError as error:
            refused = str(error)

        def interrupt(step, record):
            if step == 6:  # after the checkpoint of step 4, on every rank alike
                raise _Interrupted

        try:
            distill(
                tiny_converted(),
                token_data(),
                token_data(8, seed=1),
                config,
                run_dir,
                on_step=interrupt,
                **options,
            )
        except _Interrupted:
            pass
        model, steps = tiny_converted(), []
        result = distill(
            model,
            token_data(),
            token_data(8, seed=1),
            config,
            run_dir,
            resume=True,
            on_step=lambda step, record: steps.append(step),
            **options,
        )
        distributed.gather_students(students(model), blocks)
        save_file(_student_weights(model), f"{out_dir}/layers.{rank}.safetensors")
        (Path(out_dir) / f"result.{rank}.json").write_text(
            json.dumps(
                dict(
                    refused=refused,
                    first_step=steps[0],
                    val_layers=sorted(result.val_layer_losses),
                    history=result.history,
                )
            )
        )
    finally:
        dist.destroy_process_group()


def test_two_processes_sharded_by_data_or_by_layers_equal_single_process(tmp_path):
    """Data sharding (slices of each batch, averaged gradients) and layer sharding (a layer per rank, whole
    batches, clipping by the joint gradient norm, each rank resuming from its own checkpoints after an
    interruption) both end with the students of one process training everything."""
    from test_distill import quick_config, tiny_converted, token_data

    from dofla.distill.trainer import distill

    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    runs = (
        ("data", quick_config()),
        ("curriculum", quick_config(length_schedule=CURRICULUM)),
        ("layers", quick_config(grad_clip=CLIP)),
    )
    for sharding, config in runs:
        rank0, rank1 = (load_file(tmp_path / f"{sharding}.{rank}.safetensors") for rank in (0, 1))
        model = tiny_converted()
        result = distill(model, token_data(), token_data(8, seed=1), config)
        single = _student_weights(model)
        assert rank0.keys() == single.keys()
        for name, tensor in single.items():
            torch.testing.assert_close(rank0[name], rank1[name], rtol=0, atol=0)  # all ranks end alike
            torch.testing.assert_close(rank0[name], tensor, rtol=1e-4, atol=1e-5)
        # and training moved the students (the comparison is not between two untouched initialisations)
        assert any(
            not torch.equal(tensor, _student_weights(tiny_converted())[name])
            for name, tensor in single.items()
        )
    assert all(record["grad_norm"] > CLIP for record in result.history if "grad_norm" in record)  # clipped
    for rank in (0, 1):
        sharded = json.loads((tmp_path / f"result.{rank}.json").read_text())
        assert "layers [0, 1] are on several ([[0, 1], [0, 1]])" in sharded["refused"]
        assert sharded["first_step"] == 5  # resumed from the checkpoint of step 4
        assert sharded["val_layers"] == [0, 1]  # every rank reports every layer's held-out loss
        losses = [(r["step"], r["loss"]) for r in sharded["history"] if "loss" in r]
        expected = [(r["step"], r["loss"]) for r in result.history if "loss" in r]
        assert [step for step, _ in losses] == [step for step, _ in expected]
        torch.testing.assert_close(
            [loss for _, loss in losses], [loss for _, loss in expected], rtol=1e-4, atol=0
        )
        assert (tmp_path / f"rank-{rank}" / "log.jsonl").is_file()


def test_layer_sharded_training_equals_all_layers_at_once():
    """Each 'rank' trains its own layers; merged, they equal training all layers at once (layers are
    independent under teacher forcing; clipping off, since a global norm would couple them)."""
    from test_distill import quick_config, tiny_converted, token_data

    from dofla.distill.trainer import distill
    from dofla.errors import DoflaError
    from dofla.models.surgery import students

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


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny teacher folder, its text, the `dofla linearize` arguments of a short run, and that run's saved
    model on one process (the reference of the multi-process runs)."""
    from dofla.cli import main
    from dofla.models.tiny import save_tiny_model_folder

    folder = tmp_path_factory.mktemp("tiny_run")
    teacher = save_tiny_model_folder("llama", folder / "teacher")
    text = folder / "text.txt"
    text.write_text(
        "\n".join(f"Line {i} of the text tells of rivers, hills and {i % 7} towns." for i in range(80))
    )
    run = ["linearize", str(teacher), "--data", str(text), "--allocation", "fix", "--budget", "4"]
    run += ["--seq-len", "32", "--tokens", "1024", "--batch-size", "4", "--eval-every", "2", "--no-progress"]
    run += ["--eval-lengths", "32", "--passkey-trials", "0"]
    assert main([*run, "--out", str(folder / "single")]) == 0
    return folder, run, load_file(folder / "single" / "model" / "model.safetensors")


def _run_processes(arguments: list[str]) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dofla", *arguments]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.count("held-out perplexity") == 1  # rank 0 alone reports
    return finished


def _assert_same_students(out_dir: Path, single: dict[str, torch.Tensor]) -> None:
    saved = load_file(out_dir / "model" / "model.safetensors")
    students = [name for name in single if "dofla_student" in name]
    assert students and saved.keys() == single.keys()
    for name in students:
        torch.testing.assert_close(saved[name], single[name], rtol=1e-4, atol=1e-5)


def test_linearize_on_two_processes_from_the_command_line_equals_one_process(tiny_run, capsys):
    """`dofla linearize --nproc 2` runs torchrun (gloo): the saved students equal a one-process run's."""
    from dofla.cli import main

    folder, run, single = tiny_run
    assert main([*run, "--out", str(folder / "ddp"), "--nproc", "3"]) == 1  # checked before any work
    assert "--batch-size 4 is not divisible by --nproc 3" in capsys.readouterr().err

    _run_processes([*run, "--out", str(folder / "ddp"), "--nproc", "2"])
    _assert_same_students(folder / "ddp", single)
    for run_name, processes in (("ddp", 2), ("single", 1)):
        summary = json.loads((folder / run_name / "result.json").read_text())
        assert summary["distill_processes"] == processes and summary["distill_steps"] == 1024 // (4 * 32)


def test_layer_blocks_are_contiguous_and_as_even_as_possible():
    from dofla.distill.distributed import layer_blocks
    from dofla.errors import DoflaError

    assert layer_blocks(range(30), 3) == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    assert layer_blocks([7, 2, 5, 3, 9], 2) == [[2, 3, 5], [7, 9]]
    assert layer_blocks([4], 1) == [[4]]
    with pytest.raises(DoflaError, match=r"3 processes for 2 converted layers \[0, 1\]; use at most 2"):
        layer_blocks([0, 1], 3)


def test_layer_sharded_linearize_from_the_command_line_equals_one_process(tiny_run, capsys, monkeypatch):
    """`--nproc 2 --sharding layers --teacher-states DIR`: each rank trains one of the two layers on whole
    batches from the stored states entering it, keeps its own log and checkpoints, and rank 0 gathers both;
    the saved students equal the one-process run's. (Without a store the same path runs the teacher from
    the embeddings: the library test above.)"""
    from dofla.cli import main

    folder, run, single = tiny_run
    teacher, text = run[1], run[3]
    states = ["teacher-states", teacher, "--data", text, "--seq-len", "32", "--eval-lengths", "32"]
    assert main([*states, "--boundaries", "0,1", "--out", str(folder / "states"), "--no-progress"]) == 0
    other = [*states[:-4], "--seq-len", "16", "--eval-lengths", "16", "--boundaries", "1"]
    assert main([*other, "--out", str(folder / "other_states"), "--no-progress"]) == 0
    capsys.readouterr()

    # refused before any work, in one sentence: more processes than converted layers (with or without a
    # store), a store without a boundary at each process's first layer, a store for other rows
    sharded = [*run, "--sharding", "layers"]
    refusals = [
        (["--nproc", "3"], "3 processes for 2 converted layers [0, 1]; use at most 2 processes"),
        (["--nproc", "3", "--teacher-states", str(folder / "states")], "3 processes for 2 converted layers"),
        (
            ["--nproc", "2", "--teacher-states", str(folder / "other_states")],
            r"start at layers [1], but the 2 processes train layers 0 | 1; write them with `dofla "
            "teacher-states ... --boundaries 0,1`",
        ),
        (
            ["--layers", "1", "--teacher-states", str(folder / "other_states")],
            "computed for other train rows (",
        ),
    ]
    for extra, message in refusals:
        assert main([*sharded, *extra, "--out", str(folder / "refused")]) == 1
        assert message in " ".join(capsys.readouterr().err.split())
    assert main([*run, "--teacher-states", str(folder / "states"), "--out", str(folder / "refused")]) == 1
    assert "add --sharding layers" in capsys.readouterr().err

    stored = ["--teacher-states", str(folder / "states")]
    _run_processes([*sharded, *stored, "--out", str(folder / "stored"), "--nproc", "2"])
    _assert_same_students(folder / "stored", single)
    for rank_dir in (folder / "stored" / "distill", folder / "stored" / "distill" / "rank-1"):
        assert (rank_dir / "checkpoints" / "latest.json").is_file()  # every rank resumes from its own
        log = [json.loads(line) for line in (rank_dir / "log.jsonl").read_text().splitlines()]
        assert log[-1]["val_layers"].keys() == {"0", "1"}  # every rank logs the loss of all layers
    summary = json.loads((folder / "stored" / "result.json").read_text())
    assert summary["distill_processes"] == 2 and summary["config"]["distill"]["sharding"] == "layers"

    # --resume needs every rank's checkpoint and --overwrite clears every rank's run, before any work
    from dofla import pipeline
    from dofla.errors import DoflaError
    from dofla.run_config import LinearizeConfig

    monkeypatch.setattr(pipeline.distributed, "rank_and_world_size", lambda: (0, 2))  # rank 0 of 2
    settings = dict(out_dir=str(folder / "stored"), distill=dict(sharding="layers"))
    rank1 = folder / "stored" / "distill" / "rank-1"
    shutil.rmtree(rank1 / "checkpoints")
    with pytest.raises(DoflaError, match="rank-1/checkpoints to continue from"):
        pipeline.open_run_folder(LinearizeConfig.from_dict(dict(settings, resume=True)))
    pipeline.open_run_folder(LinearizeConfig.from_dict(dict(settings, overwrite=True)))
    assert not (rank1 / "log.jsonl").exists() and not (folder / "stored" / "distill" / "log.jsonl").exists()
