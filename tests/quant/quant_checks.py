"""Assertions shared by the quantize tests."""

from __future__ import annotations

from pathlib import Path


def assert_one_sentence_error(code: int, err: str, *phrases: str) -> None:
    """What every user error must look like: exit code 2, one line on stderr, no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    # Progress lines and notes may precede it; the error is the one other "llmlocal:" line, last.
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("llmlocal: ") and not line.startswith("llmlocal: note:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert errors[0].rstrip().endswith("."), errors[0]
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def leftovers(directory: Path) -> list[str]:
    """Files a conversion must not leave behind: partial outputs and temporaries."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith((".partial", ".tmp")))
