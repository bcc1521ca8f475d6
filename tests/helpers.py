"""Small shared test helpers (importable because pytest puts tests/ on the path)."""

import torch

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


def assert_student_forms_agree(student, query, key, value):
    """The chunked and recurrent forms of ``student`` match its naive form, output and gradients (of the
    inputs and every trainable parameter); returns the naive output and gradients for further checks."""
    results = {}
    for form in ("naive", "chunked", "recurrent"):
        output = student(query, key, value, form=form)  # (B, T, H, D)
        weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
        inputs = [query, key, value, *student.trainable_parameters()]
        results[form] = (output.detach(), torch.autograd.grad((output * weights).sum(), inputs))
    reference_output, reference_gradients = results["naive"]
    for form in ("chunked", "recurrent"):
        output, gradients = results[form]
        torch.testing.assert_close(output, reference_output, rtol=1e-9, atol=1e-10)
        for got, expected in zip(gradients, reference_gradients, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)
    return reference_output, reference_gradients


def training_config(*, seed: int = 0, progress: bool = False, lora: dict | None = None, **distill):
    """A run's settings tree for the trainers (:func:`dofla.distill.trainer.distill`,
    :func:`dofla.distill.lora.train_lora`): ``distill`` keyword arguments set the distill section, ``lora``
    the LoRA section; the output folder is never read by them."""
    from dofla.run_config import LinearizeConfig
    from dofla.settings import DistillSettings, LoraSettings

    return LinearizeConfig(
        out_dir="unused",
        seed=seed,
        progress=progress,
        distill=DistillSettings(**distill),
        lora=LoraSettings(**(lora or {})),
    )


def count_calls(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` for the test by a wrapper that records each call (the list returned grows by
    one per call) and passes it on."""
    calls, function = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
