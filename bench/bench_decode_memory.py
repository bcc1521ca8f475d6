"""Memory of one decode step: recurrent linear / hybrid state vs a softmax KV cache, at growing contexts.

For each context length the state is built by a real chunked prefill, then one token is decoded.
Reported per layer (B=1, H=9, Hk=3, head size 64, F=64, float32 by default):
- state bytes: the tensor storage kept between steps (``dofla.cache.held_bytes``: a view holds its whole
  storage; linear: kv + normalizer + offset; hybrid: that plus the last `window` keys, values, key features
  and log scales; softmax: the K and V cache);
- step allocations: bytes allocated by the step itself (torch profiler, CPU), the transient memory a
  step needs on top of the state (an upper bound of its peak: freed buffers are not subtracted).

    .venv/bin/python bench/bench_decode_memory.py
    .venv/bin/python bench/bench_decode_memory.py --contexts 1024 4096 16384 65536
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dofla.cache import held_bytes
from dofla.feature_maps import build_feature_map
from dofla.ops import (
    HybridInputs,
    HybridOptions,
    LinearInputs,
    chunked_hybrid_attention,
    chunked_linear_attention,
    recurrent_hybrid_attention,
    recurrent_linear_attention,
)


def allocated_bytes(function, *arguments) -> int:
    """Bytes allocated on the CPU while ``function`` runs (sum over its operators' allocations)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function(*arguments)
    return sum(max(event.self_cpu_memory_usage, 0) for event in profiler.key_averages())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    scaling = head_dim**-0.5
    feature_map = build_feature_map(
        "learnable_prf", num_heads=kv_heads, head_dim=head_dim, feature_dim=args.features, scaling=scaling
    )
    window_factor = torch.full((heads,), 0.1)

    def features(query, key):
        q_features, _ = feature_map(query, is_query=True)
        k_features, k_log_scale = feature_map(key, is_query=False)
        return q_features, k_features, k_log_scale

    def linear_step(query, key, value, state):
        q_features, k_features, k_log_scale = features(query, key)
        return recurrent_linear_attention(
            LinearInputs(q_features, k_features, value, k_log_scale), state=state
        )

    options = HybridOptions(scaling=scaling, window=args.window)

    def hybrid_step(query, key, value, state):
        q_features, k_features, k_log_scale = features(query, key)
        inputs = HybridInputs(query, key, q_features, k_features, value, window_factor, k_log_scale)
        return recurrent_hybrid_attention(inputs, options, state=state)

    def softmax_step(query, key, value, cache):
        keys, values = torch.cat([cache[0], key], dim=2), torch.cat([cache[1], value], dim=2)
        out = F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=True)
        return out, (keys, values)

    rows = []
    with torch.inference_mode():
        for context in args.contexts:
            query = torch.randn(1, heads, context + 1, head_dim)
            key = torch.randn(1, kv_heads, context + 1, head_dim)
            value = torch.randn(1, kv_heads, context + 1, head_dim)
            prompt = (query[:, :, :context], key[:, :, :context], value[:, :, :context])
            step = (query[:, :, context:], key[:, :, context:], value[:, :, context:])
            q_features, k_features, k_log_scale = features(prompt[0], prompt[1])
            _, linear_state = chunked_linear_attention(
                LinearInputs(q_features, k_features, prompt[2], k_log_scale), return_state=True
            )
            _, hybrid_state = chunked_hybrid_attention(
                HybridInputs(*prompt[:2], q_features, k_features, prompt[2], window_factor, k_log_scale),
                options,
                return_state=True,
            )
            cache = (prompt[1].clone(), prompt[2].clone())
            _, new_linear = linear_step(*step, linear_state)
            _, new_hybrid = hybrid_step(*step, hybrid_state)
            _, new_cache = softmax_step(*step, cache)
            rows.append(
                (
                    context,
                    held_bytes(new_linear),
                    allocated_bytes(linear_step, *step, linear_state),
                    held_bytes(new_hybrid),
                    allocated_bytes(hybrid_step, *step, hybrid_state),
                    held_bytes(new_cache),
                    allocated_bytes(softmax_step, *step, cache),
                )
            )

    def kib(count: int) -> str:
        return f"{count / 1024:,.1f}"

    print(f"command: {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")
    print(
        f"one layer, B=1, H={heads}, Hk={kv_heads}, d={head_dim}, F={args.features}, hybrid window={args.window}, "
        f"float32, CPU, torch {torch.__version__}; sizes in KiB"
    )
    print()
    print(
        "| context | linear state | linear step alloc | hybrid state | hybrid step alloc | "
        "softmax KV cache | softmax step alloc |"
    )
    print("|---|---|---|---|---|---|---|")
    for context, *sizes in rows:
        print(f"| {context} | " + " | ".join(kib(size) for size in sizes) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
