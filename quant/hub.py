"""Hugging Face repo ids -> checkpoint directories, from the local cache only.

`llmlocal quantize org/name` converts a model the user has already downloaded; it never
downloads (that is `llmlocal models pull`, owned by `llmlocal.models`, which will take this
lookup over). The cache is huggingface_hub's own (``HF_HOME`` / ``HF_HUB_CACHE``).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmlocal.models.errors import ModelNotFoundError

# org/name, optionally @revision; each part as the Hub allows it.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and not text.endswith((".gguf", ".safetensors", ".json"))


def cached_snapshot(repo: str) -> Path:
    """The local snapshot directory of ``repo`` ("org/name" or "org/name@revision")."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise ModelNotFoundError(
            f"{repo} is not in the local Hugging Face cache: download it first (`hf download {repo_id}`) "
            "or pass the path of a checkpoint directory."
        ) from None
