"""The ``make demo`` run (``dofla demo``): one recipe's settings sized for a 2-core CPU."""

from __future__ import annotations

from pathlib import Path

from dofla.run_config import LinearizeConfig

DEMO_COMMAND = "dofla demo  (dofla.pipeline.linearize(dofla.demo.demo_config(out)))"
DEMO_TEXT = Path(__file__).resolve().parent / "demo_text"  # shipped with dofla; sources in its LICENSE.md
DEMO_TRAIN_TEXT = DEMO_TEXT / "c4_train.jsonl"  # 100 C4 web documents (ODC-By), about 59k tokens
DEMO_HELDOUT_TEXT = DEMO_TEXT / "wikipedia_heldout.txt"  # 3 Wikipedia articles (CC BY-SA 4.0), 21k tokens


def demo_config(out_dir: str | Path) -> LinearizeConfig:
    """The ``make demo`` run, sized for a 2-core CPU: the embedded SmolLM2-135M with every layer converted to
    the long-context recipe's cell (``gla``: linear attention with a learned decay sharing one normalisation
    with a 64-token window that keeps 4 sink tokens), Hedgehog feature dimensions allocated by DoF (mean 32);
    attention-output MSE on 12k tokens of 512-token sequences, then LoRA (lr 3e-3, KL 1 to the teacher) on 10k
    tokens, and the same LoRA stage on the unconverted teacher for reference. Held-out text is evaluated at
    512 and 1,024 tokens beside the teacher and its no-training window baselines. Data: real text shipped
    with dofla, of two sources: it trains on web text (:data:`DEMO_TRAIN_TEXT`) and is measured on 16
    held-out rows of 1,024 tokens (32 of 512) of encyclopedia text it never saw (:data:`DEMO_HELDOUT_TEXT`)."""
    return LinearizeConfig.from_dict(
        dict(
            out_dir=str(out_dir),
            recipe="gla",
            command=DEMO_COMMAND,
            data=dict(
                path=str(DEMO_TRAIN_TEXT),
                heldout_path=str(DEMO_HELDOUT_TEXT),
                seq_len=512,
                heldout_fraction=0.1,
                heldout_sequences=16,
                sampled_texts=32,
                sampled_tokens=128,
            ),
            plan=dict(budget=32, allocation="dof", dof_points=256, dof_batches=1),
            distill=dict(tokens=12_000, batch_size=2, eval_every=6, checkpoint_every=3),
            lora=dict(tokens=10_000, baseline=True),
            evaluate=dict(lengths=[1024], passkey_lengths=[256, 1024], passkey_trials=1),
        )
    )
