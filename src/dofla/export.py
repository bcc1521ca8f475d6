"""Export a converted model to a standard ``qwen3_5_text`` checkpoint that runs without dofla.

A converted model whose every layer is the ``gated_delta_net`` cell (:mod:`dofla.cells.gated_delta_net`,
exactly transformers' ``Qwen3_5GatedDeltaNet``), on a teacher whose blocks are Llama's (pre-norm RMSNorm,
the token mixer, RMSNorm, gated SiLU MLP, no biases; Llama, Qwen2, Qwen3 and Mistral teachers), is a
``Qwen3_5ForCausalLM`` with ``layer_types`` all ``linear_attention``: its weights map one to one, except
that Qwen3.5's RMSNorm multiplies by ``1 + weight`` where Llama's multiplies by ``weight`` (the exported
norm weights are the teacher's minus 1) and the layer's ``out_proj`` is the teacher's ``o_proj``.

By default the checkpoint ends with one more layer, a ``full_attention`` layer (one query and one key-value
head) whose every weight is zero: it adds exact zeros to the residual stream (its attention reads zero
values and its output and MLP projections are zero), so the logits are the converted model's, but it gives
the serving software the one attention layer its Qwen3.5 cache expects: transformers 5.23's
``generate`` then runs with its cache (it refuses a Qwen3.5 model without attention layers) and llama.cpp's
runtime runs the GGUF (it aborts on one without). Its key-value cache holds 2 x head_dim values per token
(the teacher's cache holds 2 x head_dim x key-value heads x layers). ``all_linear=True`` writes the
converted layers alone (``layer_types`` all ``linear_attention``).

The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer's
files: ``AutoModelForCausalLM.from_pretrained`` opens it with transformers alone (its CPU path is pure
PyTorch; on a GPU with flash-linear-attention it runs fla's kernels), and engines that serve Qwen3.5
(vLLM, SGLang, llama.cpp) read the same format.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from dofla.config import ConversionPlan
from dofla.errors import DoflaError
from dofla.loading import load_converted, read_record
from dofla.models import get_adapter
from dofla.saving import check_finite_model

EXPORT_KIND = "exported model"
EXPORTED_CELL = "gated_delta_net"
LLAMA_BLOCKS = ("llama", "qwen2", "qwen3", "mistral")  # teachers whose decoder blocks are Llama's


def plan_differences(plan: ConversionPlan, num_layers: int) -> str | None:
    """What keeps a plan from mapping onto Qwen3.5's linear layers, in one phrase, or None."""
    for index in range(num_layers):
        layer = plan.layers[index] if index < len(plan.layers) else None
        if layer is None or layer.kind == "softmax":
            return f"layer {index} keeps its softmax attention"
        if layer.cell != EXPORTED_CELL:
            return f"layer {index} is the {layer.cell} cell, not {EXPORTED_CELL}"
        if layer.kind != "linear":
            return f"layer {index} has a sliding window"
    return None


