"""Teachers: loading, the per-family architecture table, q/k/v capture, tiny test models."""

from dofla.models.adapters import FAMILIES, ArchitectureAdapter, get_adapter
from dofla.models.capture import capture_attention
from dofla.models.loading import DEFAULT_TEACHER, Teacher, load_teacher
from dofla.models.tiny import TINY_FAMILIES, build_tiny_model, build_tiny_tokenizer, save_tiny_model_folder

__all__ = [
    "DEFAULT_TEACHER",
    "FAMILIES",
    "TINY_FAMILIES",
    "ArchitectureAdapter",
    "Teacher",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "capture_attention",
    "get_adapter",
    "load_teacher",
    "save_tiny_model_folder",
]
