"""The ``make demo`` run (``dofla demo``): one recipe's settings sized for a 2-core CPU."""

from __future__ import annotations

from pathlib import Path

from dofla.run_config import LinearizeConfig

DEMO_COMMAND = "dofla demo  (dofla.pipeline.linearize(dofla.demo.demo_config(out)))"
DEMO_RECIPE = "gated-delta-recall"
DEMO_TEXT = Path(__file__).resolve().parent / "demo_text"  # shipped with dofla; sources in its LICENSE.md
DEMO_TRAIN_TEXT = DEMO_TEXT / "c4_train.jsonl"  # 100 C4 web documents (ODC-By), about 59k tokens
DEMO_HELDOUT_TEXT = DEMO_TEXT / "wikipedia_heldout.txt"  # 3 Wikipedia articles (CC BY-SA 4.0), 21k tokens


def demo_config(out_dir: str | Path) -> LinearizeConfig:
    """The ``make demo`` run, sized to finish within 15 minutes on an idle 2-core CPU: the embedded
    SmolLM2-135M with every layer converted to the :data:`DEMO_RECIPE` recipe's cell (the gated delta rule
    over 64-dimensional learned keys beside a 96-token window of the teacher's own softmax that keeps 4 sink
    tokens) and a cache of 96 tokens per head read in the window's softmax (the 32 its memory recalls worst
    and the 64 that drew the most attention while in the window), trained with the cache in the loop:
    attention-output MSE on 4k tokens of 1,024-token rows, then LoRA (lr 3e-3, KL 1 to the teacher) on 6k
    tokens of 512-token rows, and the same LoRA stage on the unconverted teacher for reference. Measured at
    1,024 tokens beside the teacher and its no-training caches (the window with and without sinks;
    StreamingLLM and heavy hitters holding as many bytes as the student's state), and the pass key at 2,048
    and 4,096 tokens (depths 0.1/0.5/0.9, one trial each). Data: real text shipped with dofla, of two
    sources: it trains on web text (:data:`DEMO_TRAIN_TEXT`) and is measured on 16 held-out rows of 1,024
    tokens of encyclopedia text it never saw (:data:`DEMO_HELDOUT_TEXT`)."""
    return LinearizeConfig.from_dict(
        dict(
            out_dir=str(out_dir),
            recipe=DEMO_RECIPE,
            command=DEMO_COMMAND,
            data=dict(
                path=str(DEMO_TRAIN_TEXT),
                heldout_path=str(DEMO_HELDOUT_TEXT),
                seq_len=1024,
                heldout_fraction=0.1,
                heldout_sequences=16,
                sampled_texts=32,
                sampled_tokens=128,
            ),
            distill=dict(tokens=4096, batch_size=2, eval_every=0, checkpoint_every=1, eval_batches=1),
            lora=dict(tokens=6144, seq_len=512, baseline=True),
            evaluate=dict(
                lengths=[1024],
                passkey_lengths=[2048, 4096],
                passkey_trials=1,
                recall=False,
                error_sequences=0,
            ),
        )
    )
