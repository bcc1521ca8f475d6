"""The recall cache: a fixed number of past tokens per state head kept beside the sliding window, those the
layer's memory recalls worst (LoLA's self-recall error), attended together with the window under one softmax.

When token j leaves the window (at step t = j + W), its score is how badly the memory, as it stands after
step t, reconstructs the token's value from its key: ``|| S_t^T k_j - v_j ||^2``. Every token is scored once,
at the same age W. The cache holds the ``budget`` best-scored tokens that have left the window (sinks
excepted: the window already sees them); a newer token takes a slot only by scoring strictly higher than
the lowest kept one. The cache's keys join the window's softmax: the window part and the cache part are
merged by their log-sum-exps, which is one softmax over both key sets. Per token the cost is constant in
the context: ``budget`` keys read and one more memory read (the leaving token's recall).

With a second score, the attention each token drew while in the window (``attention``: the heavy hitters
of H2O), the cache keeps for each score its own number of best tokens, and a query sees their union.

``naive`` (references, tests only), ``chunked`` (every form of the cells: chunks of queries carry the cache
from one to the next; the recurrent form is chunks of one token), ``step`` (the cells' decoding step: one
token joins the cache in O(budget), the cache equal to the chunked form's).
"""

from dofla.ops.recall_cache.attention import (
    attention_scores_naive,
    ring_attention_weights,
    window_attention_scores,
)
from dofla.ops.recall_cache.chunked import (
    RecallCache,
    leaving_tokens,
    merge_softmax_parts,
    recall_cache_attention,
    recall_errors,
)
from dofla.ops.recall_cache.naive import recall_cache_window_attention, recall_scores_naive
from dofla.ops.recall_cache.step import insert_recall_candidate

__all__ = [
    "RecallCache",
    "attention_scores_naive",
    "insert_recall_candidate",
    "leaving_tokens",
    "merge_softmax_parts",
    "recall_cache_attention",
    "recall_cache_window_attention",
    "recall_errors",
    "recall_scores_naive",
    "ring_attention_weights",
    "window_attention_scores",
]
