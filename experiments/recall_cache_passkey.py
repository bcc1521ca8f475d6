"""Training-free: does the recall cache find the pass key where the window alone cannot?

The embedded teacher's every layer becomes the gated-delta hybrid (window ``--window`` + ``--sinks`` sinks,
projection keys of ``--key-dim``) with the window's share near 1 (``--window-factor``), so that the output is
the teacher's softmax over its window, sinks and recall cache, and the untrained memory serves only to score
the tokens leaving the window (its recall error). For each recall budget of ``--budgets`` (0: the window
alone; ``far:N`` splits N slots per layer on average by the teacher's attention beyond the window, measured
on ``--text``), pass-key accuracy at ``--lengths`` and ``--depths`` and perplexity on ``--ppl-windows``
windows of ``--ppl-length`` tokens of ``--text`` (text never trained on: nothing here trains). Beside them
the window of as many bytes as each budget's window + cache (``--equal-windows``). Writes
``recall_cache_passkey.md``/``.json`` to ``--out``::

    nice .venv/bin/python experiments/recall_cache_passkey.py --threads 1 --out docs/results/recall_cache
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from dofla.commands._common import integer_list
from dofla.convert import convert, plan_for, unconvert
from dofla.data import load_texts
from dofla.evaluation.passkey import passkey_retrieval
from dofla.io import write_text_atomic
from dofla.models import load_teacher
from dofla.models.surgery import students

WIKI = "/work/shared/data/wiki_demo/wiki_demo.txt"


def far_attention_mass(model, ids: torch.Tensor, window: int, sinks: int) -> list[float]:
    """Per layer: the teacher's attention mass on keys beyond the window and outside the sinks, averaged
    over heads and over the queries past window + sinks (eager attention weights), ids (1, T)."""
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # per layer (1, H, T, T)
    length = ids.shape[1]
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    far = (key <= query - window) & (key >= sinks)  # (T, T)
    rows = slice(window + sinks, length)
    return [float((weights[0] * far).sum(-1)[:, rows].mean()) for weights in attentions]


def split_budget(masses: list[float], mean_budget: int) -> list[int]:
    """Slots per layer in proportion to ``masses``, summing to ``mean_budget`` x layers (largest remainders)."""
    total = mean_budget * len(masses)
    shares = [total * mass / sum(masses) for mass in masses]
    budgets = [math.floor(share) for share in shares]
    for index in sorted(range(len(shares)), key=lambda i: budgets[i] - shares[i])[: total - sum(budgets)]:
        budgets[index] += 1
    return budgets


def heldout_perplexity(model, tokenizer, text: str, length: int, windows: int) -> float:
    """exp of the mean next-token loss over ``windows`` consecutive windows of ``length`` tokens of ``text``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: length * windows]
    rows = torch.tensor(ids).view(windows, length)
    losses = []
    with torch.no_grad():
        for row in rows:
            logits = model(row[None]).logits[0, :-1].float()
            losses.append(torch.nn.functional.cross_entropy(logits, row[1:], reduction="mean"))
    return float(torch.stack(losses).mean().exp())


