"""The recall cache of a gated-delta hybrid layer (option ``recall_cache``: slots per state head): the tokens
its memory recalls worst, kept beside the window and read in the window's softmax (:mod:`dofla.ops.recall_cache`).

The memory scores each token as it leaves the window by reading itself at the token's key (one more read of
the memory per token, without gradients: the score only selects); the window's softmax then runs over its
keys, its sinks and the kept tokens. The mix with the memory's read-out is the cell's, unchanged.

With the option ``heavy_hitters`` (slots per state head) the cache also keeps the tokens that drew the most
attention while in the window (:mod:`dofla.ops.recall_cache.attention`; no memory read): each query then
sees the union of the ``recall_cache`` worst recalled and the ``heavy_hitters`` most attended tokens that
have left the window, in ``recall_cache + heavy_hitters`` slots. Either may be 0.

The cache has no parameters, so a hybrid trained without it can take it afterwards
(:func:`switch_on_recall_cache`; ``dofla linearize --recall-cache K``, setting ``student.recall_cache``): trained
as the plain hybrid, evaluated and saved with the cache (training with it in the loop is the cell option).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from dofla.cell_inputs import AttendInputs
from dofla.cells.window import window_part
from dofla.errors import DoflaError
from dofla.ops import DeltaInputs, chunked_gated_delta_rule, recurrent_gated_delta_rule
from dofla.ops.recall_cache import (
    RecallCache,
    attention_scores_naive,
    insert_recall_candidate,
    leaving_tokens,
    merge_softmax_parts,
    recall_cache_attention,
    recall_cache_window_attention,
    recall_errors,
    recall_scores_naive,
    ring_attention_weights,
    window_attention_scores,
)
from dofla.ops.window.step import RingWindow, ring_window_step, sink_seen_keys, window_scores

RECALL_OPTIONS = {"recall_cache": "error", "heavy_hitters": "attention"}  # option: the score it keeps by


def recall_budget(cell, options: dict) -> int:
    """The ``recall_cache`` and ``heavy_hitters`` options checked, each a whole number of slots per state
    head (0: none): the cache's slots in all."""
    total = 0
    for name in RECALL_OPTIONS:
        budget = options.get(name, 0)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise DoflaError(
                f"layer {cell.layer_index}: {name} is the number of tokens kept per head beside the window, "
                f"a whole number >= 1 (0: none); got {budget!r}."
            )
        if budget and cell.kind != "hybrid":
            raise DoflaError(
                f"layer {cell.layer_index}: {name} reads in the window's softmax; it needs kind hybrid."
            )
        total += budget
    if total and options.get("short_conv", 0):
        raise DoflaError(
            f"layer {cell.layer_index}: the recall cache scores the tokens leaving the window by the memory "
            "and window as they stand without a convolution; use it without short_conv."
        )
    return int(total)


