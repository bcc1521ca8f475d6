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


class ProcessShare:
    """How this process shares a distillation run: data parallel (a slice of every batch, gradients averaged;
    rank 0 writes the run folder) or layer sharding (``by_layers``: its own layers on whole batches, its own
    run folder; the loss weighted by layers and the gradient norm are combined across ranks, so every rank
    logs, clips, skips and stops early as one process training all layers would). Without a process group it
    is one process and every method is the identity."""

    def __init__(self, rank: int, world_size: int, by_layers: bool) -> None:
        self.rank, self.world_size, self.by_layers = rank, world_size, by_layers
        self.layers = self.all_layers = 0

    @classmethod
    def of(cls, data_parallel: bool, loss: str, batch_size: int) -> ProcessShare:
        """This process's share (``data_parallel`` False: layer sharding), refusing what it cannot train."""
        from dofla.distill.losses import LOSSES, layerwise_loss_names

        rank, world_size = rank_and_world_size()
        by_layers = world_size > 1 and not data_parallel
        if by_layers and not LOSSES[loss].layerwise:
            raise DoflaError(
                f"layer sharding trains each process's layers on their own, which the {loss} loss (the whole "
                f"model end to end) cannot; choose a layer-wise loss ({', '.join(layerwise_loss_names())}) or "
                "data sharding."
            )
        if world_size > 1 and not by_layers and batch_size % world_size:
            raise DoflaError(f"batch size {batch_size} must be divisible by the {world_size} processes.")
        return cls(rank, world_size, by_layers)

    def count_layers(self, students: dict, given: bool) -> None:
        """Layer sharding: check every rank has its own layers, and count them over all ranks."""
        if self.by_layers:
            check_disjoint_layers(sorted(students) if given else None)
        self.layers = len(students)
        # layer sharding: each rank's mean is weighted by its layer count to give the mean over all layers
        self.all_layers = sum_across_ranks(len(students)) if self.by_layers else len(students)

    @property
    def writes(self) -> bool:
        """Whether this process writes its run folder (layer sharding: every rank keeps its own)."""
        return self.rank == 0 or self.by_layers

    @property
    def batch_divisor(self) -> int:
        """What a batch's size must divide by: the ranks that slice it (data parallel), else 1."""
        return 1 if self.by_layers else self.world_size

    def slice(self, indices: list[int]) -> list[int]:
        """This process's part of a batch's sequence indices (all of them under layer sharding)."""
        if self.by_layers:
            return indices
        local = len(indices) // self.world_size
        return indices[self.rank * local : (self.rank + 1) * local]

    def loss(self, value: float) -> float:
        """A loss over this rank's layers (or slice) -> the loss over all layers (or the whole batch)."""
        if self.by_layers:
            return sum_across_ranks(value * self.layers) / self.all_layers
        return mean_across_ranks(value)

    def validation(self, loss: float, layer_losses: dict[int, float]) -> tuple[float, dict[int, float]]:
        """A held-out loss and its layers' losses over every rank."""
        return self.loss(loss), gathered_layer_losses(layer_losses) if self.by_layers else layer_losses

    def clip_gradients(self, parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Average the gradients (data parallel) or combine their norm (layer sharding), clip, return the norm."""
        if self.by_layers:
            return clip_global_norm(parameters, max_norm)
        average_gradients(parameters)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def bad_layer(self, local_bad_layer, *arguments) -> int | None:
        """``local_bad_layer(*arguments)``, the first layer gone non-finite here, as the lowest over every
        rank under layer sharding (called on every rank alike)."""
        found = local_bad_layer(*arguments)
        return min_across_ranks(found) if self.by_layers else found


def clip_global_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of every rank's parameters by their joint norm, as if all were in one process
    (layer sharding); returns that norm. Each rank adds its squared norm to the others'."""
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    total = torch.tensor(math.sqrt(sum_across_ranks(float(local) ** 2)), dtype=torch.float32)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def gathered_layer_losses(layer_losses: dict[int, float]) -> dict[int, float]:
    """Every rank's per-layer losses in one dict, on every rank (layer sharding)."""
    gathered = gather_json({str(layer): value for layer, value in layer_losses.items()})
    return dict(sorted((int(layer), value) for part in gathered for layer, value in part.items()))


def check_disjoint_layers(layers: list[int] | None) -> None:
    """Layer sharding: refuse, on every rank alike, a rank without its own ``layers`` or two ranks sharing one
    (each would count in the loss and the gradient norm twice)."""
    owned = gather_json(layers)
    if any(part is None for part in owned):
        raise DoflaError(
            f"layer sharding needs each process's own layers (distill(..., layers=...)); rank "
            f"{owned.index(None)} gave none: pass dofla.distill.layer_blocks(...)[rank]."
        )
    shared = sorted({layer for part in owned for layer in part if sum(layer in other for other in owned) > 1})
    if shared:
        raise DoflaError(
            f"layer sharding needs each layer on one process, but layers {shared} are on several ({owned}); "
            "pass dofla.distill.layer_blocks(...)[rank]."
        )
