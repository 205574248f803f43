"""The progress display: a short log when stderr is not a terminal, a tqdm bar redrawn in place
when it is; `models pull` and `quantize` render through the same function, in the same units."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from llmlocal.models import progress as progress_module
from llmlocal.models.sizes import format_size
from llmlocal.quant.pipeline import QuantizeJob, quantize
from llmlocal.quant.progress import Progress

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from fake_hub import FakeHub  # noqa: E402

# One line of the display: label, a 20-column bar, the percentage, then the figures.
LINE = re.compile(r"^(?P<label>.+?) \[(?P<bar>[#.]{20})\] +(?P<pct>\d+)%  (?P<figures>.+)$")
SIZE = r"\d+(?:\.\d)? (?:B|KiB|MiB|GiB)"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_size_formatter_uses_binary_units() -> None:
    assert format_size(1023) == "1023 B"
    assert format_size(1024) == "1.0 KiB"
    assert format_size(1.5 * 2**20) == "1.5 MiB"
    assert format_size(512 * 2**20) == "512 MiB"
    assert format_size(4.2 * 2**30) == "4.2 GiB"
    assert format_size(1023.97 * 1024) == "1.0 MiB"  # never "1024 KiB"


def test_plain_stream_gets_one_line_per_tenth() -> None:
    stream = io.StringIO()
    p = Progress("converting", 1000, items=10, stream=stream)
    for i in range(100):
        p.advance(10, items=int(i % 10 == 9))
    lines = stream.getvalue().splitlines()
    assert 10 <= len(lines) <= 11
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert lines[-1].startswith("converting [####################] 100%  10/10 tensors  1000 B/1000 B  in ")
    assert all(LINE.match(line) for line in lines)


def test_terminal_gets_a_bar_redrawn_in_place() -> None:
    stream = _Terminal()
    p = Progress("evaluating", 300, unit="tokens", stream=stream)
    p.update(300)
    p.close()
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    last = text.rstrip("\n").split("\r")[-1].rstrip()
    assert last.startswith("evaluating [####################] 100%  300/300 tokens  in ")


def test_listener_sees_every_update_and_disabled_output_stays_silent() -> None:
    seen = []
    stream = io.StringIO()
    p = Progress("x", 4, stream=stream, enabled=False, listener=lambda phase, done, total: seen.append((phase, done, total)))
    p.advance(1)
    p.advance(3)
    assert seen == [("x", 1, 4), ("x", 4, 4)]
    assert stream.getvalue() == ""


def test_a_phase_without_updates_draws_nothing() -> None:
    stream = _Terminal()
    Progress("downloading", 0, stream=stream).close()
    assert stream.getvalue() == ""


def _record_renders(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(label, unit) of every line drawn, recorded on the way into the real `render`."""
    calls: list[tuple[str, str]] = []
    real = progress_module.render

    def recording(label: str, *args: Any, unit: str = "bytes", **kwargs: Any) -> str:
        calls.append((label, unit))
        return real(label, *args, unit=unit, **kwargs)

    monkeypatch.setattr(progress_module, "render", recording)
    return calls


def test_pull_and_quantize_draw_through_the_same_renderer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make_gguf: Callable[..., Path],
    random_checkpoint: Callable[..., Path],
) -> None:
    from llmlocal.models.hub import download, parse_hub_name

    calls = _record_renders(monkeypatch)
    # A real download by huggingface_hub from a stand-in Hub on loopback.
    repo = "test-org/Tiny-GGUF"
    fake = FakeHub({repo: {"Tiny-Q4_K_M.gguf": make_gguf(name="a.gguf").read_bytes() + bytes(3 << 20)}})
    server, url = fake.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    pull_log = io.StringIO()
    try:
        import huggingface_hub.constants as hf_constants

        monkeypatch.setattr(hf_constants, "ENDPOINT", url)
        monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        got = download(parse_hub_name(f"{repo}:Q4_K_M"), stream=pull_log)
    finally:
        server.shutdown()
        server.server_close()
    assert got.path.stat().st_size == len(fake.repos[repo]["Tiny-Q4_K_M.gguf"])

    quantize_log = io.StringIO()
    quantize(QuantizeJob(src=str(random_checkpoint()), out=str(tmp_path / "q.gguf"), type="q8_0", evaluate=False),
             stream=quantize_log)

    pulled = [line for line in pull_log.getvalue().splitlines() if LINE.match(line)]
    converted = [line for line in quantize_log.getvalue().splitlines() if line.startswith("converting")]
    assert pulled and converted
    assert ("downloading test-org/Tiny-GGUF:Q4_K_M", "bytes") in calls
    assert ("converting to Q8_0", "bytes") in calls
    # The same shape and the same units: "<label> [bar] 100%  [items]  <size>/<size>  in m:ss".
    for last in (pulled[-1], converted[-1]):
        m = LINE.match(last)
        assert m is not None and m["bar"] == "#" * 20 and m["pct"] == "100", last
        assert re.search(rf"  {SIZE}/{SIZE}  ", last), last
    total = format_size(len(fake.repos[repo]["Tiny-Q4_K_M.gguf"]))
    assert pulled[-1].startswith(f"downloading {repo}:Q4_K_M [####################] 100%  {total}/{total}")
