"""The run configuration tree: TOML round trip, recipes overlaid under explicit settings, flags generated from
the fields, one-sentence refusals of unknown keys and wrong types, and the demo's settings unchanged."""

from __future__ import annotations

import pytest

from dofla.cli import build_parser
from dofla.commands.linearize import config_from_args
from dofla.demo import DEMO_HELDOUT_TEXT, DEMO_TRAIN_TEXT, demo_config
from dofla.errors import DoflaError
from dofla.recipes import RECIPES
from dofla.run_config import LinearizeConfig, load_config, save_config, settings_of, to_toml


def parse(*arguments: str) -> LinearizeConfig:
    return config_from_args(build_parser().parse_args(["linearize", *arguments]))


def every_type_set() -> LinearizeConfig:
    """A config where every kind of value is set away from its default, None included where allowed."""
    return LinearizeConfig.from_dict(
        dict(
            out_dir="runs/x y",
            recipe="gated-delta",
            seed=3,
            command='dofla linearize "quoted" \\ back',
            teacher=dict(model="some/folder", dtype="bfloat16"),
            data=dict(path="text é.jsonl", heldout_fraction=0.25),
            plan=dict(layers=[0, 2], budget=16),
            student=dict(cell_options={"window_factor": 0.5, "decay_memory": True, "name": "x"}),
            distill=dict(tokens="3k", lr=1),
            lora=dict(targets=["q_proj", "v_proj"], baseline=True),
            evaluate=dict(lengths=[1024], passkey_lengths=[64]),
        )
    )


@pytest.mark.parametrize("name", ["demo", "every type", *sorted(RECIPES)])
def test_a_saved_config_loads_back_the_same(tmp_path, name):
    if name == "demo":
        config = demo_config(tmp_path)
    elif name == "every type":
        config = every_type_set()
        assert (config.distill.tokens, config.distill.lr) == (
            3000,
            1.0,
        )  # '3k' read, an int given for a float
    else:
        config = LinearizeConfig.from_dict(dict(out_dir=str(tmp_path), recipe=name))
    path = save_config(config, tmp_path / "config.toml")
    again = load_config(path)
    assert again == config and again.to_dict() == config.to_dict()
    assert to_toml(again) == path.read_text()


def test_recipes_fill_only_what_is_not_set_explicitly(tmp_path):
    lolcats = LinearizeConfig.from_dict(dict(out_dir="x", recipe="lolcats"))
    assert (lolcats.plan.kind, lolcats.student.feature_map, lolcats.distill.loss) == (
        "hybrid",
        "hedgehog",
        "output_mse",
    )
    assert (lolcats.lora.enabled, lolcats.lora.lr, lolcats.lora.kl_weight) == (True, 3e-3, 1.0)
    # an explicit value wins even when it equals the default the recipe would replace
    explicit = LinearizeConfig.from_dict(dict(out_dir="x", recipe="lolcats", plan=dict(kind="linear")))
    assert explicit.plan.kind == "linear" and explicit.plan.window == 64
    # from a file, and from flags over the file over the recipe
    (tmp_path / "run.toml").write_text(
        'out_dir = "from-file"\nrecipe = "lolcats"\n[lora]\nlr = 1e-4\n[distill]\ntokens = "2k"\nloss = "l2"\n'
        '[teacher]\nmodel = "file-model"\n'
    )
    from_file = load_config(tmp_path / "run.toml")
    assert (from_file.lora.lr, from_file.distill.tokens, from_file.distill.loss) == (1e-4, 2000, "l2")
    assert from_file.lora.kl_weight == 1.0  # not in the file: the recipe's
    flags = parse("--config", str(tmp_path / "run.toml"), "--tokens", "5k", "--out", "from-flags")
    assert (flags.distill.tokens, flags.out_dir, flags.lora.lr, flags.distill.loss) == (
        5000,
        "from-flags",
        1e-4,
        "l2",
    )
    assert flags.teacher.model == "file-model"  # the positional was not given: the file's
    assert parse("cli-model", "--config", str(tmp_path / "run.toml")).teacher.model == "cli-model"
    other_recipe = parse("--config", str(tmp_path / "run.toml"), "--recipe", "dof-paper")
    assert other_recipe.recipe == "dof-paper" and other_recipe.lora.enabled is False
    assert other_recipe.distill.loss == "l2" and other_recipe.out_dir == "from-file"


