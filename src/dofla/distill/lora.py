"""Stage 2 (LoLCATs): LoRA on the attention projections with next-token loss, merged into the weights.

After the attention transfer the whole converted model is fine-tuned end to end with low-rank adapters
(``peft``; default rank 8, alpha 16, on the q/k/v/o projections of each family) on next-token
cross-entropy, optionally plus KL to the teacher's logits (the teacher is the same model with its
converted layers running softmax, under :func:`dofla.dispatch.teacher_forced`). The students stay frozen,
unless ``train_students`` (``--lora-train-students``): then their own parameters (feature maps, gates,
mixes: each cell's AdamW groups, relative to the LoRA learning rate) train end to end beside the adapters,
on the model's own next-token loss, which layer-wise attention transfer never sees.
The adapters are merged into the projection weights at the end, so the exported model has no peft parts.
Given a ``run_dir`` the stage logs every step and writes a checkpoint every ``checkpoint_every`` steps
(adapters, the trained students' parameters, AdamW state; :mod:`dofla.distill.checkpoint`), so a killed
stage continues where it stopped with ``resume`` instead of starting over.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dofla import dispatch
from dofla.distill.checkpoint import (
    append_log,
    latest_checkpoint,
    restore_training_state,
    save_training_state,
    settings_digest,
    write_log,
)
from dofla.distill.losses import direct_loss_in_pieces
from dofla.distill.nonfinite import NonFinitePolicy, first_nonfinite_layer, first_nonfinite_output_layer
from dofla.distill.trainer import CHECKPOINT_FOLDER, LOG_FILE, batch_indices, learning_rate_factor
from dofla.errors import DoflaError
from dofla.evaluation.logits import final_hidden_states, output_logits, rows_per_piece, vocabulary_size
from dofla.models.surgery import autocast_for
from dofla.run_config import LinearizeConfig
from dofla.settings import LoraSettings

# settings that change neither the updates nor their order (a resumed stage may set them otherwise), or that
# the pipeline reads (which rows, whether the stage runs)
_NOT_IN_FINGERPRINT = ("tokens_per_forward", "enabled", "needle_fraction", "seq_len", "baseline")


@dataclass
class LoraResult:
    steps: int
    tokens: int
    history: list[dict] = field(default_factory=list)


def attention_projection_names(model: nn.Module) -> list[str]:
    """The q/k/v/o projection module names of this model's family (``dofla.models.FAMILIES``; only those
    that exist in it)."""
    from dofla.models import get_adapter

    adapter = get_adapter(model)
    names = list(adapter.family.lora_targets)
    present = {
        name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Module)
    }
    found = [name for name in names if name in present]
    if not found:
        raise DoflaError(
            f"no attention projections named {names} in this {adapter.model_type} model; pass --lora-targets."
        )
    return found


def check_targets(model: nn.Module, targets: list[str] | None) -> list[str]:
    """The LoRA target module names for ``model``: ``targets`` if every one names a Linear layer in it
    (refused otherwise, with the names it has), or the family's q/k/v/o projections when None."""
    if not targets:
        return attention_projection_names(model)
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    )
    unknown = [name for name in targets if name not in linear]
    if unknown:
        raise DoflaError(
            f"--lora-targets names {', '.join(unknown)}, which this model has no linear layer called; "
            f"its linear layers are {', '.join(linear)}."
        )
    return list(targets)


