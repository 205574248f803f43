"""Fixtures of the quantize tests: the starter model as a Hugging Face checkpoint (built once per
session), its conversions, and a way to call `llmlocal quantize` as the CLI does."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from quant_builders import build_random_checkpoint, build_starter_checkpoint  # noqa: E402

from llmlocal.quant.pipeline import QuantizeJob, QuantizeResult, quantize  # noqa: E402


@pytest.fixture(scope="session")
def starter_checkpoint(tmp_path_factory: pytest.TempPathFactory, starter_path: str) -> Path:
    """SmolLM2-135M-Instruct as users bring it: F32 safetensors, config.json, tokenizer files."""
    directory = tmp_path_factory.mktemp("starter") / "SmolLM2-135M-Instruct"
    build_starter_checkpoint(starter_path, directory, dtype="F32")
    return directory


@pytest.fixture(scope="session")
def starter_outputs(tmp_path_factory: pytest.TempPathFactory, starter_checkpoint: Path) -> Callable[[str], QuantizeResult]:
    """Convert the starter checkpoint to a type once per session (no quality report)."""
    out_dir = tmp_path_factory.mktemp("starter-out")
    done: dict[str, QuantizeResult] = {}

    def get(type_name: str) -> QuantizeResult:
        if type_name not in done:
            job = QuantizeJob(src=str(starter_checkpoint), out=str(out_dir / f"starter-{type_name}.gguf"),
                              type=type_name, evaluate=False)
            done[type_name] = quantize(job, stream=None)
        return done[type_name]

    return get


@pytest.fixture
def random_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "tiny", **kw: object) -> Path:
        directory = tmp_path / name
        build_random_checkpoint(directory, **kw)  # type: ignore[arg-type]
        return directory

    return make


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `llmlocal ARGS` in-process through the real entry point; returns (code, stdout, stderr)."""
    from llmlocal.app import cli as cli_module

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli_module.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run

