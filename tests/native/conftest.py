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
from cpu_flags import ISA_FLAGS, missing
from llmlocal.native import cpu as si4


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The native kernels set to one ISA path for the test: skipped where /proc/cpuinfo lacks
    its instructions, failed where the CPU has them and the build does not run the path."""
    lacking = missing(ISA_FLAGS[request.param])
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)} (the {request.param} path)")
    assert request.param in si4.available_isas(), f"the CPU has the {request.param} instructions, the build no such path"
    before = si4.isa()
    si4.set_isa(request.param)
    yield request.param
    si4.set_isa(before)
