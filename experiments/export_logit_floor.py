"""How far apart float32 rounding alone puts two exact implementations of the same exported student: dofla's
model against its `dofla export` run by transformers' Qwen3.5 code, beside each one against itself with
its gated delta rule computed another way (transformers: its chunked against its recurrent PyTorch form;
dofla: its chunked, recurrent and naive forms).

Steps: load the saved student (a `dofla convert` / `dofla linearize` output whose layers are all
`gated_delta_net`), export it with `dofla export` (float32, and from a float64 load for the float64 runs),
load the export with `AutoModelForCausalLM` in this process, and on prompts of the shipped held-out
Wikipedia text compare

1. the logits of every pair of the five float32 runs (max |difference|), and of each against a float64
   reference (dofla's chunked form in float64, widened: see 3);
2. layer by layer, each layer's attention module (dofla's cell and the teacher's output projection;
   transformers' ``linear_attn``) given the same input, the hidden states entering that layer's
   transformers ``linear_attn`` in the float32 run: the largest difference relative to the layer's largest
   output, for the same pairs;
3. both models in float64 with transformers' float32 casts widened: transformers' Qwen3.5 code computes the
   delta rule and the gated norm in float32 (``.to(torch.float32)``) and its RMSNorm in float32
   (``x.float()``), and Llama's RMSNorm, which dofla's student keeps, in float32 too, whatever the model's
   dtype. Here ``torch.float32`` reads float64 in those two modeling modules and Qwen3.5's RMSNorm
   normalises in the input's dtype (``x / rms(x) * (1 + w)``) for the run. Both sides still round the decay
   ``g`` to float32 (``A_log.float()``) in the same way. What is left is the two implementations' own
   difference.

transformers' recurrent form is chosen by replacing the module's ``torch_chunk_gated_delta_rule`` with its
``torch_recurrent_gated_delta_rule`` for the run (each call is counted, so a patch that does not take
fails loudly); dofla's forms by fixing each cell's ``form``.

    PYTHONPATH=src python -m dofla convert smollm2-135m --recipe portable --out /tmp/floor/student
    PYTHONPATH=src python experiments/export_logit_floor.py /tmp/floor/student [--tokens 64] [--rows 2]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "src" / "dofla" / "demo_text" / "wikipedia_heldout.txt"
RUNS = ("dofla naive", "dofla chunked", "dofla recurrent", "transformers chunked", "transformers recurrent")


def prompts(tokenizer, tokens: int, rows: int) -> torch.Tensor:
    """``rows`` prompts of ``tokens`` tokens each from the shipped held-out Wikipedia text, one paragraph
    each (as ``experiments/export_smollm2.py``)."""
    paragraphs = [line.strip() for line in TEXT.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [encoded[:tokens] for encoded in (tokenizer(p)["input_ids"] for p in paragraphs)]
    ids = [row for row in ids if len(row) == tokens][:rows]
    if len(ids) < rows:
        raise SystemExit(f"{TEXT.name} has fewer than {rows} paragraphs of {tokens} tokens; ask for fewer.")
    return torch.tensor(ids)


def qwen3_5_module():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


@contextmanager
def transformers_form(form: str):
    """transformers' Qwen3.5 layers run their chunked (as shipped) or recurrent gated delta rule."""
    module = qwen3_5_module()
    chunked, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
    calls = {"recurrent": 0}

    def recurrent_instead(*args, chunk_size=None, **kwargs):
        calls["recurrent"] += 1
        return recurrent(*args, **kwargs)

    if form == "recurrent":
        module.torch_chunk_gated_delta_rule = recurrent_instead
    try:
        yield calls
    finally:
        module.torch_chunk_gated_delta_rule = chunked
    if form == "recurrent" and calls["recurrent"] == 0:
        raise RuntimeError(
            "the recurrent form was never called: transformers' layer no longer reads the patch"
        )


@contextmanager
def dofla_form(model, form: str):
    """Every gated_delta_net cell of ``model`` runs ``form`` (naive, chunked or recurrent)."""
    from dofla.models.surgery import students

    cells = list(students(model).values())
    for cell in cells:
        mix = type(cell).mix.__get__(cell)
        cell.mix = lambda hidden, key_mask, _form, state, mix=mix: mix(hidden, key_mask, form, state)
    try:
        yield
    finally:
        for cell in cells:
            del cell.mix


class WideTorch:
    """``torch``, except that ``float32`` is float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name == "float32" else getattr(torch, name)


@contextmanager
def widened_float32():
    """In transformers' Qwen3.5 and Llama modeling modules ``torch.float32`` reads float64, and Qwen3.5's
    RMSNorm normalises in its input's dtype: their float32 casts do not narrow a float64 run."""
    from transformers.models.llama import modeling_llama

    modules = (qwen3_5_module(), modeling_llama)
    wide = WideTorch()
    norm_class = qwen3_5_module().Qwen3_5RMSNorm
    norm_forward = norm_class.forward

    def wide_norm(self, x):  # x / rms(x) * (1 + w), in x's dtype
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(x.dtype))

    for module in modules:
        module.torch = wide
    norm_class.forward = wide_norm
    try:
        yield
    finally:
        for module in modules:
            module.torch = torch
        norm_class.forward = norm_forward


def largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def logits_of(dofla_model, plain_model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The five runs' logits (B, T, V)."""
    out = {}
    with torch.no_grad():
        for form in ("naive", "chunked", "recurrent"):
            with dofla_form(dofla_model, form):
                out[f"dofla {form}"] = dofla_model(ids, use_cache=False).logits
        for form in ("chunked", "recurrent"):
            with transformers_form(form):
                out[f"transformers {form}"] = plain_model(input_ids=ids, use_cache=False).logits
    return out


def layer_outputs(dofla_model, plain_model, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer, each run's attention-module output (B, T, E) for the hidden states entering transformers'
    ``linear_attn`` of that layer in its own (chunked) run."""
    from dofla.models.surgery import students

    inputs = {}
    hooks = [
        layer.linear_attn.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: inputs.__setitem__(
                index, kwargs.get("hidden_states", args[0] if args else None)
            ),
            with_kwargs=True,
        )
        for index, layer in enumerate(plain_model.model.layers)
    ]
    with torch.no_grad():
        plain_model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    cells, layers = students(dofla_model), dofla_model.model.layers
    results = []
    with torch.no_grad():
        for index, hidden in sorted(inputs.items()):
            cell, out = cells[index], {}
            output_projection = layers[index].self_attn.o_proj
            for form in ("naive", "chunked", "recurrent"):
                core, _ = cell.mix(hidden, None, form, None)  # (B, T, H, D)
                out[f"dofla {form}"] = output_projection(core.flatten(2))
            for form in ("chunked", "recurrent"):
                with transformers_form(form):
                    out[f"transformers {form}"] = plain_model.model.layers[index].linear_attn(hidden)
            results.append(out)
    return results


def pair_table(title: str, values: dict[tuple[str, str], str]) -> list[str]:
    lines = [title, "", "| | " + " | ".join(RUNS) + " |", "|---|" + "---:|" * len(RUNS)]
    for row in RUNS:
        cells = [values.get((row, column), values.get((column, row), "")) for column in RUNS]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student", help="a saved dofla student whose layers are all gated_delta_net")
    parser.add_argument("--tokens", type=int, default=64, help="prompt length")
    parser.add_argument("--rows", type=int, default=2, help="prompts")
    parser.add_argument("--work", help="folder for the exports (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from dofla.export import export_model
    from dofla.loading import load_converted

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="export-logit-floor-"))
    models = {}
    for dtype in ("float32", "float64"):
        model, tokenizer, _ = load_converted(args.student, dtype=dtype, device="cpu")
        # the converted layers alone: layer i of the export is layer i of dofla's model
        export_model(model, work / f"exported-{dtype}", tokenizer=tokenizer, all_linear=True)
        plain = AutoModelForCausalLM.from_pretrained(work / f"exported-{dtype}", dtype=getattr(torch, dtype))
        models[dtype] = (model.eval(), plain.eval())
    ids = prompts(tokenizer, args.tokens, args.rows)
    print(
        f"student {args.student}; prompts {tuple(ids.shape)} of {TEXT.name}; torch {torch.__version__}, "
        f"transformers {sys.modules['transformers'].__version__}, {args.threads} thread(s)"
    )

    with widened_float32():
        with torch.no_grad(), dofla_form(models["float64"][0], "chunked"):
            reference = models["float64"][0](ids, use_cache=False).logits
        wide = logits_of(*models["float64"], ids)
        wide_layers = layer_outputs(*models["float64"], ids)
    with torch.no_grad():  # float64 as shipped: transformers' and Llama's float32 casts in place
        shipped = [model(input_ids=ids, use_cache=False).logits for model in models["float64"]]
    narrow = logits_of(*models["float32"], ids)
    narrow_layers = layer_outputs(*models["float32"], ids)

    scale = reference.abs().max().item()
    lines = [f"largest |logit| {scale:.3g}", ""]
    pairs = list(itertools.combinations(RUNS, 2))
    lines += pair_table(
        "float32 logits, max |difference| between runs (diagonal: against the float64 reference)",
        {
            **{pair: f"{largest(narrow[pair[0]], narrow[pair[1]]):.3g}" for pair in pairs},
            **{(run, run): f"{largest(narrow[run], reference):.3g}" for run in RUNS},
        },
    )

    def layer_figure(outputs, pair) -> str:
        worst = max(largest(o[pair[0]], o[pair[1]]) / o[pair[0]].abs().max().item() for o in outputs)
        return f"{worst:.3g}"

    lines += pair_table(
        "float32 attention modules, same input: the largest over layers of max |difference| / max |output|",
        {pair: layer_figure(narrow_layers, pair) for pair in pairs},
    )
    lines += pair_table(
        "float64 with transformers' float32 casts widened: logits, max |difference| between runs",
        {pair: f"{largest(wide[pair[0]], wide[pair[1]]):.3g}" for pair in pairs},
    )
    lines += pair_table(
        "float64 widened, attention modules, same input: the largest over layers of max |difference| / max |output|",
        {pair: layer_figure(wide_layers, pair) for pair in pairs},
    )
    dofla_vs_plain = largest(narrow["dofla chunked"], narrow["transformers chunked"])
    plain_vs_itself = largest(narrow["transformers chunked"], narrow["transformers recurrent"])
    dofla_vs_itself = largest(narrow["dofla chunked"], narrow["dofla recurrent"])
    lines.append(
        f"float32, as shipped (chunked on both sides): dofla vs transformers {dofla_vs_plain:.3g}; transformers "
        f"chunked vs its recurrent form {plain_vs_itself:.3g}; dofla chunked vs its recurrent form "
        f"{dofla_vs_itself:.3g}; float64 as shipped (the float32 casts in place), dofla vs transformers "
        f"{largest(*shipped):.3g}; float64 widened, dofla vs transformers "
        f"{largest(wide['dofla chunked'], wide['transformers chunked']):.3g}"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
