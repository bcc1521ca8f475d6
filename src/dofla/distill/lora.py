"""Stage 2 (LoLCATs): LoRA on the attention projections with next-token loss, merged into the weights.

After the attention transfer the whole converted model is fine-tuned end to end with low-rank adapters
(``peft``; default rank 8, alpha 16, on the q/k/v/o projections of each family) on next-token
cross-entropy, optionally plus KL to the teacher's logits (the teacher is the same model with its
converted layers running softmax, under :func:`dofla.dispatch.teacher_forced`). The students stay frozen,
unless ``train_students`` (``--lora-train-students``): then their own parameters (feature maps, gates,
mixes: each cell's AdamW groups, relative to the LoRA learning rate) train end to end beside the adapters,
on the model's own next-token loss, which layer-wise attention transfer never sees.
The adapters are merged into the projection weights at the end, so the exported model has no peft parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dofla import dispatch
from dofla.distill.losses import direct_loss
from dofla.distill.nonfinite import NonFinitePolicy, first_nonfinite_layer, first_nonfinite_output_layer
from dofla.distill.teacher_forcing import autocast_for
from dofla.distill.trainer import batch_indices, learning_rate_factor
from dofla.errors import DoflaError


@dataclass
class LoraConfig:
    """rank, alpha, targets (module name suffixes; None = the family's q/k/v/o projections), token budget,
    learning rate (AdamW, warm-up + cosine as in the first stage), KL weight to the teacher's logits.

    ``tokens_per_forward``: a batch goes through the model in pieces of whole sequences holding at most
    this many tokens (at least one sequence), their gradients summed before the step: the same update as
    one forward of the batch, with the activation memory of one piece (a whole model's backward holds
    several megabytes per token on a CPU, mostly the vocabulary-sized logits and their softmaxes).
    """

    rank: int = 8
    alpha: int = 16
    targets: list[str] | None = None
    tokens: int = 200_000
    batch_size: int = 4
    lr: float = 1e-3
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    grad_clip: float = 1.0
    kl_weight: float = 0.0
    temperature: float = 1.0
    seed: int = 0
    progress: bool = True
    max_bad_steps: int = 5
    tokens_per_forward: int = 2048
    train_students: bool = False

    def validate(self) -> None:
        """Every option's range, checked before any work (the targets need the model: :func:`check_targets`)."""
        if self.rank < 1:
            raise DoflaError(f"--lora-rank must be at least 1, got {self.rank}.")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise DoflaError(f"--lora-alpha must be positive, got {self.alpha}.")
        if self.tokens <= 0:
            raise DoflaError(
                f"the LoRA token budget must be positive, got {self.tokens}; pass e.g. --lora-tokens 200k."
            )
        if self.batch_size <= 0:
            raise DoflaError(f"batch size must be positive, got {self.batch_size}; pass e.g. --batch-size 4.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise DoflaError(f"--lora-lr must be a positive number, got {self.lr}; pass e.g. --lora-lr 1e-3.")
        if not (math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise DoflaError(f"--lora-kl must be zero or positive, got {self.kl_weight}.")
        if self.targets is not None and not all(
            isinstance(name, str) and name.strip() for name in self.targets
        ):
            raise DoflaError(f"--lora-targets must be comma-separated module names, got {self.targets}.")
        if self.tokens_per_forward < 1:
            raise DoflaError(
                f"--lora-tokens-per-forward must be at least 1, got {self.tokens_per_forward}; pass e.g. 2048."
            )
        if self.max_bad_steps < 1:
            raise DoflaError(f"max_bad_steps must be at least 1, got {self.max_bad_steps}.")


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
    model: nn.Module, train: torch.Tensor, config: LoraConfig, *, merge: bool = True
) -> tuple[nn.Module, LoraResult]:
    """Fine-tune ``model`` (converted) with LoRA on next-token loss over train (N, T); returns the model
    with the adapters merged into its weights (same object, students attached) and the training record.
    ``merge=False`` returns the peft model instead (merge later with :func:`merge_lora`).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from tqdm import tqdm

    config.validate()
    targets = check_targets(model, config.targets)
    student_groups = _student_groups(model, config) if config.train_students else []
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    plan = getattr(model, "dofla_plan", None)
    peft_model = get_peft_model(
        model,
        PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=targets, lora_dropout=0.0),
    )
    adapters = [parameter for parameter in peft_model.parameters() if parameter.requires_grad]
    if not adapters:
        raise DoflaError(f"LoRA found no modules named {targets}; check --lora-targets.")
    for group in student_groups:
        for parameter in group["params"]:
            parameter.requires_grad_(True)
    trainable = adapters + [parameter for group in student_groups for parameter in group["params"]]
    optimizer = torch.optim.AdamW(
        [{"params": adapters, "lr": config.lr}, *student_groups], lr=config.lr, weight_decay=0.0
    )
    base_rates = [group["lr"] for group in optimizer.param_groups]
    device = next(model.parameters()).device
    total_steps = math.ceil(config.tokens / (config.batch_size * train.shape[1]))
    per_forward = max(1, config.tokens_per_forward // train.shape[1])  # sequences per forward
    schedule = _Schedule(config.warmup_fraction, config.min_lr_fraction)
    torch.manual_seed(config.seed)
    history = []
    policy = NonFinitePolicy("LoRA", config.max_bad_steps, "lower --lora-lr")
    named_trainable = [
        (name, parameter) for name, parameter in peft_model.named_parameters() if parameter.requires_grad
    ]
    peft_model.eval()
    for step in tqdm(range(total_steps), disable=not config.progress, unit="step", desc="lora"):
        factor = learning_rate_factor(step, total_steps, schedule) * policy.lr_scale
        for group, base_rate in zip(optimizer.param_groups, base_rates, strict=True):
            group["lr"] = base_rate * factor
        batch = train[batch_indices(step, config.batch_size, len(train), config.seed)].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = sum(
            _piece_loss_backward(peft_model, piece, config, share=len(piece) / len(batch))
            for piece in batch.split(per_forward)
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)

        def bad_layer(batch=batch) -> int | None:
            layer = first_nonfinite_layer(named_trainable)  # an adapter gone non-finite, else the first
            return layer if layer is not None else first_nonfinite_output_layer(peft_model, batch)

        if policy.accept(step + 1, float(loss.detach()), float(grad_norm), bad_layer):
            optimizer.step()
        history.append(dict(stage="lora", step=step + 1, loss=float(loss.detach())))
    tokens = total_steps * config.batch_size * train.shape[1]
    result = LoraResult(steps=total_steps, tokens=tokens, history=history)
    return (merge_lora(peft_model, plan) if merge else peft_model), result


def _student_groups(model: nn.Module, config: LoraConfig) -> list[dict]:
    """The converted layers' AdamW groups at the LoRA learning rate (taken before LoRA freezes everything, so
    parameters a cell keeps fixed stay fixed); one sentence if there is nothing to train."""
    from dofla.convert import students

    groups = [
        dict(group, params=[parameter for parameter in group["params"] if parameter.requires_grad])
        for student in students(model).values()
        for group in student.parameter_groups(config.lr)
    ]
    groups = [group for group in groups if group["params"]]
    if not groups:
        raise DoflaError(
            "--lora-train-students: the model's converted layers have no trainable parameters; leave the "
            "flag off."
        )
    return groups


def _piece_loss_backward(peft_model: nn.Module, piece: torch.Tensor, config: LoraConfig, share: float):
    """Forward and backward of one piece (n, T) of a batch, its loss weighted by its ``share`` of the
    batch's sequences (every row has T tokens, so the weighted sum is the batch's mean loss)."""
    teacher_logits = None
    if config.kl_weight > 0:
        with torch.no_grad(), dispatch.teacher_forced(), peft_model.disable_adapter():
            teacher_logits = peft_model(input_ids=piece, use_cache=False).logits
    with autocast_for(piece.device):
        logits = peft_model(input_ids=piece, use_cache=False).logits
        loss = share * direct_loss(
            logits, piece, teacher_logits, kl_weight=config.kl_weight, temperature=config.temperature
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


@dataclass
class _Schedule:
    warmup_fraction: float
    min_lr_fraction: float