def test_cell_options_given_go_over_the_recipes_key_by_key():
    config = parse("--out", "o", "--recipe", "gated-delta", "--cell-options", "mix=adaptive")
    assert config.student.cell_options == {"window_factor": 0.95, "mix": "adaptive"}
    config.apply_recipe()  # idempotent
    assert config.student.cell_options == {"window_factor": 0.95, "mix": "adaptive"}
    replaced = parse("--out", "o", "--recipe", "gated-delta", "--cell-options", "window_factor=0.9")
    assert replaced.student.cell_options == {"window_factor": 0.9}
    assert parse("--out", "o", "--cell-options", "mix=adaptive").student.cell_options == {"mix": "adaptive"}


def test_per_query_head_gives_the_plan_one_state_per_query_head():
    import torch

    from dofla.convert import convert
    from dofla.models import build_tiny_model
    from dofla.models.surgery import students
    from dofla.pipeline import make_plan

    config = parse("--out", "o", "--recipe", "gated-delta", "--per-query-head")
    assert (
        config.plan.per_query_head and not parse("--out", "o", "--recipe", "gated-delta").plan.per_query_head
    )
    model = build_tiny_model("llama")  # 4 query heads, 2 key/value heads
    plan = make_plan(config, model, torch.zeros(2, 16, dtype=torch.long))
    assert all(not layer.share_kv_heads for layer in plan.layers)
    convert(model, plan)
    assert {student.state_heads for student in students(model).values()} == {model.config.num_attention_heads}


def test_every_setting_has_a_flag_and_every_documented_flag_still_works():
    parser = next(
        action for action in build_parser()._subparsers._group_actions if action.dest == "command"
    ).choices["linearize"]
    flags = {option for action in parser._actions for option in action.option_strings}
    positionals = {action.dest for action in parser._actions if not action.option_strings}
    without_flag = []
    for setting in settings_of():
        if not setting.field.metadata.get("cli", True):
            without_flag.append(setting.key)
        elif setting.flag.startswith("--"):
            assert setting.flag in flags, setting.key
        else:
            assert setting.key in positionals, setting.key
    trainers = ["weight_decay", "warmup_fraction", "min_lr_fraction", "grad_clip", "eval_batches"]
    trainers = [f"distill.{name}" for name in (*trainers, "max_bad_steps", "query_chunk", "temperature")]
    trainers += [
        f"lora.{name}" for name in ("warmup_fraction", "min_lr_fraction", "grad_clip", "temperature")
    ]
    # the command line is recorded by the command itself; the trainers' tuning is set in a config file
    assert without_flag == ["command", *trainers, "lora.max_bad_steps"]
    documented = (
        "--out --recipe --budget --allocation --measure --feature-map --kind --window --cell --sinks "
        "--eval-lengths --heldout-sequences --passkey-trials --loss --tokens --seq-len --batch-size --lr --data "
        "--lora --lora-tokens --lora-rank --lora-alpha --lora-targets --lora-lr --lora-kl --lora-baseline "
        "--kl-weight --eval-every --checkpoint-every --patience --seed --resume --overwrite --no-progress "
        "--dtype --device --config"
    )
    assert set(documented.split()) <= flags


