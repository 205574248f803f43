"""What the user typed as SRC -> an open `ModelSource` (checkpoint directory, GGUF file, repo id)."""

from __future__ import annotations

import os
from pathlib import Path

from llmlocal.models.errors import ModelNotFoundError
from llmlocal.models.hub import cached_snapshot, parse_hub_name, pull_hint

from .checkpoint import open_checkpoint
from .errors import CheckpointError
from .gguf_source import open_gguf
from .source import ModelSource


def open_source(src: str | os.PathLike[str]) -> ModelSource:
    """Open ``src``: a checkpoint directory, a .gguf file, or a Hub repo id found in the cache."""
    text = os.fspath(src)
    path = Path(text).expanduser()
    name: str | None = None
    if not path.exists():
        hub = parse_hub_name(text)  # the same repo ids, and the same cache lookup, as `llmlocal models`
        if hub is None or hub.selector:
            raise ModelNotFoundError(
                f"{text} does not exist: pass a checkpoint directory, a .gguf file or a Hugging Face repo id (org/name)."
            )
        snapshot = cached_snapshot(hub.repo_id, hub.revision)
        if snapshot is None:
            raise ModelNotFoundError(
                f"{text} is not in the local Hugging Face cache: download it first ({pull_hint(text)} or "
                f"`hf download {hub.repo_id}`) or pass the path of a checkpoint directory."
            )
        path, name = snapshot, hub.repo_id.split("/")[-1]
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
