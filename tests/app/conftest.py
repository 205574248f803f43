"""Every app test runs with its own, empty settings file and KV cache directory: the user's real
config and cache are never read or written (subprocesses inherit the variables)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path_factory.mktemp("config") / "config.toml"
    monkeypatch.setenv("LLMLOCAL_CONFIG", str(path))
    monkeypatch.setenv("LLMLOCAL_KV_CACHE_DIR", str(tmp_path_factory.mktemp("kv")))
    return path
