"""The progress printer: a short log when stderr is not a terminal, a bar redrawn in place when it is."""

from __future__ import annotations

import io

from llmlocal.quant.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_stream_gets_one_line_per_tenth() -> None:
    stream = io.StringIO()
    p = Progress("converting", 1000, items=10, stream=stream)
    for i in range(100):
        p.advance(10, items=int(i % 10 == 9))
    lines = stream.getvalue().splitlines()
    assert 10 <= len(lines) <= 11
    assert lines[-1].startswith("converting [####################] 100%  10/10 tensors  1 KB/1 KB")


def test_terminal_gets_a_bar_redrawn_in_place() -> None:
    stream = _Terminal()
    p = Progress("evaluating", 300, unit="tokens", stream=stream)
    p.update(300)
    p.close()
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert "300/300 tokens" in text


def test_listener_sees_every_update_and_disabled_output_stays_silent() -> None:
    seen = []
    stream = io.StringIO()
    p = Progress("x", 4, stream=stream, enabled=False, listener=lambda phase, done, total: seen.append((phase, done, total)))
    p.advance(1)
    p.advance(3)
    assert seen == [("x", 1, 4), ("x", 4, 4)]
    assert stream.getvalue() == ""
