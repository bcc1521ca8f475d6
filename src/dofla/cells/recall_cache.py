"""The recall cache of a gated-delta hybrid layer (option ``recall_cache``: slots per state head): the tokens
its memory recalls worst, kept beside the window and read in the window's softmax (:mod:`dofla.ops.recall_cache`).

The memory scores each token as it leaves the window by reading itself at the token's key (one more read of
the memory per token, without gradients: the score only selects); the window's softmax then runs over its
keys, its sinks and the kept tokens. The mix with the memory's read-out is the cell's, unchanged.

The cache has no parameters, so a hybrid trained without it can take it afterwards
(:func:`switch_on_recall_cache`; ``dofla linearize --recall-cache K``, setting ``student.recall_cache``): trained
as the plain hybrid, evaluated and saved with the cache (training with it in the loop is the cell option).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.cell_inputs import AttendInputs
from dofla.cells.window import window_part
from dofla.errors import DoflaError
from dofla.ops import DeltaInputs, chunked_gated_delta_rule, recurrent_gated_delta_rule
from dofla.ops.recall_cache import (
    RecallCache,
    insert_recall_candidate,
    leaving_tokens,
    merge_softmax_parts,
    recall_cache_attention,
    recall_cache_window_attention,
    recall_errors,
    recall_scores_naive,
)
from dofla.ops.window.step import RingWindow, ring_window_step


def recall_budget(cell, options: dict) -> int:
    """The ``recall_cache`` option checked: a whole number of slots per state head (0: no cache)."""
    budget = options.get("recall_cache", 0)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise DoflaError(
            f"layer {cell.layer_index}: recall_cache is the number of tokens kept per head beside the window, "
            f"a whole number >= 1 (0: none); got {budget!r}."
        )
    if budget and cell.kind != "hybrid":
        raise DoflaError(
            f"layer {cell.layer_index}: recall_cache reads in the window's softmax; it needs kind hybrid."
        )
    if budget and options.get("short_conv", 0):
        raise DoflaError(
            f"layer {cell.layer_index}: recall_cache scores tokens by the memory's recall of their own key and "
            "value; use it without short_conv."
        )
    return int(budget)


def check_recall_cache_run(
    slots: int, cell: str, kind: str, options: dict, position_period: int | None
) -> None:
    """The settings of a run with a recall cache, before any work: switched on after training
    (``--recall-cache slots``), a gated_delta hybrid without short_conv and without the cell option (which
    trains with the cache); either way without a position period."""
    if options.get("recall_cache") and position_period:  # the cell option trains with the cache
        raise DoflaError(
            f"the recall cache reads the true positions, and this run sets --position-period {position_period}; "
            "drop it (or set 0) with the cell option recall_cache."
        )
    if not slots:
        return
    if cell != "gated_delta" or kind != "hybrid":
        raise DoflaError(
            f"--recall-cache keeps tokens beside the window of a gated_delta hybrid, and this run converts to "
            f"{cell} ({kind}); give --cell gated_delta --kind hybrid, or leave --recall-cache at 0."
        )
    if options.get("recall_cache"):
        raise DoflaError(
            "--recall-cache switches the cache on after training and the cell option recall_cache trains with "
            "it; give one of the two."
        )
    if options.get("short_conv"):
        raise DoflaError("--recall-cache scores tokens by the memory's recall; use it without short_conv.")
    if position_period:
        raise DoflaError(
            f"the recall cache reads the true positions, and this run sets --position-period {position_period}; "
            "drop it (or set 0) with --recall-cache."
        )


def switch_on_recall_cache(model, slots: int) -> list[int]:
    """Give every converted layer of ``model`` (each a gated_delta hybrid, trained without the cache) a recall
    cache of ``slots`` tokens per state head, recorded in the model's plan (saved with it). Returns the
    layers. Refused with one sentence for a model whose layers cannot take it or that reads wrapped
    positions (a position period)."""
    from dofla.models.surgery import students

    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise DoflaError(f"the recall cache keeps a whole number >= 1 of tokens per head; got {slots!r}.")
    plan, layers = getattr(model, "dofla_plan", None), students(model)
    if plan is None or not layers:
        raise DoflaError("the recall cache joins the layers of a converted model; convert it first.")
    for index, student in sorted(layers.items()):
        if getattr(student, "recall_budget", None) is None:
            raise DoflaError(
                f"layer {index} is a {plan.layers[index].cell} cell; the recall cache needs gated_delta."
            )
        if student.position_period is not None:
            raise DoflaError(
                f"layer {index} reads positions modulo {student.position_period}; the recall cache reads the "
                "true positions: set the position period to none first."
            )
        recall_budget(student, {**student.cell_options, "recall_cache": slots})  # hybrid, no short_conv
    for index, student in layers.items():
        student.cell_options["recall_cache"] = slots
        student.recall_budget = slots
        plan.layers[index].options = {**plan.layers[index].options, "recall_cache": slots}
    return sorted(layers)


def check_recall_call(cell, key_mask: Tensor | None) -> None:
    """A call the recall cache can take: no padding and no position period (both would change which key
    the memory holds for a token)."""
    if key_mask is not None:
        raise DoflaError(
            f"layer {cell.layer_index}: the recall cache takes unpadded sequences; run one sequence per batch "
            "row without padding."
        )
    if cell.position_period is not None:
        raise DoflaError(
            f"layer {cell.layer_index}: the recall cache does not take a position period; drop it."
        )


def window_with_recall_cache(
    cell,
    form: str,
    inputs: AttendInputs,
    memory_keys: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    memory_state,
    window_state,
    cache: RecallCache | None,
) -> tuple[Tensor, Tensor, object, RecallCache | None]:
    """The window's softmax with the recall cache in ``form`` on a call's ``inputs``: memory_keys (B, Hs, T, K)
    the memory's unit-norm keys, log_decay and beta (B, Hs, T) its gates, memory_state / window_state / cache:
    the layer's before the call (None at the start). Returns out (B, H, T, Dv), lse (B, H, T), the new window
    state and the new cache (None for the naive form)."""
    query, keys, values = inputs.query, cell.state_heads_view(inputs.key), inputs.values  # keys (B, Hs, T, D)
    scaling = inputs.scaling
    budget = cell.recall_budget
    if form == "naive":
        if inputs.sink_query is not None:
            raise DoflaError(
                "the recall cache's naive form scores the sinks with the query itself; use chunked."
            )
        token_scores = recall_scores_naive(
            memory_keys, values, log_decay, beta, window=cell.window, sinks=cell.sinks
        )
        out, lse = recall_cache_window_attention(
            query,
            keys,
            values,
            token_scores,
            scaling=scaling,
            window=cell.window,
            sinks=cell.sinks,
            budget=budget,
            softcap=cell.softcap,
            return_lse=True,
        )
        return out, lse, None, None
    window, window_lse, new_window = window_part(cell, form, inputs, window_state, return_lse=True)
    leaving_key, leaving_value, positions, valid = leaving_tokens(
        keys, values, window_state, cell.window, cell.sinks
    )
    with torch.no_grad():  # the score only selects
        features, _ = cell.feature_map(leaving_key, is_query=False)
        reads = F.normalize(features, dim=-1)
        read_inputs = DeltaInputs(reads, memory_keys, values, log_decay, beta)
        if form == "recurrent":
            recalled, _ = recurrent_gated_delta_rule(read_inputs, state=memory_state)
        else:
            recalled = chunked_gated_delta_rule(
                read_inputs,
                chunk_size=cell.chunk_size_for("delta", reads.shape[2]),
                initial_state=memory_state,
            )
        scores = recall_errors(recalled, leaving_value, valid)
    cache = RecallCache.empty(keys, values, budget) if cache is None else cache
    kept, kept_lse, cache = recall_cache_attention(
        query,
        leaving_key,
        leaving_value,
        scores,
        positions,
        cache,
        scaling=scaling,
        softcap=cell.softcap,
        chunk_size=1 if form == "recurrent" else 64,
    )
    out, lse = merge_softmax_parts(window.to(kept.dtype), window_lse.to(kept.dtype), kept, kept_lse)
    return out, lse, new_window, cache


def window_step_with_recall_cache(
    cell, ring_inputs: tuple, memory: Tensor, cache: RecallCache, *, return_lse: bool = False, **ring_options
) -> tuple[Tensor, Tensor | None, RingWindow, RecallCache]:
    """One decoding token of :func:`window_with_recall_cache`: ring_inputs the window's ring step's (the ring
    before the token, queries (B, Hs, G, D), key (B, Hs, D), values (B, Hs, Dv)), memory (B, Hs, K, Dv) the
    memory after the token, cache the recall cache before it. The token leaving the window (the ring's next
    slot, before the step writes over it) is scored by the memory's recall of it, as the chunked form
    scores it, and joins the cache (``insert_recall_candidate``). Returns out (B, Hs, G, Dv) of one softmax
    over window, sinks and cache, its log-sum-exp (B, Hs, G) with ``return_lse`` (else None), the ring and
    the cache after the token. Sinks seen from the window's edge only as turned keys (``sink_key_turn``)."""
    ring = ring_inputs[0]
    position = ring.num_tokens - cell.window  # the token the query no longer sees in the window
    if position >= cell.sinks:  # none before the window is full; sinks never leave
        slot = ring.next_slot
        key = ring.keys[:, :, slot].clone()  # the ring step writes over the slot in place
        value = ring.values[:, :, slot, : ring.value_dim].clone()
        with torch.no_grad():  # the score only selects
            features, _ = cell.feature_map(key[:, :, None], is_query=False)
            reads = F.normalize(features, dim=-1).to(memory.dtype)  # (B, Hs, 1, K)
            valid = torch.ones(1, dtype=torch.bool, device=key.device)
            score = recall_errors(reads @ memory, value[:, :, None], valid)[:, :, 0]  # (B, Hs)
        cache = insert_recall_candidate(cache, key, value, score, position)
    extra = (cache.keys, cache.values, torch.isfinite(cache.scores))  # read in the window's own softmax
    if return_lse:
        out, lse, ring = ring_window_step(*ring_inputs, return_lse=True, extra=extra, **ring_options)
    else:
        (out, ring), lse = ring_window_step(*ring_inputs, extra=extra, **ring_options), None
    return out, lse, ring, cache
