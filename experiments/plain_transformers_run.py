"""Run an exported checkpoint with transformers alone (this script never imports dofla): the logits of
given token ids and a greedy continuation, written as JSON. Used by tests/test_export.py and
experiments/export_smollm2.py, in a process of its own. The continuation runs with transformers' cache
where the export ends with its identity attention layer (the default), and without a cache for an
``--all-linear`` export: transformers 5.23's cache refuses a Qwen3.5 model with no full-attention layer
(``DynamicCache.get_seq_length`` needs one), so ``generate`` recomputes the prefix at each token there.

    python experiments/plain_transformers_run.py FOLDER IDS_JSON OUT_JSON --new-tokens N [--dtype float64]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("ids", help="JSON file: a list of rows of token ids")
    parser.add_argument("out", help="JSON file to write: logits, continuation, model class")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=getattr(torch, args.dtype)).eval()
    with open(args.ids, encoding="utf-8") as handle:
        ids = torch.tensor(json.load(handle))
    use_cache = "full_attention" in model.config.layer_types
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        continuation = model.generate(
            ids,
            max_new_tokens=args.new_tokens,
            do_sample=False,
            min_new_tokens=args.new_tokens,
            use_cache=use_cache,
        )
    result = {
        "used_cache": use_cache,
        "logits": logits.tolist(),
        "continuation": continuation[:, ids.shape[1] :].tolist(),
        "model_class": type(model).__name__,
        "dofla_imported": any(name == "dofla" or name.startswith("dofla.") for name in sys.modules),
    }
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
