"""Layer sharding of ``dofla linearize`` (``--sharding layers``): which process trains which layers, where
each keeps its run, and the checks made before any work.

The converted layers are cut into one contiguous block per process (:func:`dofla.distill.distributed.
layer_blocks`); rank R keeps its distillation log and checkpoints in :func:`rank_run_dir`. With
``distill.teacher_states`` (a ``dofla teacher-states`` folder holding train/ and heldout/ stores) every
process starts its forward from the stored hidden states entering its block's first layer; the store must
have a boundary there and be made by this teacher for this run's rows. The training itself is
:func:`dofla.pipeline.distill_stage` and :func:`dofla.distill.trainer.distill` (``data_parallel=False``).
"""

from __future__ import annotations

from pathlib import Path

from dofla.distill import distributed
from dofla.errors import DoflaError
from dofla.run_config import LinearizeConfig


def layer_sharding(config: LinearizeConfig) -> bool:
    return config.distill.sharding == "layers"


def rank_run_dir(out_dir: Path, rank: int) -> Path:
    """A rank's distillation folder (config, log, checkpoints): distill/ for rank 0, distill/rank-R for the
    other ranks of a layer-sharded run."""
    return out_dir / "distill" if rank == 0 else out_dir / "distill" / f"rank-{rank}"


def layer_count(model_or_config) -> int:
    """The number of decoder layers of a model (or its transformers config)."""
    from dofla.models import get_adapter

    return get_adapter(model_or_config).num_layers


def check_layer_sharding(config: LinearizeConfig, layers, processes: int) -> list[list[int]]:
    """The contiguous blocks of converted ``layers`` that the ``processes`` ranks train, in rank order.

    Refuses, one sentence each, more processes than layers and a ``distill.teacher_states`` store without a
    boundary at each block's first layer. Cheap: called before launching, after loading the teacher and
    after the plan (which decides the converted layers).
    """
    blocks = distributed.layer_blocks(layers, processes)
    if config.distill.teacher_states is not None:
        firsts = [block[0] for block in blocks]
        for states in open_layer_stores(config):
            if not set(firsts) <= set(states.boundaries):
                raise DoflaError(
                    f"the teacher states in {states.folder} start at layers {states.boundaries}, but the "
                    f"{processes} processes train layers {' | '.join(_span(block) for block in blocks)}; write "
                    f"them with `dofla teacher-states ... --boundaries {','.join(map(str, firsts))}`."
                )
    return blocks


def _span(block: list[int]) -> str:
    return f"{block[0]}-{block[-1]}" if len(block) > 1 else str(block[0])


def check_layer_sharding_early(config: LinearizeConfig, processes: int) -> None:
    """What :func:`check_layer_sharding` can tell before the teacher is loaded: the converted layers are
    known from ``plan.layers``, a teacher-state store's manifest or a local teacher folder's config.json."""
    if config.plan.layers is not None:
        check_layer_sharding(config, config.plan.layers, processes)
        return
    if config.distill.teacher_states is not None:
        count = int(open_layer_stores(config)[0].manifest["num_layers"])
    else:
        count = _local_layer_count(config.teacher.model)
    if count is not None:
        check_layer_sharding(config, range(count), processes)


def check_processes(config: LinearizeConfig, processes: int, named: str) -> None:
    """Before any work: ``processes`` can share this run's distillation (``named`` says how the count was
    given, e.g. "--nproc 2"): layer sharding has layers for every process, data sharding divides the batch."""
    if layer_sharding(config):
        check_layer_sharding_early(config, processes)
    elif config.distill.batch_size % processes:
        raise DoflaError(
            f"--batch-size {config.distill.batch_size} is not divisible by {named}; "
            f"use a multiple of {processes}."
        )


def _local_layer_count(model: str) -> int | None:
    """The decoder layer count in a local Hugging Face folder's config.json; None for other teachers (their
    count is checked once they are loaded)."""
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        settings = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError):  # loading the teacher will say what is wrong with the folder
        return None
    return layer_count(settings)


def open_layer_stores(config: LinearizeConfig):
    """The (train, heldout) :class:`~dofla.distill.hidden_store.TeacherStates` of ``distill.teacher_states``."""
    from dofla.distill.hidden_store import MANIFEST_FILE, TeacherStates

    folder = Path(config.distill.teacher_states).expanduser()
    for part in ("train", "heldout"):
        if not (folder / part / MANIFEST_FILE).is_file():
            raise DoflaError(
                f"--teacher-states {folder} has no {part}/ store; give the folder that `dofla teacher-states "
                "... --out DIR` wrote (it holds train/ and heldout/)."
            )
    return TeacherStates(folder / "train"), TeacherStates(folder / "heldout")


def checked_layer_stores(config: LinearizeConfig, teacher, data):
    """The (train, heldout) stores, refused (before the plan and training) when written by another teacher
    or for other rows than this run's: other text, --seq-len, evaluation lengths, split or seed."""
    from dofla.distill.hidden_store import tokens_hash

    stores = open_layer_stores(config)
    for states, rows, name in zip(stores, (data.train, data.heldout), ("train", "heldout"), strict=True):
        stored = (states.manifest["num_sequences"], states.manifest["sequence_length"])
        if stored != tuple(rows.shape) or tokens_hash(rows) != states.manifest["tokens_sha256"]:
            raise DoflaError(
                f"the teacher states in {states.folder} were computed for other {name} rows ({stored[0]} x "
                f"{stored[1]} tokens, this run has {rows.shape[0]} x {rows.shape[1]}); write them with `dofla "
                "teacher-states` from the same --data, --seq-len, --eval-lengths, --heldout-fraction, "
                "--heldout-sequences and --seed as this run."
            )
        states.check(teacher, rows, min(states.boundaries))  # the teacher's fingerprint
    return stores
