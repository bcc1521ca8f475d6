"""Attention transfer with each converted layer's loss replayed from CUDA graphs (``--cuda-graphs``).

A layer-wise training step runs, in every converted layer, the student's forward on the teacher's q, k, v,
its loss against the teacher's output and the backward: about 1,500 small operators per layer for the
gated delta cell in PyTorch, each launched from Python. On a GPU that is the host's time whatever the work
(measured on an H200: attention transfer at 0.03x the teacher's forward tokens/s). The shapes of a training
step do not change from one step to the next, so each layer's loss, forward and backward, can be captured
once as two CUDA graphs (``torch.cuda.make_graphed_callables``) and replayed: one launch each instead of
hundreds. The teacher's forward between the layers stays as it is.

What a graph needs, and what is checked on the CPU (``tests/test_graphed_training.py``): the loss reads no
value of the device back to the host (no ``.item()``, no branch on a tensor's value) and its Python side
does not depend on the step; the teacher's inputs are copied into the graph's own buffers at each replay.
Layers are captured the first time a shape is seen (three eager warm-up passes, then the capture), one
memory pool for all of them, captured and replayed in the order the layers run. Parameters are updated in
place by the optimiser, which the graphs read; a parameter replaced by a new tensor (``param.data = ...``)
would not be seen, which nothing in the trainer does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from dofla.dispatch import AttentionCall
from dofla.distill.losses import layer_loss
from dofla.errors import DoflaError


class _LayerLoss(nn.Module):
    """One layer's loss as a module of tensors only: ``forward(query, key, value, output)`` -> the scalar
    loss; the call's other fields (module, layer index, scaling) are those of the call it was built from,
    the same at every step of one shape. No attention mask: the training rows are whole token rows, which
    :func:`~dofla.distill.teacher_forcing.teacher_forced_step` feeds without one, so the mask a family
    builds holds no padding, and the student, which reads masks for padding only, needs none (looking at
    its values to find that out is what a graph cannot do)."""

    def __init__(self, kind: str, student: nn.Module, call: AttentionCall, query_chunk: int) -> None:
        super().__init__()
        self.kind, self.student, self.query_chunk = kind, student, int(query_chunk)
        self.template = replace(call, attention_mask=None, extra={})  # no tensors of one step kept

    def forward(self, query: Tensor, key: Tensor, value: Tensor, output: Tensor) -> Tensor:
        call = replace(self.template, query=query, key=key, value=value, output=output)
        return layer_loss(self.kind, self.student, call, query_chunk=self.query_chunk)


def graph_inputs(call: AttentionCall) -> tuple[Tensor, ...]:
    """The tensors a graphed layer loss takes, in order: the teacher's q, k, v and output, detached."""
    return tuple(tensor.detach() for tensor in (call.query, call.key, call.value, call.output))


def _shape_key(call: AttentionCall, inputs: tuple[Tensor, ...]) -> tuple:
    autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
    shapes = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
    return call.layer_index, shapes, float(call.scaling), autocast


def make_graphed(module: nn.Module, sample_args: tuple[Tensor, ...], pool) -> Callable:
    """``torch.cuda.make_graphed_callables`` of ``module`` into ``pool`` (the default capture)."""
    return torch.cuda.make_graphed_callables(module, sample_args, allow_unused_input=True, pool=pool)


class LayerLossGraphs:
    """Every converted layer's layer-wise loss (forward and backward), captured once per input shape and
    replayed: hand it to :func:`dofla.distill.teacher_forcing.teacher_forced_step` as ``graphs``.

    ``capture(module, sample_args, pool)`` makes the graphed callable (default: :func:`make_graphed`, CUDA
    graphs); the CPU tests give a stand-in that returns the module itself, which runs the same module on the
    same inputs without a graph.
    """

    def __init__(self, kind: str, *, query_chunk: int = 128, capture: Callable | None = None) -> None:
        self.kind, self.query_chunk = kind, int(query_chunk)
        self.capture = capture or make_graphed
        self.graphed: dict[tuple, Callable] = {}
        self.pool = None

    def loss(self, student: nn.Module, call: AttentionCall) -> Tensor:
        """The layer's loss on ``call`` through its graph (captured at the first call of this shape); its
        backward replays the backward graph and accumulates the gradients into the student's parameters."""
        inputs = graph_inputs(call)
        key = _shape_key(call, inputs)
        graphed = self.graphed.get(key)
        if graphed is None:
            if self.capture is make_graphed and not inputs[0].is_cuda:
                raise DoflaError(
                    "CUDA graphs of the attention transfer need the model on a CUDA device; drop "
                    "--cuda-graphs or train on cuda."
                )
            if self.pool is None and self.capture is make_graphed:
                self.pool = torch.cuda.graph_pool_handle()
            module = _LayerLoss(self.kind, student, call, self.query_chunk)
            try:
                with torch.enable_grad():
                    graphed = self.capture(module, inputs, self.pool)
            except RuntimeError as error:  # CUDA's capture refusing an operator, said in its own words
                raise DoflaError(
                    f"capturing layer {call.layer_index}'s training step as a CUDA graph failed ({error}); "
                    "train without --cuda-graphs."
                ) from error
            self.graphed[key] = graphed
        for parameter in student.parameters():
            # a graph's backward hands autograd its own gradient buffers, which autograd would adopt as the
            # .grad of a parameter that has none; a second backward before the optimiser step (accumulation)
            # would then add a buffer to itself. Gradients that exist are added to instead.
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        return graphed(*inputs)
