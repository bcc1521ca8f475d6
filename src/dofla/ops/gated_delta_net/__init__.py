"""The token mixer of transformers' ``Qwen3_5GatedDeltaNet`` after its projections, in four forms with
identical semantics: a causal depthwise convolution with SiLU over the projected q, k, v, L2-normalised q
and k (q also scaled by ``head_k_dim ** -0.5``), and the gated delta rule of :mod:`dofla.ops.delta`.

``naive`` (the literal convolution and token loop, tests only), ``chunked`` (training and prefill),
``recurrent`` (a loop of ``step``) and ``step`` (one token: decoding); all but the step take the call's
tensors as one ``GatedDeltaNetInputs``. States (``GatedDeltaNetState``: the
convolution's last inputs and the delta-rule memory) pass between the forms.
"""

from dofla.ops.gated_delta_net.chunked import chunked_gated_delta_net
from dofla.ops.gated_delta_net.common import GatedDeltaNetShape, GatedDeltaNetState
from dofla.ops.gated_delta_net.naive import gated_delta_net
from dofla.ops.gated_delta_net.recurrent import recurrent_gated_delta_net
from dofla.ops.gated_delta_net.step import gated_delta_net_step
from dofla.ops.inputs import GatedDeltaNetInputs

__all__ = [
    "GatedDeltaNetInputs",
    "GatedDeltaNetShape",
    "GatedDeltaNetState",
    "chunked_gated_delta_net",
    "gated_delta_net",
    "gated_delta_net_step",
    "recurrent_gated_delta_net",
]
