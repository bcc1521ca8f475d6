"""Data-parallel distillation with torch.distributed (gloo, 2 CPU processes) equals the single-process run."""

from __future__ import annotations

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