def teacher_differences(config) -> str | None:
    """What keeps a teacher's blocks (its config) from being Qwen3.5's, in one phrase, or None."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in LLAMA_BLOCKS:
        return f"the teacher is a {model_type} model, whose blocks are not Llama's"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the teacher's MLP uses {config.hidden_act}, not SiLU"
    if getattr(config, "mlp_bias", False):
        return "the teacher's MLP has biases"
    return None


def model_differences(model: nn.Module) -> str | None:
    """What keeps a loaded converted model from mapping exactly, in one phrase, or None: the module layout
    (RMSNorms, gated MLPs without biases, the output projections without bias)."""
    from dofla.cells.gated_delta_net import GatedDeltaNet

    adapter = get_adapter(model)
    for index, layer in enumerate(adapter.decoder_layers(model)):
        attention = getattr(layer, adapter.family.attention_attribute)
        if not isinstance(getattr(attention, "dofla_student", None), GatedDeltaNet):
            return f"layer {index} is not the {EXPORTED_CELL} cell"
        if getattr(attention.o_proj, "bias", None) is not None:
            return f"layer {index}'s output projection has a bias"
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj", "down_proj"):
            projection = getattr(mlp, name, None)
            if not isinstance(projection, nn.Linear) or projection.bias is not None:
                return f"layer {index}'s MLP is not a gated MLP without biases"
        for name in ("input_layernorm", "post_attention_layernorm"):
            if "RMSNorm" not in type(getattr(layer, name, None)).__name__:
                return f"layer {index}'s {name} is not an RMSNorm"
        if set(dict(layer.named_children())) - {
            "self_attn",
            "mlp",
            "input_layernorm",
            "post_attention_layernorm",
        }:
            return f"layer {index} has modules besides attention, MLP and its two norms"
    if getattr(model.lm_head, "bias", None) is not None:
        return "the output head has a bias"
    return None


def _not_exportable(what: str) -> DoflaError:
    return DoflaError(
        f"this model cannot be exported as a standard Qwen3.5 checkpoint: {what}; export needs every layer "
        f"converted to the {EXPORTED_CELL} cell (recipe `portable`) on a Llama, Qwen2, Qwen3 or Mistral teacher."
    )


def qwen3_5_config(model: nn.Module, *, all_linear: bool = False):
    """The ``Qwen3_5TextConfig`` of a converted model whose layers are all the exported cell: those layers,
    then (unless ``all_linear``) the all-zero identity attention layer (one query and one key-value head)."""
    from transformers import Qwen3_5TextConfig

    from dofla.models.surgery import students

    teacher = model.config.get_text_config(decoder=True)
    cells = students(model)
    first = cells[0]
    layer_types = ["linear_attention"] * len(cells) + ([] if all_linear else ["full_attention"])
    return Qwen3_5TextConfig(
        vocab_size=int(teacher.vocab_size),
        hidden_size=int(teacher.hidden_size),
        intermediate_size=int(teacher.intermediate_size),
        num_hidden_layers=len(layer_types),
        num_attention_heads=first.num_heads if all_linear else 1,
        num_key_value_heads=first.num_kv_heads if all_linear else 1,
        head_dim=first.head_dim,
        full_attention_interval=len(layer_types) + 1 if all_linear else len(layer_types),
        hidden_act="silu",
        max_position_embeddings=int(getattr(teacher, "max_position_embeddings", 2048) or 2048),
        rms_norm_eps=float(teacher.rms_norm_eps),
        tie_word_embeddings=bool(getattr(teacher, "tie_word_embeddings", False)),
        linear_conv_kernel_dim=int(first.conv1d.weight.shape[-1]),
        linear_key_head_dim=first.shape.head_k_dim,
        linear_value_head_dim=first.shape.head_v_dim,
        linear_num_key_heads=first.shape.num_k_heads,
        linear_num_value_heads=first.shape.num_v_heads,
        layer_types=layer_types,
        bos_token_id=teacher.bos_token_id,
        eos_token_id=teacher.eos_token_id,
        pad_token_id=teacher.pad_token_id,
    )


def qwen3_5_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The Qwen3.5 checkpoint's tensors from a converted model (names as ``Qwen3_5ForCausalLM``'s)."""
    adapter = get_adapter(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def norm(module: nn.Module) -> torch.Tensor:  # Llama multiplies by w, Qwen3.5 by 1 + w
        return module.weight.detach() - 1

    tensors = {
        "model.embed_tokens.weight": base.embed_tokens.weight.detach(),
        "model.norm.weight": norm(base.norm),
    }
    if not model.config.get_text_config(decoder=True).tie_word_embeddings:
        tensors["lm_head.weight"] = model.lm_head.weight.detach()
    for index, layer in enumerate(adapter.decoder_layers(model)):
        prefix = f"model.layers.{index}."
        attention = getattr(layer, adapter.family.attention_attribute)
        cell = attention.dofla_student
        tensors[prefix + "input_layernorm.weight"] = norm(layer.input_layernorm)
        tensors[prefix + "post_attention_layernorm.weight"] = norm(layer.post_attention_layernorm)
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors[prefix + f"mlp.{name}.weight"] = getattr(layer.mlp, name).weight.detach()
        for name, tensor in cell.state_dict().items():
            tensors[prefix + "linear_attn." + name] = tensor.detach()
        tensors[prefix + "linear_attn.out_proj.weight"] = attention.o_proj.weight.detach()
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def check_export_folder(out_dir: str | Path, inputs=()) -> Path:
    """Refuse, before any work, an export folder that is an input, holds one, or is not new or empty."""
    from dofla import outputs

    out_dir = outputs.check_output_folder(out_dir, EXPORT_KIND, inputs=inputs)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DoflaError(f"--out {out_dir} is not empty; export into a new or empty folder.")
    return out_dir


def export_model(
    model: nn.Module, out_dir: str | Path, *, tokenizer=None, inputs=(), all_linear: bool = False
) -> Path:
    """Write converted ``model`` to ``out_dir`` (new or empty) as a ``qwen3_5_text`` checkpoint, atomically
    (a temporary sibling folder renamed into place); anything that does not map exactly is refused in one
    sentence with nothing written. ``all_linear``: without the identity attention layer (module docstring).
    Returns the folder."""
    from transformers import Qwen3_5ForCausalLM

    from dofla.io import temporary_folder
    from dofla.loading import skipped_weight_initialisation

    out_dir = check_export_folder(out_dir, inputs)
    plan = getattr(model, "dofla_plan", None)
    if plan is None:
        raise DoflaError("this model is not converted; convert it with the recipe `portable` first.")
    adapter = get_adapter(model)
    difference = (
        teacher_differences(model.config)
        or plan_differences(plan, adapter.num_layers)
        or model_differences(model)
    )
    if difference:
        raise _not_exportable(difference)
    check_finite_model(model)
    config = qwen3_5_config(model, all_linear=all_linear)
    tensors = qwen3_5_weights(model)
    dtype = model.get_input_embeddings().weight.dtype
    with skipped_weight_initialisation():
        exported = Qwen3_5ForCausalLM(config).to(dtype)
    if not all_linear:  # the identity attention layer: every weight zero
        identity = f"model.layers.{config.num_hidden_layers - 1}."
        tensors.update(
            {
                name: torch.zeros_like(t)
                for name, t in exported.state_dict().items()
                if name.startswith(identity)
            }
        )
    missing, unexpected = exported.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise DoflaError(
            f"the export does not fill Qwen3.5's weights exactly (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); report this as a dofla bug."
        )
    if config.tie_word_embeddings:
        exported.tie_weights()
    exported.generation_config = model.generation_config
    exported.config.dtype = dtype
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    with temporary_folder(out_dir.parent, out_dir.name) as temporary:
        exported.save_pretrained(temporary)
        if tokenizer is not None:
            tokenizer.save_pretrained(temporary)
        for item in temporary.iterdir():
            item.chmod(0o666 & ~umask)
        temporary.chmod(0o777 & ~umask)
        check_export_folder(out_dir, inputs)  # still new or empty
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked just above)
        os.replace(temporary, out_dir)
    return out_dir


def export_folder(path: str | Path, out_dir: str | Path, *, all_linear: bool = False) -> Path:
    """``dofla export``: the converted folder ``path`` (saved by dofla) written to ``out_dir`` as a
    ``qwen3_5_text`` checkpoint (see :func:`export_model`). What cannot be exported is refused from the
    saved plan and config before the weights are read."""
    from dofla.loading import teacher_config_of

    path = Path(path)
    record = read_record(path)  # one sentence where the folder is not a converted model
    check_export_folder(out_dir, inputs=[path])
    plan = ConversionPlan.from_dict(record["plan"])
    config = teacher_config_of(path, plan)
    difference = teacher_differences(config) or plan_differences(plan, int(config.num_hidden_layers))
    if difference:
        raise _not_exportable(difference)
    model, tokenizer, _ = load_converted(path)
    return export_model(model, out_dir, tokenizer=tokenizer, inputs=[path], all_linear=all_linear)
