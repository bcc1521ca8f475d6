"""The gated delta rule (Gated DeltaNet) in three forms with identical semantics.

One state S (K, Dv) per key/value head; per token t, with a_t = exp(log_decay_t) in (0, 1] and
beta_t in (0, 1):

    S_t = a_t (S_{t-1} - beta_t k_t (k_t^T S_{t-1})) + beta_t k_t v_t^T,    out_t = S_t^T q_t

(no normaliser; query head h reads the state of key/value head h // (H // Hk)). Keys should have unit
L2 norm (the caller normalises them, or passes ``normalize_keys=True``); then the update writes v_t
over what S held for k_t, by a fraction beta_t. Absent keys (``key_mask`` False) change nothing:
a = 1 and beta = 0 there; their queries still read the state.

``gated_delta_rule`` (the literal token loop, tests only), ``chunked_gated_delta_rule`` (training and
prefill), ``recurrent_gated_delta_rule`` (decoding), each taking the call's tensors as one ``DeltaInputs``.
States (``DeltaState``) pass between the forms.
"""

from dofla.ops.delta.chunked import chunked_gated_delta_rule
from dofla.ops.delta.naive import gated_delta_rule
from dofla.ops.delta.recurrent import recurrent_gated_delta_rule, update_delta_state
from dofla.ops.delta.step import DeltaStepWeights, gated_delta_step
from dofla.ops.inputs import DeltaInputs

__all__ = [
    "DeltaInputs",
    "chunked_gated_delta_rule",
    "gated_delta_rule",
    "DeltaStepWeights",
    "gated_delta_step",
    "recurrent_gated_delta_rule",
    "update_delta_state",
]