def train_lora(
    model: nn.Module,
    train: torch.Tensor,
    config: LinearizeConfig,
    *,
    merge: bool = True,
    run_dir: str | Path | None = None,
    resume: bool = False,
) -> tuple[nn.Module, LoraResult]:
    """Fine-tune ``model`` (converted) with LoRA on next-token loss over train (N, T); returns the model
    with the adapters merged into its weights (same object, students attached) and the training record.
    ``merge=False`` returns the peft model instead (merge later with :func:`merge_lora`). The settings are
    ``config.lora``, with the ``distill`` section's batch size and checkpoint interval and the run's seed.
    run_dir: where the stage writes ``log.jsonl`` and ``checkpoints/`` (None: nothing is written); with
    ``resume`` it continues from the newest checkpoint there, which must come from the same settings,
    students and data (it starts from step 0 where there is none).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from tqdm import tqdm

    settings, batch_size = config.lora, config.distill.batch_size
    settings.validate()
    targets = check_targets(model, settings.targets)
    fingerprint = lora_fingerprint(config, model, train) if run_dir is not None else None
    student_groups = _student_groups(model, settings) if settings.train_students else []
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    plan = getattr(model, "dofla_plan", None)
    peft_model = get_peft_model(
        model,
        PeftLoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=targets, lora_dropout=0.0),
    )
    adapters = [parameter for parameter in peft_model.parameters() if parameter.requires_grad]
    if not adapters:
        raise DoflaError(f"LoRA found no modules named {targets}; check --lora-targets.")
    for group in student_groups:
        for parameter in group["params"]:
            parameter.requires_grad_(True)
    trainable = adapters + [parameter for group in student_groups for parameter in group["params"]]
    optimizer = torch.optim.AdamW(
        [{"params": adapters, "lr": settings.lr}, *student_groups], lr=settings.lr, weight_decay=0.0
    )
    base_rates = [group["lr"] for group in optimizer.param_groups]
    device = next(model.parameters()).device
    total_steps = math.ceil(settings.tokens / (batch_size * train.shape[1]))
    per_forward = max(1, settings.tokens_per_forward // train.shape[1])  # sequences per forward
    torch.manual_seed(config.seed)
    history = []
    policy = NonFinitePolicy("LoRA", settings.max_bad_steps, "lower --lora-lr")
    named_trainable = [
        (name, parameter) for name, parameter in peft_model.named_parameters() if parameter.requires_grad
    ]
    peft_model.eval()
    run = _StageFiles(run_dir, fingerprint)
    start = run.resume(named_trainable, optimizer, policy) if resume else None
    if start is not None:
        start_step, history = start
    else:
        start_step = 0
        run.start()
    for step in tqdm(
        range(start_step, total_steps),
        initial=start_step,
        total=total_steps,
        disable=not config.progress,
        unit="step",
        desc="lora",
    ):
        factor = learning_rate_factor(step, total_steps, settings) * policy.lr_scale
        for group, base_rate in zip(optimizer.param_groups, base_rates, strict=True):
            group["lr"] = base_rate * factor
        batch = train[batch_indices(step, batch_size, len(train), config.seed)].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = sum(
            piece_loss_backward(peft_model, piece, settings, share=len(piece) / len(batch))
            for piece in batch.split(per_forward)
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, settings.grad_clip)

        def bad_layer(batch=batch) -> int | None:
            layer = first_nonfinite_layer(named_trainable)  # an adapter gone non-finite, else the first
            return layer if layer is not None else first_nonfinite_output_layer(peft_model, batch)

        if policy.accept(step + 1, float(loss.detach()), float(grad_norm), bad_layer):
            optimizer.step()
        record = dict(stage="lora", step=step + 1, loss=float(loss.detach()))
        history.append(record)
        run.log(record)
        if step + 1 == total_steps or (
            config.distill.checkpoint_every and (step + 1) % config.distill.checkpoint_every == 0
        ):
            run.save(step + 1, named_trainable, optimizer, policy, history)
    tokens = total_steps * batch_size * train.shape[1]
    result = LoraResult(steps=total_steps, tokens=tokens, history=history)
    return (merge_lora(peft_model, plan) if merge else peft_model), result


def lora_fingerprint(config: LinearizeConfig, model: nn.Module, train: torch.Tensor) -> str:
    """A hash of what determines the stage's result: its settings, the plan, the converted layers' weights
    as the stage starts (what attention transfer left) and the training rows."""
    from dofla.models.surgery import students

    settings = {name: value for name, value in asdict(config.lora).items() if name not in _NOT_IN_FINGERPRINT}
    settings.update(batch_size=config.distill.batch_size, seed=config.seed)
    digest = settings_digest(settings, getattr(model, "dofla_plan", None))
    for index, student in sorted(students(model).items()):
        for name, tensor in student.state_dict().items():
            digest.update(f"{index}.{name} {tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().to("cpu", torch.float64).numpy().tobytes())
    digest.update(f"{tuple(train.shape)}".encode())
    digest.update(train.to(torch.int64).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class _StageFiles:
    """The LoRA stage's log and checkpoints in ``run_dir`` (or nothing, where it is None)."""

    def __init__(self, run_dir: str | Path | None, fingerprint: str | None) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.fingerprint = fingerprint

    @property
    def checkpoints(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / CHECKPOINT_FOLDER

    def start(self) -> None:
        """A new stage: an empty log."""
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_log(self.run_dir / LOG_FILE, [])

    def resume(self, named_trainable, optimizer, policy) -> tuple[int, list[dict]] | None:
        """Load the newest checkpoint into the trainable parameters, optimizer and policy: (its step, the
        history so far); None where there is none (the stage starts over)."""
        latest = None if self.checkpoints is None else latest_checkpoint(self.checkpoints)
        if latest is None:
            return None
        _, state = restore_training_state(
            latest,
            dict(named_trainable),
            optimizer,
            policy,
            fingerprint=self.fingerprint,
            foreign=f"the LoRA checkpoint in {self.checkpoints} belongs to other LoRA settings, students or "
            f"data; use the interrupted run's settings, or remove {self.run_dir} to run the LoRA stage again "
            "from the attention-transfer checkpoint.",
            damaged=f"remove {self.run_dir} to run the LoRA stage again.",
        )
        history = list(state["history"])
        write_log(self.run_dir / LOG_FILE, history)
        return int(state["step"]), history

    def log(self, record: dict) -> None:
        if self.run_dir is not None:
            append_log(self.run_dir / LOG_FILE, record)

    def save(self, step: int, named_trainable, optimizer, policy, history: list[dict]) -> None:
        """A checkpoint of step ``step``; none while a parameter is not finite (the previous one stays)."""
        if self.checkpoints is not None:
            save_training_state(
                self.checkpoints,
                step,
                dict(named_trainable),
                optimizer,
                policy,
                dict(fingerprint=self.fingerprint, history=history),
                nonfinite_warning=f"LoRA step {step}: a trained parameter holds NaN/inf values; this "
                "checkpoint is not saved.",
            )


def _student_groups(model: nn.Module, settings: LoraSettings) -> list[dict]:
    """The converted layers' AdamW groups at the LoRA learning rate (taken before LoRA freezes everything, so
    parameters a cell keeps fixed stay fixed); one sentence if there is nothing to train."""
    from dofla.models.surgery import students

    groups = [
        dict(group, params=[parameter for parameter in group["params"] if parameter.requires_grad])
        for student in students(model).values()
        for group in student.parameter_groups(settings.lr)
    ]
    groups = [group for group in groups if group["params"]]
    if not groups:
        raise DoflaError(
            "--lora-train-students: the model's converted layers have no trainable parameters; leave the "
            "flag off."
        )
    return groups


LOGIT_COPIES = 4  # (rows, V) float32 tensors alive in a piece: logits, two log-softmaxes, a gradient


def piece_loss_backward(peft_model: nn.Module, piece: torch.Tensor, settings: LoraSettings, share: float):
    """Forward and backward of one piece (n, T) of a batch, its loss weighted by its ``share`` of the
    batch's sequences (every row has T tokens, so the weighted sum is the batch's mean loss). The output
    head runs a few positions at a time (:func:`~dofla.distill.losses.direct_loss_in_pieces`, pieces sized
    from the vocabulary and the free memory): no (n, T, V) logits are held."""
    causal_lm = peft_model.get_base_model()  # the adapters sit in its modules
    teacher_hidden = None
    if settings.kl_weight > 0:
        with torch.no_grad(), dispatch.teacher_forced(), peft_model.disable_adapter():
            teacher_hidden = final_hidden_states(causal_lm, piece)  # (n, T, E)
    rows = rows_per_piece(vocabulary_size(causal_lm), LOGIT_COPIES, piece.device)
    with autocast_for(piece.device):
        hidden = final_hidden_states(causal_lm, piece)  # (n, T, E)
        loss = share * direct_loss_in_pieces(
            lambda states: output_logits(causal_lm, states),
            hidden,
            piece,
            teacher_hidden,
            rows_per_piece=rows,
            kl_weight=settings.kl_weight,
            temperature=settings.temperature,
        )
    loss.backward()
    return loss.detach()


def merge_lora(peft_model: nn.Module, plan=None) -> nn.Module:
    """Fold the adapters into the projection weights; returns the plain (converted) model, all frozen."""
    plan = plan if plan is not None else getattr(peft_model.get_base_model(), "dofla_plan", None)
    merged = peft_model.merge_and_unload()
    merged.dofla_plan = plan
    for parameter in merged.parameters():
        parameter.requires_grad_(False)
    return merged
