"""`llmlocal models default`: pull -> default -> list -> run, against a Hugging Face cache laid
out by the test (huggingface_hub's own structure), offline."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from hf_cache import write_cached_repo
from llmlocal.app.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = "test-org/Tiny-GGUF"
LLMLOCAL = [sys.executable, "-m", "llmlocal.app"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_gguf) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LLMLOCAL_MODELS_DIR", str(tmp_path / "local"))
    cache = tmp_path / "hf" / "hub"
    write_cached_repo(
        cache,
        REPO,
        {"Tiny-Q4_K_M.gguf": make_gguf(name="a.gguf", layers=2), "Tiny-Q8_0.gguf": make_gguf(name="b.gguf", layers=3)},
    )
    return cache


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def saved(config: Path) -> dict:
    return tomllib.loads(config.read_text()) if config.exists() else {}


def defaults_listed(capsys: pytest.CaptureFixture[str]) -> list[str]:
    code, out, _ = run(capsys, "models", "list", "--json")
    assert code == 0
    return [m["name"] for m in json.loads(out) if m["default"]]


def test_pull_then_default_then_list_then_remove(cache: Path, isolated_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert defaults_listed(capsys) == ["smollm2-135m"]
    code, out, err = run(capsys, "models", "list")
    assert "Default model: smollm2-135m (built-in)" in err
    assert "Default model" not in out  # the table stays one row per model

    code, out, _ = run(capsys, "models", "pull", f"{REPO}:Q4_K_M")
    assert code == 0
    assert out.splitlines()[-1] == f"Make it the default: llmlocal models default {REPO}:Q4_K_M"
    assert "[y/N]" not in out and not isolated_config.exists()  # no question without a terminal

    code, out, _ = run(capsys, "models", "default", f"{REPO}:q4_k_m")  # stored as it is listed
    assert code == 0 and out.strip() == f"Default model: {REPO}:Q4_K_M (saved in {isolated_config})."
    assert saved(isolated_config) == {"model": f"{REPO}:Q4_K_M"}
    assert defaults_listed(capsys) == [f"{REPO}:Q4_K_M"]
    _, _, err = run(capsys, "models", "list")
    assert f"Default model: {REPO}:Q4_K_M (set in the config file)." in err
    code, out, _ = run(capsys, "models", "default")
    assert out.strip() == f"{REPO}:Q4_K_M"
    code, out, _ = run(capsys, "models", "pull", f"{REPO}:Q4_K_M")
    assert out.splitlines()[-1] == f"{REPO}:Q4_K_M is the default model."

    code, out, _ = run(capsys, "models", "rm", f"{REPO}:Q4_K_M", "--yes")
    assert code == 0 and "It was the default model: the default is the built-in smollm2-135m again." in out
    assert saved(isolated_config) == {}
    assert defaults_listed(capsys) == ["smollm2-135m"]


def test_a_default_that_does_not_resolve_is_refused(cache: Path, isolated_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "models", "default", "test-org/elsewhere:Q4_K_M")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "llmlocal models pull test-org/elsewhere:Q4_K_M" in err
    code, _, err = run(capsys, "models", "default", str(tmp_path / "nothing.gguf"))
    assert code == 2 and "No model named" in err
    assert not isolated_config.exists()


def test_a_relative_path_is_stored_absolute(cache: Path, isolated_config: Path, tmp_path: Path, make_gguf,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    mine = make_gguf(name="mine.gguf")
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "models", "default", "mine.gguf")[0] == 0
    assert saved(isolated_config) == {"model": str(mine)}
    _, _, err = run(capsys, "models", "list")
    assert f"Default model: {mine} (set in the config file), not in this list" in err


def test_pull_at_a_terminal_offers_to_make_it_the_default(cache: Path, isolated_config: Path) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen([*LLMLOCAL, "models", "pull", f"{REPO}:Q8_0"], stdin=slave, stdout=slave, stderr=slave,
                            env=dict(os.environ), close_fds=True)
    os.close(slave)
    seen = b""
    try:
        seen = _read_until(master, b"[y/N]", seen)
        assert f"Make {REPO}:Q8_0 the default model?".encode() in seen
        os.write(master, b"y\n")
        seen = _read_until(master, b"saved in", seen)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert saved(isolated_config) == {"model": f"{REPO}:Q8_0"}


def _read_until(fd: int, marker: bytes, seen: bytes, timeout: float = 60) -> bytes:
    deadline = time.monotonic() + timeout
    while marker not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
    assert marker in seen, seen.decode(errors="replace")
    return seen


def test_run_uses_the_default_model_and_the_files_settings_until_flags_say_otherwise(
    cache: Path, isolated_config: Path, starter_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a user runs it: `models default`, then `run` in a new process, offline, through llama.cpp."""
    write_cached_repo(cache, "test-org/SmolLM2-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": Path(starter_path)})
    assert run(capsys, "models", "default", "test-org/SmolLM2-GGUF:Q4_1")[0] == 0
    for key, value in (("max_tokens", "3"), ("ctx", "512"), ("temperature", "0"),
                       ("system_prompts.terse", "You answer in one short sentence.")):
        assert run(capsys, "config", "set", key, value)[0] == 0

    def run_json(*args: str) -> dict:
        result = subprocess.run([*LLMLOCAL, "run", "Say hi.", "--json", *args], capture_output=True, text=True,
                                timeout=300, env=dict(os.environ))
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    from_file = run_json("--system-preset", "terse")
    assert from_file["model"] == "test-org/SmolLM2-GGUF:Q4_1"
    assert (from_file["completion_tokens"], from_file["n_ctx"]) == (3, 512)

    from_flags = run_json("--model", "smollm2-135m", "-n", "2", "--ctx", "1024", "--system", "You answer in one short sentence.")
    assert from_flags["model"] == "smollm2-135m"
    assert (from_flags["completion_tokens"], from_flags["n_ctx"]) == (2, 1024)
    # the preset is that text: the same file, the same prompt, the same number of prompt tokens
    assert from_flags["prompt_tokens"] == from_file["prompt_tokens"]