def recall_kinds(options: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The scores a (checked) cache keeps tokens by, ``"error"`` and/or ``"attention"``, and the slots of
    each, in that order; empty without a cache."""
    chosen = [(kind, int(options.get(name, 0))) for name, kind in RECALL_OPTIONS.items()]
    chosen = [(kind, budget) for kind, budget in chosen if budget]
    return tuple(kind for kind, _ in chosen), tuple(budget for _, budget in chosen)


def check_recall_cache_run(
    slots: int, cell: str, kind: str, options: dict, position_period: int | None
) -> None:
    """The settings of a run with a recall cache, before any work: switched on after training
    (``--recall-cache slots``), a gated_delta hybrid without short_conv and without the cell option (which
    trains with the cache); either way without a position period."""
    trained_with = any(options.get(name) for name in RECALL_OPTIONS)  # the cell options train with the cache
    if trained_with and position_period:
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
    if trained_with:
        raise DoflaError(
            "--recall-cache switches the cache on after training and the cell options recall_cache and "
            "heavy_hitters train with it; give one of the two."
        )
    if options.get("short_conv"):
        raise DoflaError("--recall-cache scores tokens by the memory's recall; use it without short_conv.")
    if position_period:
        raise DoflaError(
            f"the recall cache reads the true positions, and this run sets --position-period {position_period}; "
            "drop it (or set 0) with --recall-cache."
        )


def switch_on_recall_cache(model, slots: int, heavy_hitters: int = 0) -> list[int]:
    """Give every converted layer of ``model`` (each a gated_delta hybrid, trained without the cache) a recall
    cache of ``slots`` tokens per state head its memory recalls worst and ``heavy_hitters`` that drew the most
    attention (either may be 0, not both), recorded in the model's plan (saved with it). Returns the layers.
    Refused with one sentence for a model whose layers cannot take it or that reads wrapped positions (a
    position period)."""
    from dofla.models.surgery import students

    for number in (slots, heavy_hitters):
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise DoflaError(f"the recall cache keeps a whole number of tokens per head; got {number!r}.")
    if not slots + heavy_hitters:
        raise DoflaError(
            f"the recall cache keeps a whole number >= 1 of tokens per head; got {slots!r} and {heavy_hitters!r}."
        )
    wanted = {"recall_cache": slots, "heavy_hitters": heavy_hitters}
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
        recall_budget(student, {**student.cell_options, **wanted})  # hybrid, no short_conv
    for index, student in layers.items():
        student.cell_options.update(wanted)
        student.recall_budget = slots + heavy_hitters
        student.recall_kinds, student.recall_budgets = recall_kinds(wanted)
        plan.layers[index].options = {**plan.layers[index].options, **wanted}
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
    kinds, budgets = cell.recall_kinds, cell.recall_budgets
    by_attention = "attention" in kinds
    if form == "naive":
        if inputs.sink_query is not None:
            raise DoflaError(
                "the recall cache's naive form scores the sinks with the query itself; use chunked."
            )
        columns = []
        if "error" in kinds:
            columns.append(
                recall_scores_naive(
                    memory_keys, values, log_decay, beta, window=cell.window, sinks=cell.sinks
                )
            )
        if by_attention:
            _, window_lse, _ = window_part(cell, form, inputs, None, return_lse=True)
            columns.append(
                attention_scores_naive(
                    query,
                    keys,
                    window_lse,
                    scaling=scaling,
                    window=cell.window,
                    sinks=cell.sinks,
                    softcap=cell.softcap,
                )
            )
        out, lse = recall_cache_window_attention(
            query,
            keys,
            values,
            torch.stack(columns, dim=-1),
            scaling=scaling,
            window=cell.window,
            sinks=cell.sinks,
            budget=budget,
            softcap=cell.softcap,
            return_lse=True,
            budgets=budgets,
        )
        return out, lse, None, None
    window, window_lse, new_window = window_part(cell, form, inputs, window_state, return_lse=True)
    leaving_key, leaving_value, positions, valid = leaving_tokens(
        keys, values, window_state, cell.window, cell.sinks
    )
    if cache is None:
        window_sums = cell.window if by_attention else None
        cache = RecallCache.empty(keys, values, budget, window_sums, kinds=len(kinds))
    columns, sums = [], None
    if "error" in kinds:
        written = DeltaInputs(None, memory_keys, values, log_decay, beta)  # what the memory writes
        columns.append(
            memory_recall_scores(cell, form, leaving_key, leaving_value, valid, written, memory_state)
        )
    if by_attention:
        with torch.no_grad():  # the score only selects
            seen = (
                keys if window_state is None else torch.cat([window_state.keys.to(keys.dtype), keys], dim=2)
            )
            scores, sums = window_attention_scores(
                query,
                seen,
                window_lse,
                cache.attention,
                0 if window_state is None else window_state.num_tokens,
                scaling=scaling,
                window=cell.window,
                sinks=cell.sinks,
                softcap=cell.softcap,
            )
        columns.append(scores)
    kept, kept_lse, cache = recall_cache_attention(
        query,
        leaving_key,
        leaving_value,
        torch.stack(columns, dim=-1),
        positions,
        cache,
        scaling=scaling,
        softcap=cell.softcap,
        chunk_size=1 if form == "recurrent" else 64,
        budgets=budgets,
    )
    out, lse = merge_softmax_parts(window.to(kept.dtype), window_lse.to(kept.dtype), kept, kept_lse)
    return out, lse, new_window, replace(cache, attention=sums)


def memory_recall_scores(
    cell, form, leaving_key, leaving_value, valid, written: DeltaInputs, memory_state
) -> Tensor:
    """Each step's leaving token scored by the memory's recall error (option ``recall_cache``), with
    the memory as it stands after the step: leaving_key (B, Hs, T, D), leaving_value (B, Hs, T, Dv) and
    valid (T,) from ``leaving_tokens``; written the call's memory inputs (its queries unused) -> (B, Hs, T)
    float32, -inf where none leaves."""
    with torch.no_grad():  # the score only selects
        features, _ = cell.feature_map(leaving_key, is_query=False)
        reads = F.normalize(features, dim=-1)
        read_inputs = replace(written, q=reads)
        if form == "recurrent":
            recalled, _ = recurrent_gated_delta_rule(read_inputs, state=memory_state)
        else:
            recalled = chunked_gated_delta_rule(
                read_inputs,
                chunk_size=cell.chunk_size_for("delta", reads.shape[2]),
                initial_state=memory_state,
            )
        return recall_errors(recalled, leaving_value, valid)


def window_step_with_recall_cache(
    cell, ring_inputs: tuple, memory: Tensor, cache: RecallCache, *, return_lse: bool = False, **ring_options
) -> tuple[Tensor, Tensor | None, RingWindow, RecallCache]:
    """One decoding token of :func:`window_with_recall_cache`: ring_inputs the window's ring step's (the ring
    before the token, queries (B, Hs, G, D), key (B, Hs, D), values (B, Hs, Dv)), memory (B, Hs, K, Dv) the
    memory after the token, cache the recall cache before it. The token leaving the window (the ring's next
    slot, before the step writes over it) is scored as the chunked form scores it (the memory's recall of
    it, or the attention it drew in the window) and joins the cache (``insert_recall_candidate``). Returns
    out (B, Hs, G, Dv) of one softmax over window, sinks and cache, its log-sum-exp (B, Hs, G) with
    ``return_lse`` (else None), the ring and the cache after the token. Sinks seen from the window's edge
    only as turned keys (``sink_key_turn``)."""
    ring = ring_inputs[0]
    by_attention = "attention" in cell.recall_kinds
    tokens = ring.num_tokens
    position = tokens - cell.window  # the token the query no longer sees in the window
    if position >= cell.sinks:  # none before the window is full; sinks never leave
        slot = ring.next_slot
        key = ring.keys[:, :, slot].clone()  # the ring step writes over the slot in place
        value = ring.values[:, :, slot, : ring.value_dim].clone()
        columns = []
        with torch.no_grad():  # the scores only select
            if "error" in cell.recall_kinds:
                features, _ = cell.feature_map(key[:, :, None], is_query=False)
                reads = F.normalize(features, dim=-1).to(memory.dtype)  # (B, Hs, 1, K)
                valid = torch.ones(1, dtype=torch.bool, device=key.device)
                columns.append(recall_errors(reads @ memory, value[:, :, None], valid)[:, :, 0])  # (B, Hs)
            if by_attention:  # every query that saw it has run
                columns.append(cache.attention[:, :, tokens % cell.window])
        score = torch.stack(columns, dim=-1)  # (B, Hs, S)
        cache = insert_recall_candidate(cache, key, value, score, position, cell.recall_budgets)
    kept = torch.isfinite(cache.scores[..., 0])
    extra = (cache.keys, cache.values, kept)  # read in the window's own softmax
    if return_lse:
        out, lse, ring = ring_window_step(*ring_inputs, return_lse=True, extra=extra, **ring_options)
    else:
        (out, ring), lse = ring_window_step(*ring_inputs, extra=extra, **ring_options), None
    if by_attention:  # the new token's sum starts in the slot the leaving one held
        with torch.no_grad():
            queries = ring_inputs[1]
            keys = sink_seen_keys(ring, ring_options.get("sink_key_turn"))
            scores = window_scores(ring, queries, ring_options["scaling"], keys=keys)  # (B * Hs, G, S + W)
            weights = ring_attention_weights(scores, ring.sinks).view_as(cache.attention)
            sums = cache.attention.clone()
            sums[:, :, tokens % cell.window] = 0.0
            cache = replace(cache, attention=sums + weights)
    return out, lse, ring, cache
