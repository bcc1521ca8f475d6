"""``dofla generate``: continue a prompt with a converted model, streaming tokens as they come."""

from __future__ import annotations

import argparse

from dofla.commands._common import (
    add_position_arguments,
    add_threads_argument,
    apply_position_arguments,
    check_device_and_dtype,
    check_position_arguments,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a converted model folder (streams tokens)",
        description="Load a folder written by `dofla convert` (or `dofla linearize`) and continue --prompt, "
        "printing each token as it is produced. Greedy by default; --sample draws tokens.",
    )
    parser.add_argument("converted", help="folder written by `dofla convert` or `dofla linearize`")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--prompt-file", help="UTF-8 text file to continue (for long prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --sample)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for --sample")
    parser.add_argument(
        "--teacher", default=None, help="teacher for a student-only folder (default: the recorded one)"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="feed the prompt in pieces of this many tokens, each continuing the cache (a converted model then "
        "holds one piece's activations whatever the prompt length); 0: one forward (default)",
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="decode greedily from one captured CUDA graph per generation (CUDA only; layers kept as softmax "
        "must attend to every token; with a window, prompts at least as long as it): a decoding step without "
        "Python's launch cost, many times faster at small batch",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the CPU's compiled decoding: greedy, the whole decoding step (every layer, the MLP and the "
        "output head) as one program compiled by torch.compile once the windows are full (ordinary steps "
        "until then), where the model allows it (layers kept as softmax attending to every token). "
        "Compiling takes minutes the first time and seconds once torch has cached it on disk: for long "
        "generations",
    )
    add_position_arguments(parser)
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    add_threads_argument(parser)
    parser.set_defaults(func=run)


def check_arguments(args: argparse.Namespace) -> None:
    from dofla.errors import DoflaError

    if args.prompt_file is not None:
        args.prompt = read_prompt_file(args.prompt_file, args.converted)
    if not args.prompt.strip():
        where = f"--prompt-file {args.prompt_file}" if args.prompt_file is not None else "--prompt"
        raise DoflaError(f"{where} is empty; give some text for the model to continue.")
    if args.max_new_tokens <= 0:
        raise DoflaError(f"--max-new-tokens must be positive, got {args.max_new_tokens}.")
    if args.sample and not args.temperature > 0:
        raise DoflaError(f"--temperature must be positive, got {args.temperature}; drop --sample for greedy.")
    if not 0 < args.top_p <= 1:
        raise DoflaError(f"--top-p must lie in (0, 1], got {args.top_p}.")
    if args.prefill_chunk < 0:
        raise DoflaError(
            f"--prefill-chunk must be 0 (one forward) or a positive token count, got {args.prefill_chunk}."
        )
    check_position_arguments(args)
    check_device_and_dtype(args)
    if args.compile and args.graph:
        raise DoflaError("--compile is the CPU's compiled step and --graph the GPU's CUDA graph; give one.")
    if args.compile:
        import torch

        if args.sample:
            raise DoflaError("--compile decodes greedily; drop --sample, or --compile to sample.")
        on_cuda = str(args.device).startswith("cuda") if args.device else torch.cuda.is_available()
        if on_cuda:
            raise DoflaError("--compile compiles the CPU's decoding steps; on a GPU use --graph instead.")
    if args.graph:
        import torch

        if args.sample:
            raise DoflaError("--graph decodes greedily; drop --sample, or --graph to sample.")
        on_cuda = str(args.device).startswith("cuda") if args.device else torch.cuda.is_available()
        if not on_cuda:
            raise DoflaError(
                "--graph needs a CUDA GPU (it replays a CUDA graph); on a CPU use --compile instead."
            )


PROMPT_CONTEXTS = 4  # a prompt file may hold this many times the model's context
PROMPT_BYTES_PER_TOKEN = 4  # about what a token of English text holds, in UTF-8 bytes
PROMPT_BYTES_UNKNOWN_CONTEXT = 1 << 20  # the bound where the folder's config names no context


def model_context(folder: str) -> int | None:
    """The longest sequence a model folder's ``config.json`` allows (its text part's), if it says; read
    without loading anything (None if the file is missing or damaged: loading then says so)."""
    import json
    from pathlib import Path

    from dofla.data import CONTEXT_FIELDS

    try:
        config = json.loads((Path(folder).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sections = [config]  # a converted folder's settings, its teacher's (base_config), their text part's
    while sections:
        section = sections.pop()
        if not isinstance(section, dict):
            continue
        for name in CONTEXT_FIELDS:
            value = section.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        sections += [section.get("base_config"), section.get("text_config")]
    return None


def read_prompt_file(path: str, converted: str) -> str:
    """The prompt file's text, refused unread if it is larger than ``PROMPT_CONTEXTS`` times the model's
    context could hold."""
    from pathlib import Path

    from dofla.errors import DoflaError

    file = Path(path).expanduser()
    if not file.is_file():
        raise DoflaError(f"--prompt-file {path} is not a file; give a UTF-8 text file.")
    context = model_context(converted)
    limit = PROMPT_CONTEXTS * PROMPT_BYTES_PER_TOKEN * context if context else PROMPT_BYTES_UNKNOWN_CONTEXT
    size = file.stat().st_size
    if size > limit:
        bound = (
            f"{PROMPT_CONTEXTS} times the model's context of {context:,} tokens at about "
            f"{PROMPT_BYTES_PER_TOKEN} bytes a token"
            if context
            else "its config names no context"
        )
        raise DoflaError(
            f"--prompt-file {path} holds {size:,} bytes, more than a prompt of this model can be ({limit:,} "
            f"bytes: {bound}); give the part of the text the model should continue."
        )
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DoflaError(
            f"--prompt-file {path} is not UTF-8 text ({error.reason}); save it as UTF-8."
        ) from None


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    import torch
    from transformers import TextStreamer

    from dofla.errors import DoflaError
    from dofla.loading import load_converted

    model, tokenizer, _ = load_converted(
        args.converted, teacher=args.teacher, dtype=args.dtype, device=args.device
    )
    apply_position_arguments(model, args)
    if tokenizer is None:
        raise DoflaError(
            f"{args.converted} has no tokenizer files; save it with its tokenizer to generate text."
        )
    if args.graph or args.compile:
        from dofla.graph_decode import check_graph_decodable

        check_graph_decodable(model)
    device = next(model.parameters()).device
    inputs = tokenizer(args.prompt, return_tensors="pt").to(device)
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    if args.graph or args.compile:
        from dofla.graph_decode import generate_greedy

        generate_greedy(
            model,
            inputs["input_ids"],
            args.max_new_tokens,
            prefill_chunk=args.prefill_chunk or None,
            eos_token_id=tokenizer.eos_token_id,
            on_tokens=streamer.put,
            compiled=args.compile,
        )
        streamer.end()
        return 0
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, streamer=streamer)
    if args.prefill_chunk:
        options.update(prefill_chunk_size=args.prefill_chunk)
    if args.sample:
        torch.manual_seed(args.seed)
        options.update(temperature=args.temperature, top_p=args.top_p)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        model.generate(**inputs, pad_token_id=pad, **options)
    return 0