def test_flags_read_every_kind_of_value():
    config = parse(
        "tiny-model",
        "--out",
        "o",
        "--tokens",
        "2M",
        "--lora-tokens",
        "200k",
        "--layers",
        "0,1",
        "--lora-targets",
        "q_proj, v_proj",
        "--cell-options",
        "window_factor=0.9,name=abc",
        "--lr",
        "1e-3",
        "--no-progress",
        "--lora",
    )
    assert (
        config.teacher.model == "tiny-model"
        and config.distill.tokens == 2_000_000
        and config.lora.tokens == 200_000
    )
    assert config.plan.layers == [0, 1] and config.lora.targets == ["q_proj", "v_proj"]
    assert config.student.cell_options == {"window_factor": 0.9, "name": "abc"}
    assert (config.distill.lr, config.progress, config.lora.enabled) == (1e-3, False, True)
    assert parse("--out", "o").teacher.model == "smollm2-135m"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[distill]\ntoknes = 5\n", "unknown setting 'toknes' in [distill] of"),
        (
            "[distill]\ntoknes = 5\n",
            "valid ones: batch_size, checkpoint_every, cuda_graphs, eval_batches, eval_every, grad_clip, kl_weight",
        ),
        ("[model]\nname = 'x'\n", "unknown setting 'model' at the top of"),
        ("lora = 3\n", "[lora] in"),
        (
            "[distill]\nbatch_size = 1.5\n",
            "--batch-size (batch_size in [distill]) must be an integer, got 1.5",
        ),
        ("[distill]\ntokens = 'lots'\n", "--tokens must be a positive number of tokens like 2M"),
        ("[plan]\nlayers = [0, 'a']\n", "--layers (layers in [plan]) must be a list of int"),
        ("[lora]\nenabled = 'yes'\n", "--lora (enabled in [lora]) must be true or false"),
        ("out_dir = 'x'\n[distill]\n", None),
        ("[data]\n", "no output folder: pass --out DIR or set out_dir"),
        ("out_dir = 'x'\n[distill\n", "is not valid TOML"),
    ],
)
def test_a_config_file_with_a_mistake_is_one_sentence(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    if message is None:
        assert load_config(path).out_dir == "x"
        return
    with pytest.raises(DoflaError) as error:
        load_config(path)
    assert message in str(error.value)
    if "unknown setting" in message:
        assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(plan=dict(sinks=-1)), "--sinks must be at least 0, got -1"),
        (dict(plan=dict(layers=[0, -2])), "--layers must be at least 0, got -2"),
        (dict(student=dict(feature_map="nope")), "unknown feature map 'nope'; choose one of:"),
        (
            dict(distill=dict(loss="kl")),
            "unknown loss 'kl'; choose one of: direct, l2, output_mse, projected_mse, softmax, split_mse.",
        ),
        (dict(plan=dict(measure="nope")), "unknown measure 'nope'"),
        (dict(data=dict(heldout_fraction=1.0)), "the held-out fraction must lie in (0, 1), got 1.0"),
        (dict(data=dict(recall_fraction=1.5)), "--recall-fraction must lie in [0, 1], got 1.5"),
        (dict(data=dict(recall_fraction=-0.5)), "--recall-fraction must be at least 0.0, got -0.5"),
        (
            dict(data=dict(recall_fraction=0.5), distill=dict(teacher_states="s", sharding="layers")),
            "without the repeated spans of --recall-fraction; drop one of the two",
        ),
        (dict(lora=dict(needle_fraction=2.0)), "--lora-needles must lie in [0, 1], got 2.0"),
        (dict(lora=dict(needle_fraction=0.5)), "--lora-needles sets rows of the LoRA stage; add --lora"),
        (dict(resume=True, overwrite=True), "pass only one"),
        (dict(lora=dict(enabled=True, lr=0)), "--lora-lr must be a positive number, got 0"),
        (dict(distill=dict(sharding="heads")), "unknown sharding 'heads'; choose one of: data, layers."),
        (dict(distill=dict(teacher_states="states")), "only layer sharding has; add --sharding layers"),
        (
            dict(distill=dict(sharding="layers", loss="direct")),
            "choose a layer-wise --loss or --sharding data",
        ),
        (dict(student=dict(recall_cache=-1)), "--recall-cache must be at least 0, got -1"),
        (
            dict(recipe="gla", student=dict(recall_cache=64)),
            "this run converts to gla (hybrid); give --cell gated_delta --kind hybrid",
        ),
        (
            dict(recipe="gated-delta", student=dict(recall_cache=64, cell_options={"recall_cache": 8})),
            "the cell options recall_cache and heavy_hitters train with it; give one of the two",
        ),
        (
            dict(recipe="gated-delta", student=dict(recall_cache=64), plan=dict(position_period=512)),
            "this run sets --position-period 512; drop it (or set 0) with --recall-cache",
        ),
    ],
)
def test_validation_names_the_setting(settings, message):
    config = LinearizeConfig.from_dict(dict(out_dir="x", **settings))
    with pytest.raises(DoflaError) as error:
        config.validate()
    assert message in str(error.value)


