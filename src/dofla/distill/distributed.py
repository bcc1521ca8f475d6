"""Distillation on ``torch.distributed`` (``torchrun``; gloo on CPUs, nccl on GPUs), sharded two ways.

Data sharding: each rank takes its slice of every batch (``distill`` does the slicing) and the students'
gradients are averaged across ranks before clipping, so all ranks take the same step and end with the same
students as one process running the whole batch (up to the order of float additions).

Layer sharding: each rank trains its own contiguous block of converted layers (:func:`layer_blocks`) on
whole batches; only numbers cross ranks during training (the loss weighted by layers, the squared gradient
norm), and :func:`gather_students` sends every block's trained students to the other ranks at the end.

Without an initialised process group every function here is the identity.
"""

from __future__ import annotations

import json
import math
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
    return sum_across_ranks(value) / rank_and_world_size()[1]


def sum_across_ranks(value: float) -> float:
    """The sum of a Python number over ranks (NaN anywhere makes it NaN everywhere)."""
    if not is_distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor)


def min_across_ranks(value: int | None) -> int | None:
    """The smallest of the ranks' integers (None where a rank has none; None if no rank has one)."""
    if not is_distributed():
        return value
    tensor = torch.tensor([math.inf if value is None else value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return None if math.isinf(float(tensor)) else int(tensor)


# ------------------------------------------------------------------------------------------ layer sharding


def layer_blocks(layers: Iterable[int], parts: int) -> list[list[int]]:
    """``layers`` (sorted) cut into ``parts`` contiguous blocks, one per rank, whose sizes differ by at most
    one (the first blocks are the larger). More parts than layers is refused."""
    layers = sorted(layers)
    if parts > len(layers):
        raise DoflaError(
            f"layer sharding gives each process its own converted layers, but there are {parts} processes "
            f"for {len(layers)} converted layers {layers}; use at most {len(layers)} processes."
        )
    size, extra = divmod(len(layers), parts)
    blocks, start = [], 0
    for part in range(parts):
        stop = start + size + (part < extra)
        blocks.append(layers[start:stop])
        start = stop
    return blocks


def gather_students(students: dict[int, torch.nn.Module], blocks: list[list[int]]) -> None:
    """Give every rank the trained students of every block: each layer's student tensors (parameters and
    buffers, in ``state_dict`` order, the same on every rank) are broadcast in place from the rank that owns
    its block (``blocks[rank]``). Nothing is pickled."""
    if not is_distributed():
        return
    for owner, block in enumerate(blocks):
        for layer in block:
            with torch.no_grad():
                for tensor in students[layer].state_dict().values():
                    dist.broadcast(tensor, src=owner)


# ---------------------------------------------------------------------- several processes from the CLI


def environment_world_size() -> int:
    """The number of processes ``torchrun`` started (its ``WORLD_SIZE``; 1 when not under ``torchrun``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def process_group_from_environment(device: str | None = None, timeout_hours: float = 24.0) -> Iterator[int]:
    """Join the process group ``torchrun`` describes (gloo for CPU tensors, nccl for CUDA ones) for the
    block; yields the world size. Without ``torchrun`` (or when a group is already up, e.g. in tests) it
    does nothing.

    The long timeout lets rank 0 prepare data and the plan (a DoF estimate can take a while) while the
    other ranks wait for them.
    """
    if environment_world_size() <= 1 or is_distributed():
        yield rank_and_world_size()[1]
        return
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # the numbers and shared data travel as CPU tensors (gloo), the students' tensors on the GPU (nccl)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(hours=timeout_hours))
    try:
        yield dist.get_world_size()
    finally:
        dist.destroy_process_group()


def share_tensor(tensor: torch.Tensor | None, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``tensor`` on every rank (others pass None). Shape and dtype travel first, then the
    values."""
    if not is_distributed():
        assert tensor is not None
        return tensor
    rank = dist.get_rank()
    dtypes = [torch.int64, torch.int32, torch.float32, torch.float64, torch.uint8]
    header = torch.zeros(9, dtype=torch.int64)  # dtype index, ndim, up to 7 sizes
    if rank == src:
        if tensor.dtype not in dtypes or tensor.dim() > 7:
            raise DoflaError(
                f"cannot share a {tensor.dtype} tensor of {tensor.dim()} dimensions across ranks."
            )
        header[0], header[1] = dtypes.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.broadcast(header, src=src)
    shape = header[2 : 2 + int(header[1])].tolist()
    values = tensor.contiguous().cpu() if rank == src else torch.empty(shape, dtype=dtypes[int(header[0])])
    dist.broadcast(values, src=src)
    return values


def share_json(value=None, src: int = 0):
    """Rank ``src``'s JSON-able ``value`` on every rank (sent as UTF-8 text, never pickled)."""
    if not is_distributed():
        return value
    payload = None
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    return json.loads(bytes(share_tensor(payload, src).tolist()).decode())


def gather_json(value) -> list:
    """Every rank's JSON-able ``value``, in rank order, on every rank (``[value]`` without a group)."""
    if not is_distributed():
        return [value]
    return [
        share_json(value if dist.get_rank() == source else None, source)
        for source in range(dist.get_world_size())
    ]


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs ``dofla ARGV`` on ``nproc`` local processes under ``torchrun``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] + [
        "-m",
        "dofla",
        *argv,
    ]
