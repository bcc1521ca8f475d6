"""The storage a cache holds after ``model.generate()``, for a converted folder and its teacher, per prompt length.

For each length, a random prompt of that many tokens goes through ``generate()`` (greedy, a few new tokens,
``return_dict_in_generate``) on the student and on the teacher; the table gives the bytes of tensor storage
the returned cache keeps alive (:func:`dofla.cache.held_bytes`: a view counts its whole storage) beside the
student's logical state size (:func:`dofla.cache.recurrent_cache_bytes`, plus the kept softmax layers'
buffers):

    .venv/bin/python experiments/held_cache_after_generate.py runs/demo/model --lengths 1024,4096 --threads 1
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from dofla.cache import GrowingKVLayer, held_bytes, recurrent_cache_bytes, self_attention_cache
from dofla.commands._common import integer_list
from dofla.loading import load_converted
from dofla.models import load_teacher

MIB = 2**20


@torch.no_grad()
def generated_cache(model, length: int, new_tokens: int, seed: int = 0):
    """The cache ``generate()`` returns after a random prompt of ``length`` tokens."""
    vocabulary = int(model.config.get_text_config().vocab_size)
    prompt = torch.randint(0, vocabulary, (1, length), generator=torch.Generator().manual_seed(seed))
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )
    return output.past_key_values


def logical_bytes(cache) -> int:
    """The student's state (recurrent layers) and its kept softmax layers' buffers."""
    kept = sum(
        layer.nbytes() for layer in self_attention_cache(cache).layers if isinstance(layer, GrowingKVLayer)
    )
    return recurrent_cache_bytes(cache) + kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", help="a converted folder (dofla convert / linearize's model/)")
    parser.add_argument("--lengths", default="1024,4096", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = integer_list(args.lengths, "--lengths", minimum=1)
    student, _, plan = load_converted(args.converted, dtype="float32", device="cpu")
    teacher = load_teacher(plan.metadata["teacher"], dtype="float32", device="cpu").model
    print(f"command: {shlex.join(['python', *sys.argv])}")
    print()
    print(
        "| prompt tokens | student: held bytes | student: state bytes | teacher: held bytes | held MiB (student / teacher) |"
    )
    print("|---|---|---|---|---|")
    for length in lengths:
        cache = generated_cache(student, length, args.new_tokens)
        held, logical = held_bytes(cache), logical_bytes(cache)
        teacher_held = held_bytes(generated_cache(teacher, length, args.new_tokens))
        print(
            f"| {length} | {held} | {logical} | {teacher_held} | {held / MIB:.2f} / {teacher_held / MIB:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
