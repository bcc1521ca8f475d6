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


def _rotary_permute(weight, num_heads: int):
    """llama.cpp's layout of q/k projection rows (interleaved rotary halves); transformers undoes it on load."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def save_tiny_gguf(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama of :func:`build_tiny_model` as an unquantised (float32) .gguf file.

    Loading it with transformers gives exactly the weights of ``build_tiny_model("llama", seed=seed)``.
    Its byte-level token list gives the ids of :func:`build_tiny_tokenizer` to ordinary text.
    """
    import gguf

    model = build_tiny_model("llama", seed=seed)
    config = model.config
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    # The tiny tokenizer's characters in byte-level spelling (space "Ġ", newline "Ċ"), same ids.
    characters = ["\u010a", "\u0120", *(chr(code) for code in range(33, 127))]
    tokens = ["<pad>", "<s>", "</s>", *characters]
    tokens += ["~~", *(f"<unused{index}>" for index in range(config.vocab_size - len(tokens) - 1))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, *[1] * (len(tokens) - 3)])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(["~ ~"])  # one merge (of a rare pair), so the file's merge list is not empty
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for layer in range(config.num_hidden_layers):
        names.update(
            {
                f"model.layers.{layer}.{ours}.weight": f"blk.{layer}.{theirs}.weight"
                for ours, theirs in parts.items()
            }
        )
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = _rotary_permute(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _rotary_permute(array, config.num_key_value_heads)
        writer.add_tensor(names[name], array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
