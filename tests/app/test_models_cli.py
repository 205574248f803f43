"""`llmlocal models list|pull|rm|info` against a Hugging Face cache laid out by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from hf_cache import tiny_checkpoint_files, write_cached_repo
from llmlocal.app.cli import main
from llmlocal.models.sizes import format_size

REPO = "test-org/Tiny-GGUF"


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
    write_cached_repo(cache, "test-org/tiny-checkpoint", tiny_checkpoint_files())
    return cache


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_prints_one_row_per_model(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", "SOURCE", "WHERE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"smollm2-135m", f"{REPO}:Q4_K_M", f"{REPO}:Q8_0", "test-org/tiny-checkpoint"}
    assert rows["smollm2-135m"][3:7] == ["Q4_1", "llama", "8,192", "starter"]
    assert rows[f"{REPO}:Q8_0"][-2] == "hf-cache" and rows[f"{REPO}:Q8_0"][-1].endswith("Tiny-Q8_0.gguf")
    assert rows["test-org/tiny-checkpoint"][3:7] == ["BF16", "llama", "4,096", "hf-cache"]


def test_list_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "ls", "--json")
    assert code == 0
    models = {m["name"]: m for m in json.loads(out)}
    q4 = models[f"{REPO}:Q4_K_M"]
    assert q4["size_bytes"] == os.path.getsize(q4["path"]) and q4["context_length"] == 128
    assert q4["source"] == "hf-cache" and q4["repo_id"] == REPO


def test_info_prints_the_spec_and_the_planner_slot(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "info", f"{REPO}:q4_k_m")
    assert code == 0
    assert out.splitlines()[0] == f"{REPO}:Q4_K_M"
    fields = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()[1:] if not line.strip().startswith("- ")}
    assert fields["architecture"] == "llama" and fields["layers"] == "2" and fields["context_length"] == "128"
    assert fields["source"].startswith("hf-cache")
    assert fields["plan"]  # the memory planner's verdict for this machine

    code, out, _ = run(capsys, "models", "info", "smollm2-135m", "--json")
    info = json.loads(out)
    assert (info["layers"], info["heads"], info["kv_heads"], info["file_type"], info["source"]) == (30, 9, 3, "Q4_1", "starter")
    assert "Q4_1" in info["plan"]["verdict"] and info["plan"]["reasons"]


def test_rm_asks_for_yes_without_a_terminal_then_frees_the_space(cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    q8 = cache / "models--test-org--Tiny-GGUF" / "snapshots"
    q8 = next(q8.iterdir()) / "Tiny-Q8_0.gguf"
    size = os.path.getsize(q8)
    code, _, err = run(capsys, "models", "rm", f"{REPO}:Q8_0")
    assert code == 2 and "pass --yes" in err and q8.exists()
    code, out, _ = run(capsys, "models", "rm", f"{REPO}:Q8_0", "--yes")
    assert code == 0 and not q8.exists()
    assert out.strip() == f"Removed {REPO}:Q8_0: freed {format_size(size)}."
    assert format_size(size).endswith(" KiB")  # binary units, as every size llmlocal shows


def test_offline_pull_and_missing_models_are_one_sentence(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "pull", f"{REPO}:Q4_K_M")
    assert code == 0 and out.startswith(f"Already downloaded: {REPO}:Q4_K_M (")
    code, _, err = run(capsys, "models", "pull", "test-org/elsewhere:Q4_K_M")
    assert code == 2
    assert err.strip() == (
        "llmlocal: test-org/elsewhere:Q4_K_M is not downloaded and HF_HUB_OFFLINE is set: "
        "unset it and run `llmlocal models pull test-org/elsewhere:Q4_K_M` again."
    )
    code, _, err = run(capsys, "models", "info", "test-org/elsewhere:Q4_K_M")
    assert code == 2 and err.strip().endswith("run `llmlocal models pull test-org/elsewhere:Q4_K_M`.")


def test_pull_of_a_cached_checkpoint_suggests_quantize(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "models", "pull", "test-org/tiny-checkpoint")
    assert code == 0
    assert "make a GGUF with `llmlocal quantize test-org/tiny-checkpoint`" in out


def test_run_uses_a_cached_model_offline_in_a_subprocess(cache: Path, starter_path: str) -> None:
    """A Hub name end to end, as a user runs it: offline, from the cache, through llama.cpp."""
    write_cached_repo(cache, "test-org/SmolLM2-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": Path(starter_path)})
    result = subprocess.run(
        [sys.executable, "-m", "llmlocal.app", "run", "Say hi.", "--model", "test-org/SmolLM2-GGUF:Q4_1",
         "--temperature", "0", "--max-tokens", "5", "--json", "--ctx", "512"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ), check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["model"] == "test-org/SmolLM2-GGUF:Q4_1" and out["completion_tokens"] == 5
