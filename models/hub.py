"""Hugging Face Hub names -> files in huggingface_hub's own cache, and downloads into it.

A Hub name is ``org/repo``, optionally ``@revision`` and ``:SELECTOR``:

    bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M   the Q4_K_M GGUF file(s) of that repo
    Qwen/Qwen2.5-0.5B-Instruct                    a safetensors checkpoint (or a repo's only GGUF)
    org/repo@v1.0:model-f16                       a GGUF picked by file name, at a tag

Looking a name up never touches the network: only `download` does, and only when the user
asked for it (`llmlocal models pull`). The cache is huggingface_hub's standard layout
(``models--org--repo/{refs,blobs,snapshots}``), found from ``HF_HUB_CACHE`` / ``HF_HOME`` at
call time; tokens come from huggingface_hub (``HF_TOKEN``, ``hf auth login``).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .errors import LLMLocalError, ModelNotFoundError

if TYPE_CHECKING:
    from .progress import Progress

# org/repo as the Hub allows it, then optional @revision and :selector.
_HUB_NAME = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+?))?(?::(?P<sel>[\w./-]+))?$"
)
# A quantization label inside a GGUF file name: Q4_K_M, Q8_0, IQ2_XXS, TQ1_0, Q4_0_4_4, F16,
# BF16... bounded by a non-alphanumeric character on both sides.
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:[IT]?Q\d{1,2}(?:_[A-Z0-9]{1,3})*)|BF16|F16|FP16|F32|MXFP4)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# Split GGUFs: name-00001-of-00003.gguf; llama.cpp loads the rest from the first.
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What a safetensors checkpoint needs (config, weights, tokenizer): what `pull` fetches.
CHECKPOINT_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
)


@dataclass(frozen=True)
class HubName:
    repo_id: str
    revision: str | None = None
    selector: str | None = None  # a quant label (Q4_K_M) or a GGUF file name

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sel = f":{self.selector}" if self.selector else ""
        return f"{self.repo_id}{rev}{sel}"

    def with_selector(self, selector: str | None) -> HubName:
        return HubName(self.repo_id, self.revision, selector)


def parse_hub_name(text: str) -> HubName | None:
    """The Hub name in ``text``, or None if it does not look like one (a path, a starter name)."""
    if text.endswith((".gguf", ".safetensors", ".json")) and ":" not in text:
        return None
    m = _HUB_NAME.match(text)
    if m is None:
        return None
    return HubName(m["repo"], m["rev"], m["sel"])


def quant_label(filename: str) -> str | None:
    """The quantization named in a GGUF file name (upper case), if any: the last one wins, as
    names like ``Llama-3-8B-Q4_K_M.gguf`` put it at the end."""
    found = _QUANT.findall(os.path.basename(filename))
    return found[-1].upper() if found else None


# ---- the cache --------------------------------------------------------------------------
def cache_dir() -> Path:
    """huggingface_hub's cache directory, read from the environment now (not at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(env["HF_HUB_CACHE"])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` set now, or when huggingface_hub was imported."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def repo_dir(repo_id: str) -> Path:
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``revision`` (default: the ``main`` ref), from
    the cache alone. A repo cached without a ``main`` ref but with one snapshot uses that one."""
    root = repo_dir(repo_id)
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        return None
    rev = revision or "main"
    if _COMMIT.match(rev) and (snapshots / rev).is_dir():
        return snapshots / rev
    ref = root / "refs" / rev
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        return snap if snap.is_dir() else None
    if revision is None:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
        if len(found) == 1:
            return found[0]
    return None


def snapshot_files(snapshot: Path) -> list[str]:
    """Relative paths (with '/') of the files present in a snapshot directory."""
    out = []
    for dirpath, _, names in os.walk(snapshot):
        for n in names:
            full = Path(dirpath) / n
            if full.exists():  # a dangling link (blob removed) is not a file we have
                out.append(full.relative_to(snapshot).as_posix())
    return sorted(out)


# ---- which files a name means -----------------------------------------------------------
def gguf_variants(files: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """GGUF models in a list of repo files: key -> the file(s) of one model (shards in order).

    The key is the quantization label of the file name (``Q4_K_M``) when that is unique in
    the repo, else the file name without ``.gguf``. Vision projectors (``mmproj-*``) are not
    models of their own and are left out.
    """
    by_stem: dict[str, list[str]] = defaultdict(list)
    for f in files:
        base = os.path.basename(f)
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        by_stem[_SHARD.sub(".gguf", f)].append(f)
    by_label: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)
    for stem, shards in by_stem.items():
        label = quant_label(stem) or _file_key(os.path.basename(stem))
        by_label[label].append((stem, sorted(shards)))
    variants: dict[str, tuple[str, ...]] = {}
    for label, entries in by_label.items():
        if len(entries) == 1:
            variants[label] = tuple(entries[0][1])
        else:  # two files carry the same label: name them by their path in the repo instead
            for stem, shards in entries:
                variants[_file_key(stem)] = tuple(shards)
    return dict(sorted(variants.items()))


def _file_key(path: str) -> str:
    return path[: -len(".gguf")] if path.lower().endswith(".gguf") else path


def is_checkpoint(files: Iterable[str]) -> bool:
    """A safetensors checkpoint at the top of the repo (config.json + *.safetensors)."""
    top = {f for f in files if "/" not in f}
    return "config.json" in top and any(f.endswith(".safetensors") for f in top)


def select_gguf(name: HubName, files: list[str], *, where: str) -> tuple[str, tuple[str, ...]]:
    """(key, files) of the GGUF that ``name`` picks among ``files``; ``where`` says whose list
    it is ("the repo", "the cache") for the error message."""
    variants = gguf_variants(files)
    if name.selector is None:
        if len(variants) == 1:
            return next(iter(variants.items()))
        choices = ", ".join(variants)
        raise LLMLocalError(
            f"{name} has {len(variants)} GGUF models ({choices}): name one, e.g. `{name.with_selector(next(iter(variants)))}`."
        )
    wanted = name.selector.lower().removesuffix(".gguf")
    for key, shards in variants.items():
        if key.lower() == wanted:
            return key, shards
    if not variants:
        raise ModelNotFoundError(f"{where.capitalize()} has no GGUF file in {name.repo_id}: pick another repo or drop ':{name.selector}'.")
    raise ModelNotFoundError(
        f"{where.capitalize()} has no '{name.selector}' GGUF in {name.repo_id}: choose one of {', '.join(variants)}."
    )


def pull_hint(name: HubName | str) -> str:
    return f"`llmlocal models pull {name}`"


def cached_model(name: HubName) -> tuple[str, Path]:
    """(canonical name, local path) of a Hub name from the cache alone: the first GGUF file of
    the picked model, or the snapshot directory of a safetensors checkpoint.

    Raises `ModelNotFoundError` naming the pull command when it is not downloaded.
    """
    snap = cached_snapshot(name.repo_id, name.revision)
    if snap is None:
        raise ModelNotFoundError(f"{name} is not downloaded: run {pull_hint(name)}.")
    files = snapshot_files(snap)
    if name.selector is None and is_checkpoint(files):
        return str(name), snap
    variants = gguf_variants(files)
    if not variants:
        raise ModelNotFoundError(f"{name} is not downloaded: run {pull_hint(name)}.")
    try:
        key, shards = select_gguf(name, files, where="the cache")
    except ModelNotFoundError:
        have = ", ".join(variants)
        raise ModelNotFoundError(f"{name} is not downloaded (the cache has {have}): run {pull_hint(name)}.") from None
    return str(name.with_selector(key)), snap / shards[0]


def cached_checkpoint(repo: str) -> Path:
    """The snapshot directory of a cached safetensors checkpoint ``org/name[@revision]``
    (what `llmlocal quantize` converts); raises naming the pull command if it is missing."""
    name = parse_hub_name(repo)
    if name is None:
        raise ModelNotFoundError(f"'{repo}' is not a Hugging Face repo id: pass org/name or a checkpoint directory.")
    snap = cached_snapshot(name.repo_id, name.revision)
    if snap is None or not is_checkpoint(snapshot_files(snap)):
        raise ModelNotFoundError(f"{repo} is not downloaded: run {pull_hint(repo)}, or pass a checkpoint directory.")
    return snap


# ---- downloads --------------------------------------------------------------------------
@dataclass(frozen=True)
class Download:
    name: str  # canonical: org/repo:QUANT for a GGUF, org/repo for a checkpoint
    path: Path  # first GGUF file, or the checkpoint's snapshot directory
    kind: str  # "gguf" or "checkpoint"
    files: tuple[str, ...]  # repo-relative paths fetched
    from_cache: bool  # nothing had to be fetched (offline, already there)


def download(name: HubName, *, token: str | None = None, stream: TextIO | None = None) -> Download:
    """Fetch what ``name`` needs into the cache (resumable), showing llmlocal's progress bar on
    ``stream`` (default stderr; a terminal gets a bar, anything else a line every tenth).

    Offline (``HF_HUB_OFFLINE``) a cached model is returned as is and a missing one raises.
    """
    if is_offline():
        try:
            canonical, path = cached_model(name)
        except ModelNotFoundError:
            raise ModelNotFoundError(
                f"{name} is not downloaded and HF_HUB_OFFLINE is set: unset it and run {pull_hint(name)} again."
            ) from None
        kind = "checkpoint" if path.is_dir() else "gguf"
        return Download(canonical, path, kind, (), from_cache=True)

    files = _repo_files(name, token)
    if name.selector is None and is_checkpoint(files):
        wanted: tuple[str, ...] = tuple(f for f in files if _is_checkpoint_file(f))
        canonical, kind = str(name), "checkpoint"
    else:
        key, wanted = select_gguf(name, files, where="the repo")
        canonical, kind = str(name.with_selector(key)), "gguf"
    from .progress import Progress

    progress = Progress(f"downloading {canonical}", 0, stream=stream)
    try:
        snap = _snapshot_download(name, list(wanted), token, progress)
    finally:
        progress.close()
    path = snap if kind == "checkpoint" else snap / wanted[0]
    return Download(canonical, path, kind, wanted, from_cache=False)


def _is_checkpoint_file(path: str) -> bool:
    from fnmatch import fnmatch

    return "/" not in path and any(fnmatch(path, p) for p in CHECKPOINT_PATTERNS)


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport errors of whichever HTTP client this huggingface_hub uses."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module, attr in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(__import__(module), attr))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _hub_errors(name: HubName, error: BaseException) -> LLMLocalError | None:
    """One sentence for the Hub's refusals; None for errors that are bugs."""
    from huggingface_hub import errors as hf_errors

    if isinstance(error, hf_errors.GatedRepoError):
        return LLMLocalError(
            f"{name.repo_id} is gated: accept its terms on its Hub page, log in with `hf auth login`, and pull again."
        )
    if isinstance(error, hf_errors.RepositoryNotFoundError):
        return ModelNotFoundError(
            f"There is no Hugging Face repo {name.repo_id} (or it is private): check the name, or log in with `hf auth login`."
        )
    if isinstance(error, hf_errors.RevisionNotFoundError):
        return ModelNotFoundError(f"{name.repo_id} has no revision '{name.revision}': check the name after '@'.")
    if isinstance(error, _network_errors()):
        return LLMLocalError(
            f"Cannot reach the Hugging Face Hub to fetch {name}: check the network connection and run {pull_hint(name)} again."
        )
    if isinstance(error, hf_errors.HfHubHTTPError):
        return LLMLocalError(f"The Hugging Face Hub refused {name} ({error}): try {pull_hint(name)} again later.")
    return None


def _repo_files(name: HubName, token: str | None) -> list[str]:
    # model_info makes one request (no retries), so "no network" is told at once; the
    # downloads themselves retry, which is what a flaky connection needs.
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(name.repo_id, revision=name.revision, token=token)
    except Exception as e:
        err = _hub_errors(name, e)
        if err is None:
            raise
        raise err from None
    return sorted(s.rfilename for s in info.siblings or ())


def _snapshot_download(name: HubName, files: list[str], token: str | None, progress: Progress) -> Path:
    # snapshot_download fetches the files in parallel into blobs/<hash>.incomplete (resumed on
    # the next try) and links them into snapshots/<commit>/; its bars report into ``progress``.
    from huggingface_hub import snapshot_download

    from .progress import hub_progress_class

    try:
        return Path(
            snapshot_download(
                name.repo_id,
                revision=name.revision,
                cache_dir=cache_dir(),
                allow_patterns=files,
                token=token,
                tqdm_class=hub_progress_class(progress),
            )
        )
    except Exception as e:
        err = _hub_errors(name, e)
        if err is None:
            raise
        raise err from None
