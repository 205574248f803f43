"""What the user typed as SRC -> an open `ModelSource` (checkpoint directory, GGUF file, repo id)."""

from __future__ import annotations

import os
from pathlib import Path

from llmlocal.models.errors import ModelNotFoundError

from .checkpoint import open_checkpoint
from .errors import CheckpointError
from .gguf_source import open_gguf
from .hub import cached_snapshot, looks_like_repo_id
from .source import ModelSource


def open_source(src: str | os.PathLike[str]) -> ModelSource:
    """Open ``src``: a checkpoint directory, a .gguf file, or a Hub repo id found in the cache."""
    text = os.fspath(src)
    path = Path(text).expanduser()
    name: str | None = None
    if not path.exists():
        if not looks_like_repo_id(text):
            raise ModelNotFoundError(
                f"{text} does not exist: pass a checkpoint directory, a .gguf file or a Hugging Face repo id (org/name)."
            )
        path = cached_snapshot(text)
        name = text.partition("@")[0].split("/")[-1]
    if path.is_file():
        return open_gguf(path)
    if (path / "config.json").is_file():
        return open_checkpoint(path, name=name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return open_gguf(ggufs[0])
    raise CheckpointError(
        f"{path} has no config.json"
        + (f" and {len(ggufs)} .gguf files" if ggufs else "")
        + ": pass a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) or one .gguf file."
    )
