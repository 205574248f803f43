"""The instruction counter (`count_instructions`): callgrind's count inside a kernel's function is
the same in two runs of the same build, a call of more rows of x costs more instructions in all
and fewer per weight-row (the codes are unpacked once for every row), and the figure is in the
range a kernel of these types can have. Not a speed."""

from __future__ import annotations

import shutil

import pytest
from cpu_flags import ISA_FLAGS, missing
from llmlocal.native.cpu import runtime

pytestmark = [
    pytest.mark.skipif(not runtime.built(), reason="the native extension is not built"),
    pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed"),
]


def test_counts_are_exact_and_rows_share_the_unpacking() -> None:
    from llmlocal.native.cpu.ab_kernels import current_build
    from llmlocal.native.cpu.count_instructions import count, per_weight

    kernel = "scalar" if missing(ISA_FLAGS["avx2"]) else "avx2"
    build, part = current_build(), ("o",)  # the 1536 x 1536 projection alone: quick under valgrind
    one = count(build, "Q4_K", kernel, 1, 1, part)
    assert one == count(build, "Q4_K", kernel, 1, 1, part) and one > 0
    one_row, four_rows = per_weight(build, "Q4_K", kernel, 1, part), per_weight(build, "Q4_K", kernel, 4, part)
    assert 0.01 < four_rows < one_row < 20.0, (one_row, four_rows)
