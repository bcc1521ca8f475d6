"""Where should a window's sink tokens sit? The teacher's softmax cut to a window plus sinks, two ways.

A window-plus-sinks cache (the no-training baseline, and the softmax half of every hybrid student) lets each
query see the last W keys and the first S tokens. The keys carry rotary positions, so a sink is seen at its
true distance, up to the whole context. This measures the other choice (what a cache that numbers its own
slots does): each query sees the sinks as if it stood at position min(t, W + S), i.e. the sinks just before
its window at a fixed distance. Nothing is trained; only the teacher runs.

    python experiments/sink_positions.py --out docs/results/long_context/sink_positions \\
        [--data ../shared/data/wiki_demo/tinyshakespeare.txt] [--lengths 1024,2048,4096,8192] [--sequences 4]

Rows are cut from the start of one long document at each length (as ``beyond_training_length.sh`` does), and
perplexity is given overall and by position of the predicted token. The attention here is a plain PyTorch
band over each block of queries (scores for the window's keys and, from the turned query, for the sinks),
checked against a dense masked softmax on short random inputs before anything runs.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from dofla import dispatch
from dofla.models import get_adapter, load_teacher
from dofla.rotary import rotary_frequencies, rotate

BUCKETS = [(1, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]


def sink_query_angles(length: int, window: int, sinks: int, frequencies: torch.Tensor) -> torch.Tensor:
    """Angles (1, 1, T, r/2) that turn query t to position min(t, window + sinks)."""
    position = torch.arange(length, dtype=torch.float32)
    shift = torch.clamp(position, max=window + sinks) - position  # <= 0
    return shift[None, None, :, None] * frequencies


def window_sink_attention(query, key, value, window, sinks, scaling, sink_query=None, block=128):
    """Causal softmax over the last ``window`` keys and the first ``sinks`` (each sink seen only where it is
    older than the window, as the library's baseline does), in blocks of queries: query (B, H, T, D), key and
    value (B, Hkv, T, D) -> (B, T, H, Dv). ``sink_query`` (B, H, T, D): the queries the sinks' scores use."""
    batch, heads, length, dim = query.shape
    group = heads // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    sink_query = query if sink_query is None else sink_query
    sinks = min(sinks, length)
    outputs = []
    for start in range(0, length, block):
        stop = min(start + block, length)
        first = max(0, start - window + 1)
        positions = torch.arange(start, stop)[:, None]
        keys = torch.arange(first, stop)[None, :]
        band = (keys <= positions) & (keys > positions - window)  # (q, k)
        scores = query[:, :, start:stop] @ key[:, :, first:stop].transpose(-1, -2) * scaling
        scores = scores.masked_fill(~band, float("-inf"))
        if sinks:
            seen = torch.arange(sinks)[None, :] <= positions - window  # (q, S): older than the window
            sink_scores = sink_query[:, :, start:stop] @ key[:, :, :sinks].transpose(-1, -2) * scaling
            scores = torch.cat([sink_scores.masked_fill(~seen, float("-inf")), scores], dim=-1)
            values = torch.cat([value[:, :, :sinks], value[:, :, first:stop]], dim=2)
        else:
            values = value[:, :, first:stop]
        outputs.append(torch.softmax(scores, dim=-1) @ values)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def check_against_dense() -> None:
    """The block form equals a dense masked softmax (the sinks' columns scored from the turned query)."""
    generator = torch.Generator().manual_seed(0)
    query, sink_query = torch.randn(2, 1, 4, 37, 8, generator=generator).unbind(0)
    key, value = torch.randn(2, 1, 2, 37, 8, generator=generator).unbind(0)
    window, sinks, scaling = 6, 3, 8**-0.5
    got = window_sink_attention(query, key, value, window, sinks, scaling, sink_query, block=5)
    keys, values = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    t, s = torch.arange(37)[:, None], torch.arange(37)[None, :]
    in_window = (s <= t) & (s > t - window)
    is_sink = (s < sinks) & (s <= t - window)
    scores = torch.where(is_sink, sink_query @ keys.transpose(-1, -2), query @ keys.transpose(-1, -2))
    scores = (scores * scaling).masked_fill(~(in_window | is_sink), float("-inf"))
    expected = (torch.softmax(scores, -1) @ values).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@contextmanager
def windowed(model, window: int, sinks: int, frequencies: torch.Tensor | None):
    """Every softmax layer of ``model`` cut to the window and sinks; ``frequencies``: sinks seen from the
    window's edge (None: at their true positions)."""

    def attention(module, query, key, value, attention_mask, *, teacher_kind, scaling, **kwargs):
        sink_query = None
        if frequencies is not None:
            angles = sink_query_angles(query.shape[2], window, sinks, frequencies).to(query.device)
            sink_query = rotate(query, angles)
        return window_sink_attention(query, key, value, window, sinks, scaling, sink_query), None

    dispatch.install(model)
    modules = list(get_adapter(model).attention_modules(model))
    for module in modules:
        setattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE, attention)
    try:
        yield model
    finally:
        for module in modules:
            delattr(module, dispatch.SOFTMAX_OVERRIDE_ATTRIBUTE)


