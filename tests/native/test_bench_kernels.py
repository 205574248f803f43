"""`bench kernels`: the cost-curve benchmark runs every type on every kernel this CPU has, and
its figures are consistent with each other (it asserts no speed: benchmarks are not tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmlocal.native.cpu import runtime

pytestmark = pytest.mark.skipif(not runtime.built(), reason="the native kernels are not built")


def test_random_rows_decode_to_finite_weights_of_the_right_shape() -> None:
    from llmlocal.native.cpu.bench_kernels import TYPES, _type_id, random_rows

    rng = np.random.default_rng(0)
    for name in TYPES:
        rows = random_rows(_type_id(name), 64, 512, rng)
        w = rows.decode().dequantize()
        assert w.shape == (64, 512) and np.isfinite(w).all(), name


def test_the_curve_is_consistent_for_every_type_and_kernel_here() -> None:
    from llmlocal.native.cpu import bench_kernels as bk

    before, threads = runtime.qmat_kernel(), runtime.num_threads()
    weights = sum(n * k for _, k, n in bk.LAYER_1_5B)
    kernels = ["scalar"] + [k for k in bk.KERNELS[1:] if _runs(k)]
    try:
        for kernel in kernels:
            result = bk.bench_kernels(list(bk.ALL_TYPES) if kernel == before else ["Q4_K"], rows=(1, 3), kernel=kernel,
                                      working_set_mb=1, repeats=1)
            assert result["kernel"] == kernel
            for name, k in result["kernels"].items():
                assert k["rows"] == [1, 3] and k["cost_vs_one_row"][0] == 1.0
                for r, ms, g in zip(k["rows"], k["ms"], k["g_weight_rows_s"]):
                    assert ms > 0 and math.isclose(g, weights * r / (ms / 1e3) / 1e9, rel_tol=0.02), (kernel, name)
            if kernel != "scalar":
                assert result["peak_g_mac_s"] > 0
            if kernel in ("avx2", "avx512vnni"):  # a figure, never compared with the peak: timings on a shared host are noise
                assert result["pass_peak_g_mac_s"] > 0
            else:
                assert "pass_peak_g_mac_s" not in result
    finally:
        bk.use_kernel(before)
        runtime.set_num_threads(threads)


def _runs(kernel: str) -> bool:
    from llmlocal.native.cpu.bench_kernels import use_kernel

    try:
        use_kernel(kernel)
        return True
    except ValueError:
        return False


def test_the_cli_refuses_an_unknown_type_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from llmlocal.app import cli

    assert cli.main(["bench", "kernels", "--types", "Q4_K,Q3_K"]) == 2
    assert "Q3_K" in capsys.readouterr().err


def test_ab_runs_two_builds_in_turns_and_reports_their_ratio() -> None:
    """The A/B harness loads a build from its path in fresh processes (here this build against
    itself): a ratio per type and row count, from both builds' own times."""
    from llmlocal.native.cpu import ab_kernels

    so = ab_kernels.current_build()
    args = {"types": ["Q4_K"], "rows": [1, 2], "kernel": None, "threads": 1, "mb": 1, "repeats": 1}
    res = ab_kernels.ab(so, so, args, rounds=2)
    t = res["types"]["Q4_K"]
    assert res["rounds"] == 2 and res["rows"] == [1, 2]
    for lo, med, hi, b, n in zip(t["speedup_min"], t["speedup_median"], t["speedup_max"], t["base_ms"], t["new_ms"]):
        assert 0 < lo <= med <= hi and b > 0 and n > 0
    assert "Q4_K" in ab_kernels.format_table(res)


def test_ab_refuses_a_ref_that_is_not_a_commit() -> None:
    from llmlocal.native.cpu import ab_kernels

    with pytest.raises(SystemExit, match="neither a built"):
        ab_kernels.resolve("no-such-ref-anywhere")
