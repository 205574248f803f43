"""Run the Triton kernels of these tests in Triton's CPU interpreter; `isa` runs a test on each
of the native kernels' ISA paths this machine has.

The paged-attention modules wrap their kernels with triton.jit at the first launch, not at
import, and triton.jit picks interpreter or compiler from TRITON_INTERPRET at that moment.
So setting the variable per test is enough, whatever imported triton earlier, and it does not
leak into the rest of the suite (where it would send every CPU kernel call to the slow
interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llmlocal.native import sparse_int4 as si4


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The native kernels set to one ISA path for the test (skipped where the CPU lacks it)."""
    if request.param not in si4.available_isas():
        pytest.skip(f"this CPU or build has no {request.param} path")
    before = si4.isa()
    si4.set_isa(request.param)
    yield request.param
    si4.set_isa(before)
