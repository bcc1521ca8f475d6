"""Tiny random models of every supported family, built from configs (tests and examples; no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

TINY_FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "gpt2",
    "gpt_neox",
)
TINY_VOCAB = 128

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
_FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
    # query_pre_attn_scalar differs from head_dim so the scaling (32 ** -0.5, not 16 ** -0.5) is exercised.
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 32}),
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "vocab_size": TINY_VOCAB}),
    "gpt_neox": ("gpt_neox", {"num_key_value_heads": None, "head_dim": None}),
}


def tiny_config(family: str, **overrides):
    """A transformers config of a 2-layer, 64-wide model of ``family`` (4 heads, 2 key/value heads where possible)."""
    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    model_type, specific = _FAMILY_CONFIGS[family]
    if family == "gpt2":
        options = dict(specific)
    else:
        options = {**_COMMON, **specific}
        options = {key: value for key, value in options.items() if value is not None}
    options.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    options.update(overrides)
    return AutoConfig.for_model(model_type, **options)


def build_tiny_model(family: str, *, seed: int = 0, **config_overrides) -> PreTrainedModel:
    """A tiny random float32 causal LM of ``family`` in eval mode, reproducible for a seed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **config_overrides))
    return model.float().eval()


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with :data:`TINY_VOCAB` ids, built offline.

    Ids: 0 <pad> (also unknown), 1 <s>, 2 </s>, then newline and the printable ASCII characters. The
    byte-level spellings of space and newline ("Ġ", "Ċ") get ids too, because transformers swaps in a
    byte-level pre-tokenizer when it loads a Qwen2 folder; text round-trips either way.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    characters = ["\n", *(chr(code) for code in range(32, 127)), "\u0120", "\u010a"]
    vocabulary = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocabulary.update({character: index + 3 for index, character in enumerate(characters)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )


def save_tiny_model_folder(family: str, path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny model and tokenizer as a Hugging Face folder loadable by ``from_pretrained``."""
    path = Path(path)
    build_tiny_model(family, seed=seed).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path
