"""The wheel carries every package: pyproject.toml lists its packages by name (each top-level
folder is a subpackage of `llmlocal`), so a new folder with an __init__.py must be added there,
or the editable install (which finds it on disk) works while the wheel lacks it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *rel.parts]))
    assert on_disk - listed == set(), f"add these to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but not on disk: {sorted(listed - on_disk)}"
