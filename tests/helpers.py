"""Small shared test helpers (importable because pytest puts tests/ on the path)."""

from dofla.models import build_tiny_model


def small_llama(seed: int = 0):
    """A 2-layer Llama with 4 query / 2 key-value heads of size 8 and 64 tokens (the shapes some tests assert)."""
    return build_tiny_model(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        max_position_embeddings=4096,
        seed=seed,
    )
