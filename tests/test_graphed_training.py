"""Attention transfer through graphed layer losses (dofla.distill.graphed, ``--cuda-graphs``).

On the CPU: the graphed path (with a stand-in for the capture that runs the same module without a graph)
gives the eager path's losses and gradients, step after step; and a layer's loss, forward and backward,
reads no value back from the device (what a CUDA graph capture would refuse), for every cell, loss and
mask the families give. On a GPU: the real CUDA graphs against eager training steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dofla.convert import convert, plan_for
from dofla.distill import teacher_forcing
from dofla.distill.graphed import LayerLossGraphs
from dofla.errors import DoflaError
from dofla.models import build_tiny_model
from dofla.settings import DistillSettings

# (family, plan_for arguments, loss): every cell, the window with sinks, a short convolution, the losses
SETTINGS = [
    ("llama", dict(kind="linear", cell="linear", feature_map="learnable_prf"), "softmax"),
    ("llama", dict(kind="hybrid", cell="linear", feature_map="hedgehog", window=4, sinks=2), "output_mse"),
    ("llama", dict(kind="hybrid", cell="gla", feature_map="hedgehog", window=4, sinks=2), "output_mse"),
    (
        "llama",
        dict(kind="hybrid", cell="gated_delta", feature_map="projection", window=4, sinks=2),
        "split_mse",
    ),
    (
        "llama",
        dict(kind="linear", cell="gated_delta", feature_map="projection", options={"short_conv": 4}),
        "output_mse",
    ),
    (
        "mistral",
        dict(kind="hybrid", cell="gated_delta", feature_map="projection", window=4, sinks=2),
        "output_mse",
    ),
    ("mistral", dict(kind="hybrid", cell="linear", feature_map="hedgehog", window=4), "l2"),
    ("gemma2", dict(kind="hybrid", cell="gla", feature_map="hedgehog", window=4), "output_mse"),
]
IDS = [f"{family}-{arguments['kind']}-{arguments['cell']}-{loss}" for family, arguments, loss in SETTINGS]


def converted(family: str, arguments: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = build_tiny_model(family)
    convert(model, plan_for(model, feature_dim=8, convert_windowed=True, **arguments))
    return model, teacher_forcing.freeze_teacher(model)


def batch(model, seed: int, length: int = 24) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def gradients(students) -> list[torch.Tensor]:
    return [
        p.grad.clone() for index in sorted(students) for p in students[index].parameters() if p.requires_grad
    ]


def no_graph(module, sample_args, pool):
    """A capture stand-in: the module itself, run eagerly on each call's inputs."""
    return module


