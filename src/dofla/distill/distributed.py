"""Data-parallel distillation on ``torch.distributed`` (``torchrun``; gloo on CPUs, nccl on GPUs).

Each rank takes its slice of every batch (``distill`` does the slicing) and the students' gradients are
averaged across ranks before clipping, so all ranks take the same step and end with the same students as
one process running the whole batch (up to the order of float additions). Without an initialised process
group every function here is the identity.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from dofla.errors import DoflaError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size() -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def average_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce (mean) each parameter's gradient in one flat buffer; missing gradients count as 0."""
    if not is_distributed():
        return
    parameters = list(parameters)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([grad.reshape(-1).float() for grad in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        parameter.grad = flat[offset : offset + size].view_as(parameter).to(parameter.dtype)
        offset += size


def mean_across_ranks(value: float) -> float:
    """The mean of a Python number over ranks (NaN anywhere makes it NaN everywhere, so all ranks skip)."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor) / dist.get_world_size()


# ---------------------------------------------------------------------- several processes from the CLI


def environment_world_size() -> int:
    """The number of processes ``torchrun`` started (its ``WORLD_SIZE``; 1 when not under ``torchrun``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def process_group_from_environment(device: str | None = None, timeout_hours: float = 24.0) -> Iterator[int]:
    """Join the process group ``torchrun`` describes (gloo on CPUs, nccl on GPUs) for the block; yields the
    world size. Without ``torchrun`` (or when a group is already up, e.g. in tests) it does nothing.

    The long timeout lets rank 0 prepare data and the plan (a DoF estimate can take a while) while the
    other ranks wait for them.
    """
    if environment_world_size() <= 1 or is_distributed():
        yield rank_and_world_size()[1]
        return
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=timeout_hours))
    try:
        yield dist.get_world_size()
    finally:
        dist.destroy_process_group()


def share_tensor(tensor: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (others pass None). Shape and dtype travel first, then the values."""
    if not is_distributed():
        assert tensor is not None
        return tensor
    rank = dist.get_rank()
    dtypes = [torch.int64, torch.int32, torch.float32, torch.float64, torch.uint8]
    header = torch.zeros(9, dtype=torch.int64)  # dtype index, ndim, up to 7 sizes
    if rank == 0:
        if tensor.dtype not in dtypes or tensor.dim() > 7:
            raise DoflaError(
                f"cannot share a {tensor.dtype} tensor of {tensor.dim()} dimensions across ranks."
            )
        header[0], header[1] = dtypes.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.broadcast(header, src=0)
    shape = header[2 : 2 + int(header[1])].tolist()
    values = tensor.contiguous().cpu() if rank == 0 else torch.empty(shape, dtype=dtypes[int(header[0])])
    dist.broadcast(values, src=0)
    return values


def share_json(value=None):
    """Rank 0's JSON-able ``value`` on every rank (sent as UTF-8 text, never pickled)."""
    if not is_distributed():
        return value
    payload = None
    if dist.get_rank() == 0:
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    return json.loads(bytes(share_tensor(payload).tolist()).decode())


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs ``dofla ARGV`` on ``nproc`` local processes under ``torchrun``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + [
        "-m",
        "dofla",
        *argv,
    ]
