"""Every app test runs with its own, empty settings file: the user's real config is never read
or written (subprocesses inherit the variable)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path_factory.mktemp("config") / "config.toml"
    monkeypatch.setenv("LLMLOCAL_CONFIG", str(path))
    return path