def test_a_recipe_with_needle_rows_runs_without_its_lora_stage_when_told():
    config = LinearizeConfig.from_dict(
        dict(out_dir="x", recipe="gated-delta-retrieval", lora=dict(enabled=False))
    )
    config.validate()  # the recipe's needle rows belong to the stage turned off: nothing to refuse
    assert config.lora.needle_fraction == 0.5 and config.lora.enabled is False


def test_the_trainers_settings_without_a_flag_are_set_in_a_config_file_only():
    config = LinearizeConfig.from_dict(
        dict(out_dir="o", seed=3, distill=dict(grad_clip=0.5, eval_batches=2), lora=dict(max_bad_steps=2))
    )
    # the trainers read these very sections (dofla.distill.trainer.distill, dofla.distill.lora.train_lora)
    assert (config.distill.grad_clip, config.distill.eval_batches, config.lora.max_bad_steps) == (0.5, 2, 2)
    assert parse("--out", "o").distill.grad_clip == 1.0
    with pytest.raises(SystemExit):
        parse("--out", "o", "--grad-clip", "0.5")
    with pytest.raises(DoflaError, match=r"max_bad_steps in \[distill\] must be at least 1, got 0"):
        LinearizeConfig.from_dict(dict(out_dir="o", distill=dict(max_bad_steps=0))).validate()


def test_the_demo_is_the_recall_recipe_sized_for_a_2_core_cpu():
    demo = demo_config("OUT")
    assert (demo.recipe, demo.student.cell, demo.student.feature_map, demo.plan.kind) == (
        "gated-delta-recall",
        "gated_delta",
        "projection",
        "hybrid",
    )
    assert (demo.plan.window, demo.plan.sinks, demo.plan.budget, demo.student.recall_cache) == (96, 4, 64, 0)
    assert demo.student.cell_options == {
        "window_factor": 0.999,
        "recall_cache": 32,
        "heavy_hitters": 64,
    }  # trained with the cache
    assert (
        demo.plan.position_period is None and demo.plan.sinks_at_edge is False
    )  # the cache's true positions
    assert demo.plan.allocation == "fix"  # no DoF measurement: the minutes go to training and measuring
    assert (demo.data.seq_len, demo.data.heldout_sequences, demo.evaluate.lengths) == (1024, 16, [1024])
    assert (demo.data.path, demo.data.heldout_path) == (str(DEMO_TRAIN_TEXT), str(DEMO_HELDOUT_TEXT))
    assert (demo.evaluate.passkey_lengths, demo.evaluate.passkey_trials) == ([2048, 4096], 1)
    assert (demo.evaluate.recall, demo.evaluate.error_sequences) == (False, 0)
    assert (demo.distill.tokens, demo.lora.tokens, demo.lora.seq_len, demo.lora.baseline) == (
        4096,
        6144,
        512,
        True,
    )
    demo.validate()
    from dofla.recipes import plan_for_arguments

    # the students benchmarks build from the recipe are the trained model's: the cache on
    assert plan_for_arguments("gated-delta-recall")["options"] == {
        "window_factor": 0.999,
        "recall_cache": 32,
        "heavy_hitters": 64,
    }
