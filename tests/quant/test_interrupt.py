"""Interrupted or failed conversions leave nothing at OUT and no temporary files behind."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from quant_checks import assert_one_sentence_error, leftovers

from llmlocal.quant.pipeline import QuantizeJob, quantize

# Runs `llmlocal ...` in a fresh interpreter.
_CLI = "import sys; from llmlocal.app import cli\nraise SystemExit(cli.main(sys.argv[1:]))"


def _interrupt_when(phase_prefix: str, after: float) -> Callable[[str, int, int], None]:
    def listener(phase: str, done: int, total: int) -> None:
        if phase.startswith(phase_prefix) and done >= after * total:
            raise KeyboardInterrupt

    return listener


@pytest.mark.parametrize("type_name, phase", [("q8_0", "converting"), ("q4_k_m", "writing the BF16 reference")])
def test_ctrl_c_during_conversion_leaves_nothing(random_checkpoint: Callable[..., Path], tmp_path: Path,
                                                 type_name: str, phase: str) -> None:
    src = random_checkpoint(layers=4, d=256, heads=4, kv_heads=2, ffn=512)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.gguf"
    with pytest.raises(KeyboardInterrupt):
        quantize(QuantizeJob(src=str(src), out=str(out), type=type_name), listener=_interrupt_when(phase, 0.3))
    assert not out.exists()
    assert list(out_dir.iterdir()) == []


def test_ctrl_c_keeps_a_previous_output_intact(random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "model.gguf"
    out.write_bytes(b"the previous, complete file")
    with pytest.raises(KeyboardInterrupt):
        quantize(QuantizeJob(src=str(random_checkpoint()), out=str(out), type="q8_0", evaluate=False),
                 listener=_interrupt_when("converting", 0.5))
    assert out.read_bytes() == b"the previous, complete file"
    assert leftovers(tmp_path) == []


def test_sigint_during_llama_cpp_quantization_stops_it(starter_checkpoint: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: our process and the quantizer child."""
    out = tmp_path / "smol.gguf"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI, "quantize", str(starter_checkpoint), "-o", str(out), "--type", "q4_k_m", "--no-eval"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        # The phase's first line is printed when the child reports its first tensor ("[ 1/ N]"
        # from llama.cpp's log): the child is inside llama_model_quantize now, no wait needed.
        if line.startswith("quantizing to Q4_K_M"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    else:
        pytest.fail("the quantization phase never started: " + "".join(seen))
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, "".join(seen) + rest
    assert "Traceback" not in rest
    assert not out.exists() and leftovers(tmp_path) == []
    still_running = subprocess.run(["pgrep", "-f", f"llama_quantize .*{tmp_path}"], capture_output=True, text=True)
    assert still_running.stdout == ""


def test_full_disk_is_one_sentence_and_leaves_nothing(random_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = random_checkpoint(layers=2, d=256, heads=4, kv_heads=2, ffn=512)
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()

    def limit_file_size() -> None:  # a 200 kB disk: writes past it fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    result = subprocess.run(
        [sys.executable, "-c", _CLI, "quantize", str(src), "-o", str(out), "--type", "f32", "--no-eval"],
        capture_output=True, text=True, preexec_fn=limit_file_size, timeout=120,
    )
    assert_one_sentence_error(result.returncode, result.stderr, "ran out of space", "-o")
    assert list(out.parent.iterdir()) == []
