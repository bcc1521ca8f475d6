"""What a run checks once the teacher is loaded, before the expensive work: its tokenizer, the LoRA targets,
the rotary embedding a position period wraps or edge sinks turn, and whether the training fits in memory."""

from __future__ import annotations

import torch

from dofla.errors import DoflaError
from dofla.io import check_free_space
from dofla.run_config import LinearizeConfig
from dofla.run_data import lora_seq_len, recall_gap


def check_teacher_for_run(config: LinearizeConfig, teacher, tokenizer, sequences) -> None:
    """What needs the loaded teacher but not the expensive work: its tokenizer, the LoRA targets, the
    rotary embedding a given position period wraps or edge sinks turn."""
    from dofla.distill.lora import check_targets

    if sequences is None and tokenizer is None:
        raise DoflaError(
            f"the teacher {config.teacher.model} has no usable tokenizer, which reading --data or sampling text "
            "needs; add its tokenizer files to the model folder."
        )
    if config.lora.enabled:
        check_targets(teacher, config.lora.targets)
    check_memory_for_run(config, teacher)
    check_recall_cache_size(config, teacher)
    # the saved model holds the teacher's weights: refused now if the disk has no room, not after training
    size = sum(parameter.numel() * parameter.element_size() for parameter in teacher.parameters())
    check_free_space(config.out_dir, size, "the converted model this run saves")
    if config.plan.position_period:  # given: the teacher must have the one rotary embedding it wraps
        from dofla.rotary import rotary_frequencies

        if rotary_frequencies(teacher) is None:
            raise DoflaError(
                f"--position-period wraps rotary positions, and the teacher {config.teacher.model} has none; "
                "leave it unset."
            )
    if config.evaluate.edge_sinks or config.plan.sinks_at_edge:
        from dofla.evaluation.window_baseline import check_edge_sinks

        check_edge_sinks(teacher)
    if config.lora.enabled and config.lora.needle_fraction > 0:
        if tokenizer is None:
            raise DoflaError(
                "--lora-needles writes its facts as text, which needs the teacher's tokenizer; give a teacher "
                "with tokenizer files or leave --lora-needles at 0."
            )
        from dofla.data import insert_needles

        probe = torch.zeros(1, lora_seq_len(config), dtype=torch.long)  # are the rows long enough for them
        insert_needles(probe, tokenizer, 1.0, gap=recall_gap(config), seed=config.seed)


def activation_bytes_per_token(model) -> int:
    """What a training forward keeps per token for the backward pass, roughly: per layer eight hidden-sized
    and four feed-forward-sized vectors (norms, q/k/v/o, residuals; gate, up, activation, product), in the
    model's dtype."""
    text = model.config.get_text_config(decoder=True)
    hidden = int(text.hidden_size)
    feed_forward = int(
        getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    )
    element = next(model.parameters()).element_size()
    return int(text.num_hidden_layers) * (8 * hidden + 4 * feed_forward) * element


def check_memory_for_run(config: LinearizeConfig, model) -> None:
    """Refuse, before any data is read, a run whose largest needs beyond the loaded teacher do not fit in the
    memory free on its device: a copy of the teacher (the side-by-side evaluation's reference) and the
    LoRA stage's activations for ``lora.tokens_per_forward`` tokens (its vocabulary-wide tensors are made
    in pieces sized to the free memory). One sentence with the estimate and the settings that fit."""
    from dofla.evaluation.logits import available_memory_bytes

    device = next(model.parameters()).device
    free = available_memory_bytes(device)
    if free is None:
        return
    check_step_memory(config, model, free, device)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    per_token = activation_bytes_per_token(model)
    length = lora_seq_len(config)
    rows = max(1, config.lora.tokens_per_forward // length) if config.lora.enabled else 0
    activations = rows * length * per_token
    if weights + activations <= free:
        return
    gib = 2.0**30
    need = f"about {(weights + activations) / gib:.1f} GiB beyond the loaded teacher (a copy of it for the "
    need += f"side-by-side evaluation, {weights / gib:.1f} GiB"
    if activations:
        need += f"; the LoRA stage's activations for {rows} x {length} tokens per forward, {activations / gib:.1f} GiB"
    fits = int((free - weights) // (per_token * length)) if free > weights else 0
    advice = (
        f"pass --lora-tokens-per-forward {fits * length} (the same steps, in more pieces)"
        if config.lora.enabled and fits >= 1
        else "give a smaller teacher dtype (--dtype bfloat16), a shorter --lora-seq-len, or a machine with more memory"
    )
    raise DoflaError(f"this run needs {need}) and {free / gib:.1f} GiB are free on {device}; {advice}.")


def check_step_memory(config: LinearizeConfig, model, free: int, device) -> None:
    """Refuse a distillation step that cannot fit: its hidden states alone (the embeddings' output and one
    layer's, alive together in any forward) for ``distill.batch_size`` x ``data.seq_len`` tokens (a
    process's share of the batch under data sharding), a bound below what the step needs."""
    from dofla.distill import distributed

    processes = distributed.rank_and_world_size()[1]
    rows = config.distill.batch_size
    if config.distill.sharding == "data":
        rows = -(-rows // processes)
    hidden = int(model.config.get_text_config(decoder=True).hidden_size)
    need = 2 * rows * config.data.seq_len * hidden * next(model.parameters()).element_size()
    if need > free:
        gib = 2.0**30
        fits = free // (2 * config.data.seq_len * hidden * next(model.parameters()).element_size())
        raise DoflaError(
            f"one distillation step of --batch-size {config.distill.batch_size} x --seq-len {config.data.seq_len} "
            f"tokens needs more than {need / gib:.1f} GiB for its hidden states alone and {free / gib:.1f} GiB "
            f"are free on {device}; pass --batch-size {max(1, fits // 2)} or less."
        )


def check_recall_cache_size(config: LinearizeConfig, model) -> None:
    """Refuse a recall cache (``--recall-cache``, or the cell options ``recall_cache`` and ``heavy_hitters``,
    whose slots add up) that keeps more tokens per head than the teacher's context: its keys and values are
    allocated whole for every sequence."""
    from dofla.cells.recall_cache import RECALL_OPTIONS
    from dofla.data import context_length

    limit = context_length(model)
    options = config.student.cell_options
    given = {name: options[name] for name in RECALL_OPTIONS if isinstance(options.get(name), int | float)}
    in_cell = ("the cell option " if len(given) == 1 else "the cell options ") + " + ".join(given)
    for name, slots in (("--recall-cache", config.student.recall_cache), (in_cell, sum(given.values()))):
        if limit is not None and isinstance(slots, int | float) and slots > limit:
            raise DoflaError(
                f"{name} {slots} keeps more tokens per head than the teacher's context of {limit} tokens; use "
                f"at most {limit}."
            )
