"""The real embedded default teacher (SmolLM2-135M from its gguf): cached reload and a sane perplexity."""

import pytest
import torch

from dofla.errors import DoflaError
from dofla.evaluation.perplexity import perplexity
from dofla.models import DEFAULT_TEACHER, load_teacher

PROSE = (
    "The village sat at the edge of a wide valley, where the river slowed and spread into shallow pools. "
    "Every morning the baker opened her shop before sunrise, and the smell of fresh bread drifted down the "
    "main street. Children walked to school along the old stone bridge, stopping to watch the ducks that "
    "gathered under the arches. In the spring, farmers planted wheat and barley in the fields beyond the "
    "church, and in the autumn they brought the harvest to the market in the square. The town council met "
    "once a month in a small hall next to the library. Most of its meetings were quiet, but last year a "
    "long debate about a new road divided the village for several weeks. Some people wanted faster travel "
    "to the city, while others worried about noise and traffic. In the end, the council decided to repair "
    "the old road instead, and most people agreed that it was a sensible choice. Visitors often say that "
    "the valley feels unchanged, even though much of daily life has quietly moved on."
)


@pytest.fixture(scope="module")
def default_teachers(tmp_path_factory):
    """The first load de-quantises the gguf into an empty cache; the second reads the cached copy."""
    cache = tmp_path_factory.mktemp("default_teacher_cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("DOFLA_CACHE", str(cache))
    try:
        first = load_teacher(DEFAULT_TEACHER, device="cpu")
        second = load_teacher(DEFAULT_TEACHER, device="cpu")
    except DoflaError as error:
        if "wheel" in str(error):
            pytest.skip(str(error))
        raise
    finally:
        patch.undo()
    return first, second


@pytest.mark.slow
def test_default_teacher_architecture_and_cached_reload(default_teachers):
    first, second = default_teachers
    assert "de-quantised now" in first.source and "de-quantised now" not in second.source
    adapter = second.adapter
    assert (adapter.model_type, adapter.num_layers, adapter.num_heads, adapter.num_kv_heads) == (
        "llama",
        30,
        9,
        3,
    )
    assert (adapter.head_dim, adapter.hidden_size, adapter.layer_kinds) == (64, 576, ["full"] * 30)
    assert next(second.model.parameters()).dtype == torch.float32
    assert not getattr(second.model, "is_quantized", False)
    ids = second.tokenizer(PROSE[:200], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            second.model(input_ids=ids).logits, first.model(input_ids=ids).logits, rtol=0, atol=0
        )
    assert second.tokenizer(PROSE)["input_ids"] == first.tokenizer(PROSE)["input_ids"]


@pytest.mark.slow
def test_default_teacher_perplexity_on_plain_prose_is_sane(default_teachers):
    teacher = default_teachers[1]
    ids = torch.tensor([teacher.tokenizer(PROSE, add_special_tokens=False)["input_ids"]])  # (1, T)
    assert ids.shape[1] > 150
    result = perplexity(teacher.model, ids)
    assert result["tokens"] == ids.shape[1] - 1
    assert 5 < result["perplexity"] < 60, result