def state_bytes(model, text: str, tokenizer, length: int) -> int:
    """Bytes the cache's layers hold after a prefill of ``length`` tokens of ``text`` (their tensors' storage)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:length]])
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return sum(
        layer.nbytes() if hasattr(layer, "nbytes") else layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers
    )  # a teacher's layers: its keys and values


def convert_with(model, arguments, budgets: list[int], window: int) -> None:
    """Every layer to the gated-delta hybrid with layer i's recall budget ``budgets[i]`` (0: none)."""
    plan = plan_for(
        model,
        kind="hybrid",
        cell="gated_delta",
        feature_map="projection",
        feature_dim=arguments.key_dim,
        window=window,
        sinks=arguments.sinks,
        options={"window_factor": arguments.window_factor},
    )
    for index, layer in enumerate(plan.layers):
        layer.options = {**layer.options, "recall_cache": int(budgets[index])}
    convert(model, plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--key-dim", type=int, default=64)
    parser.add_argument("--window-factor", type=float, default=0.999)
    parser.add_argument("--budgets", default="0,64,far:64")
    parser.add_argument("--equal-windows", action="store_true")
    parser.add_argument("--teacher-row", action="store_true", help="measure the unconverted teacher too")
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--text", default=WIKI)
    parser.add_argument("--ppl-length", type=int, default=1024)
    parser.add_argument("--ppl-windows", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    started = time.time()
    teacher = load_teacher(arguments.teacher, dtype="float32", device="cpu", attn_implementation="eager")
    model, tokenizer = teacher.model, teacher.tokenizer
    text = "\n\n".join(load_texts(arguments.text))
    layers = model.config.num_hidden_layers
    depths = [float(depth) for depth in arguments.depths.split(",")]
    arguments.lengths = integer_list(arguments.lengths, "--lengths", minimum=1)
    masses = None
    configs = [("teacher", None, None)] if arguments.teacher_row else []  # (name, per-layer budgets, window)
    for spec in arguments.budgets.split(","):
        if spec.startswith("far:"):
            if masses is None:
                ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][-1024:]])
                masses = far_attention_mass(model, ids, arguments.window, arguments.sinks)
            mean = int(spec[4:])
            configs.append(
                (f"recall {mean}/layer, split by far attention", split_budget(masses, mean), arguments.window)
            )
        else:
            budget = int(spec)
            name = "window alone" if budget == 0 else f"recall {budget}/layer, uniform"
            configs.append((name, [budget] * layers, arguments.window))
            if budget and arguments.equal_windows:
                configs.append(
                    (f"window {arguments.window + budget} alone", [0] * layers, arguments.window + budget)
                )
    model.set_attn_implementation("sdpa")
    rows = []
    for name, budgets, window in configs:
        if budgets is not None:
            convert_with(model, arguments, budgets, window)
        passkey = passkey_retrieval(
            model, tokenizer, context_lengths=arguments.lengths, depths=depths, trials=arguments.trials
        )
        ppl = heldout_perplexity(model, tokenizer, text, arguments.ppl_length, arguments.ppl_windows)
        state = state_bytes(model, text, tokenizer, 1024)
        rows.append(
            dict(
                name=name,
                window=window,
                budgets=budgets,
                passkey={
                    length: [r.accuracy for r in passkey if r.context_tokens == length]
                    for length in arguments.lengths
                },
                perplexity=ppl,
                state_bytes=state,
            )
        )
        unconvert(model)
        print(name, rows[-1]["passkey"], f"ppl {ppl:.2f}", f"{time.time() - started:.0f}s", flush=True)
    print(students(model) or "teacher restored")
    command = "nice .venv/bin/python experiments/recall_cache_passkey.py " + shlex.join(sys.argv[1:])
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(command=command, masses=masses, rows=rows, seconds=time.time() - started)
    write_text_atomic(out / "recall_cache_passkey.json", json.dumps(result, indent=1))
    lines = [f"`{command}` ({result['seconds']:.0f} s, CPU, {arguments.threads} thread(s))", ""]
    header = " | ".join(f"pass key {length}" for length in arguments.lengths)
    lines += [
        f"| model | {header} | perplexity | state MiB |",
        "|---|" + "---|" * (len(arguments.lengths) + 2),
    ]
    for row in rows:
        cells = " | ".join(
            "/".join(f"{a:.0f}" for a in row["passkey"][length]) for length in arguments.lengths
        )
        lines.append(
            f"| {row['name']} (window {row['window']}) | {cells} | {row['perplexity']:.2f} | {row['state_bytes'] / 2**20:.2f} |"
        )
    if masses is not None:
        lines += ["", "Far attention mass per layer: " + " ".join(f"{mass:.2f}" for mass in masses)]
        lines += [
            "Budgets split by it: "
            + " ".join(
                str(budget)
                for budget in next(row["budgets"] for row in rows if row["name"].endswith("far attention"))
            )
        ]
    write_text_atomic(out / "recall_cache_passkey.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
