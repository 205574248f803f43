"""Lay out a Hugging Face cache as `hf_hub_download` leaves it, without a network.

``models--org--name/blobs/<sha256>`` holds each file's bytes (the Hub names LFS blobs by their
sha256), ``snapshots/<commit>/<path>`` links to the blob, ``refs/main`` holds the commit. The
links and refs are written by huggingface_hub's own helpers, so the layout is the library's.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def write_cached_repo(
    cache: Path,
    repo_id: str,
    files: dict[str, Path | bytes],
    *,
    commit: str | None = None,
    ref: str | None = "main",
    repo_type: str = "model",
) -> Path:
    """Put ``files`` (repo path -> source file or bytes) in the cache; returns the snapshot dir."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    for rel, source in files.items():
        digest = hashlib.sha256()
        if isinstance(source, bytes):
            digest.update(source)
        else:
            with open(source, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        blob = storage / "blobs" / digest.hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if isinstance(source, bytes):
                blob.write_bytes(source)
            else:
                shutil.copyfile(source, blob)
        pointer = storage / "snapshots" / commit / rel
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
    if ref is not None:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    return storage / "snapshots" / commit


def tiny_checkpoint_files() -> dict[str, bytes]:
    """A two-tensor safetensors checkpoint with its config and tokenizer config."""
    import json

    import numpy as np
    from safetensors.numpy import save

    weights = save({"model.embed_tokens.weight": np.zeros((8, 4), np.float32), "lm_head.weight": np.ones((8, 4), np.float32)})
    config = {
        "model_type": "llama",
        "hidden_size": 4,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
        "vocab_size": 8,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    return {
        "config.json": json.dumps(config).encode(),
        "model.safetensors": weights,
        "tokenizer_config.json": b"{}",
        "README.md": b"# tiny\n",
    }
