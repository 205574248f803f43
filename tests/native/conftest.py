"""Run the Triton kernels of these tests in Triton's CPU interpreter.

The paged-attention modules wrap their kernels with triton.jit at the first launch, not at
import, and triton.jit picks interpreter or compiler from TRITON_INTERPRET at that moment.
So setting the variable per test is enough, whatever imported triton earlier, and it does not
leak into the rest of the suite (where it would send every CPU kernel call to the slow
interpreter).
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