def perplexities(model, rows: torch.Tensor) -> list[float]:
    """Overall, then per bucket of predicted-token positions that the rows reach."""
    length = rows.shape[1]
    losses = torch.zeros(length - 1)
    with torch.no_grad():
        for row in rows:
            logits = model(row[None]).logits[0, :-1].float()
            losses += F.cross_entropy(logits, row[1:], reduction="none")
    losses /= rows.shape[0]
    buckets = [(a, min(b, length)) for a, b in BUCKETS if a < length]
    return [math.exp(losses.mean())] + [math.exp(losses[a - 1 : b - 1].mean()) for a, b in buckets]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="../shared/data/wiki_demo/tinyshakespeare.txt")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--windows", default="64,128", help="window sizes, each with --sinks sinks")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    check_against_dense()
    teacher = load_teacher("smollm2-135m")
    model, tokenizer = teacher.model.eval(), teacher.tokenizer
    frequencies = rotary_frequencies(model)
    ids = tokenizer(Path(args.data).read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, lines = [], []
    for length in [int(x) for x in args.lengths.split(",")]:
        rows = ids[: args.sequences * length].view(args.sequences, length)
        named = {"teacher": perplexities(model, rows)}
        for window in [int(x) for x in args.windows.split(",")]:
            for label, freqs in (("true positions", None), ("at the window's edge", frequencies)):
                with windowed(model, window, args.sinks, freqs):
                    named[f"window {window} + {args.sinks} sinks, {label}"] = perplexities(model, rows)
        results.append({"length": length, "sequences": args.sequences, "perplexity": named})
        buckets = [f"{a}-{min(b, length) - 1}" for a, b in BUCKETS if a < length]
        lines += [f"**{length} tokens** ({args.sequences} sequences)", ""]
        lines += ["| model | ppl | x teacher | " + " | ".join(buckets) + " |"]
        lines += ["|---|---:|---:|" + "---:|" * len(buckets)]
        for name, values in named.items():
            ratio = values[0] / named["teacher"][0]
            cells = " | ".join(f"{v:.2f}" for v in values[1:])
            lines.append(f"| {name} | {values[0]:.2f} | {ratio:.2f} | {cells} |")
        lines.append("")
        print("\n".join(lines[-len(named) - 5 :]), flush=True)
    (out / "sink_positions.json").write_text(json.dumps(results, indent=2) + "\n")
    header = f"# Sink positions: the teacher cut to a window plus {args.sinks} sinks, two ways\n\n"
    (out / "sink_positions.md").write_text(header + "\n".join(lines))


if __name__ == "__main__":
    main()
