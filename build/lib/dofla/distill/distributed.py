"""Data-parallel distillation on ``torch.distributed`` (``torchrun``; gloo on CPUs, nccl on GPUs).

Each rank takes its slice of every batch (``distill`` does the slicing) and the students' gradients are
averaged across ranks before clipping, so all ranks take the same step and end with the same students as
one process running the whole batch (up to the order of float additions). Without an initialised process
group every function here is the identity.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


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