@pytest.mark.parametrize(("family", "arguments", "loss"), SETTINGS, ids=IDS)
def test_graphed_losses_and_gradients_equal_the_eager_ones(family, arguments, loss):
    eager_model, eager_students = converted(family, arguments)
    graphed_model, graphed_students = converted(family, arguments)
    captures = []

    def counting(module, sample_args, pool):
        captures.append(tuple(tuple(t.shape) for t in sample_args))
        return module

    graphs = LayerLossGraphs(loss, capture=counting)
    for step, length in enumerate((24, 24, 16)):  # two steps of one shape, then a new shape
        tokens = batch(eager_model, seed=step, length=length)
        for students in (eager_students, graphed_students):
            for student in students.values():
                student.zero_grad(set_to_none=True)
        eager = teacher_forcing.teacher_forced_step(eager_model, tokens, eager_students, loss, backward=True)
        graphed = teacher_forcing.teacher_forced_step(
            graphed_model, tokens, graphed_students, loss, backward=True, graphs=graphs
        )
        assert graphed == eager
        for got, expected in zip(gradients(graphed_students), gradients(eager_students), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    layers = len(eager_students)
    assert len(captures) == 2 * layers  # once per layer and shape, reused at the second step
    # gradients add up over two backward passes before a step, as without graphs
    for students in (eager_students, graphed_students):
        for student in students.values():
            student.zero_grad(set_to_none=True)
    for seed in (5, 6):
        tokens = batch(eager_model, seed=seed)
        teacher_forcing.teacher_forced_step(eager_model, tokens, eager_students, loss, backward=True)
        teacher_forcing.teacher_forced_step(
            graphed_model, tokens, graphed_students, loss, backward=True, graphs=graphs
        )
    for got, expected in zip(gradients(graphed_students), gradients(eager_students), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


# what reads a device value back to the host: .item(), float(t), bool(t), nonzero, equal
READ_BACK = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.equal.default,
}


class _ReadBacks(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READ_BACK:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("family", "arguments", "loss"), SETTINGS, ids=IDS)
def test_a_layer_loss_reads_nothing_back_from_the_device(family, arguments, loss):
    """What make_graphed_callables runs before and during the capture (the forward, then the gradients of
    the parameters), watched for operators that would wait for the device: a capture refuses them."""
    model, students = converted(family, arguments)
    watched = []

    def watching(module, sample_args, pool):
        with _ReadBacks() as mode:
            output = module(*sample_args)
            parameters = [p for p in module.parameters() if p.requires_grad]
            torch.autograd.grad(output, parameters, allow_unused=True)
        watched.append(mode.seen)
        return module

    graphs = LayerLossGraphs(loss, capture=watching)
    teacher_forcing.teacher_forced_step(
        model, batch(model, seed=0), students, loss, backward=True, graphs=graphs
    )
    assert len(watched) == len(students)
    assert watched == [[] for _ in students]


def test_the_watch_sees_a_read_back():
    """The watch above is not blind: a loss that branches on a tensor's value is caught."""
    with _ReadBacks() as mode:
        value = torch.ones(3).sum()
        if value > 0:
            pass
    assert mode.seen


def test_cuda_graphs_need_a_cuda_device_and_a_layerwise_loss():
    from dofla.run_config import LinearizeConfig

    config = LinearizeConfig.from_dict(
        dict(out_dir="unused", teacher=dict(device="cpu"), distill=dict(cuda_graphs=True))
    )
    with pytest.raises(DoflaError, match="--cuda-graphs.*CUDA device"):
        config.validate()
    with pytest.raises(DoflaError, match="--cuda-graphs.*layer-wise"):
        DistillSettings(loss="direct", cuda_graphs=True).validate()
    model, students = converted("llama", SETTINGS[0][1])
    with pytest.raises(DoflaError, match="CUDA device"):
        teacher_forcing.teacher_forced_step(
            model, batch(model, seed=0), students, "softmax", backward=True, graphs=LayerLossGraphs("softmax")
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("family", "arguments", "loss"), SETTINGS[1:5], ids=IDS[1:5])
def test_cuda_graphed_training_steps_follow_the_eager_ones_on_gpu(family, arguments, loss):
    """Three optimiser steps through captured CUDA graphs against the same steps run eagerly (bf16 autocast:
    close, not equal)."""
    runs = []
    for graphs in (None, LayerLossGraphs(loss)):
        model, students = converted(family, arguments)
        model.cuda()
        parameters = [p for s in students.values() for p in s.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=1e-3)
        losses = []
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            tokens = batch(model, seed=step).cuda()
            losses.append(
                teacher_forcing.teacher_forced_step(
                    model, tokens, students, loss, backward=True, graphs=graphs
                )
            )
            optimizer.step()
        runs.append((losses, [p.detach().float().cpu() for p in parameters]))
    (eager_losses, eager_parameters), (graphed_losses, graphed_parameters) = runs
    for got, expected in zip(graphed_losses, eager_losses, strict=True):
        assert got.keys() == expected.keys()
        for layer in got:
            assert got[layer] == pytest.approx(expected[layer], rel=2e-2, abs=1e-4)
    for got, expected in zip(graphed_parameters, eager_parameters, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)
